"""Atomic, checksummed checkpoints of a training run: trainable weights, optimizer, RNG states, step (the learning
rate is a function of the step), and extra plain fields (counters; the critic's weights and optimizer with PPO).

Files live in RUN_DIR/checkpoints/:

    step_NNNNNN.pt          the state after NNNNNN completed RL steps (torch.save; loadable with weights_only=True)
    step_NNNNNN.pt.sha256   its SHA-256, `sha256sum -c` format ("<hex>  step_NNNNNN.pt")
    latest                  the name of the newest checkpoint (a plain file name, nothing else is followed)

Every file is written to a temporary name in the same folder and renamed into place (rename is atomic on POSIX
file systems), in this order: the .pt, then its checksum, then `latest`. A checkpoint counts as intact only when
its checksum file exists and matches and torch.load(weights_only=True) reads it; `load_latest_intact` (and
`latest_checkpoint`) fall back to the newest intact one with a warning. Nothing in a checkpoint can run code when
it is loaded: RNG states are stored as plain ints, lists and tensors.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_NAME = re.compile(r"step_(\d{6,})\.pt")  # f"step_{step:06d}.pt"; more digits past step 999999
CHECKSUM_SUFFIX = ".sha256"
ORPHAN_PATTERNS = (".step_*.tmp", ".latest.*.tmp")  # temporary names of atomic writes a crash left behind
_HASH_CHUNK = 1 << 24


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (not intact) or the `latest` pointer was ignored."""


class CheckpointCorrupt(ValueError):
    """A checkpoint file is not intact: missing checksum, checksum mismatch, truncated or unreadable."""


# ------------------------------------------------------------------------------------------------ atomic writes

def current_umask() -> int:
    """The process umask (read from /proc where possible: os.umask's set-and-restore races with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _file_mode() -> int:
    """0o644 for written files (not mkstemp's 0o600), narrowed by the process umask."""
    return 0o644 & ~current_umask()


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (POSIX: the directory entry lives in the folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, write) -> Any:
    """Call write(file) on a temporary file next to `path`, fsync it, give it mode 0o644 and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return result


def atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(Path(path), lambda f: f.write(data))


class _HashingWriter:
    """A write-only file object that hashes what passes through it (torch.save writes sequentially)."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def atomic_torch_save(obj: Any, path: Path) -> str:
    """torch.save(obj) atomically; returns the SHA-256 (hex) of the bytes written."""
    def write(f) -> str:
        hashing = _HashingWriter(f)
        torch.save(obj, hashing)
        return hashing.sha.hexdigest()

    return _atomic_write(Path(path), write)


def checksum_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def file_sha256(path: str | Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


# ------------------------------------------------------------------------------------------------ state

def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that training changes (frozen bases are rebuilt from the original checkpoint on resume)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict:
    """Every RNG state as types torch.load(weights_only=True) reads: tensors, ints, floats, strings, lists."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": int(version), "internal": [int(x) for x in internal],
                   "gauss_next": None if gauss_next is None else float(gauss_next)},
        "numpy": {"name": str(name), "keys": [int(x) for x in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached_gaussian)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved."""
    try:
        py, npy = state["python"], state["numpy"]
        python_state = (int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss_next"])
        numpy_state = (str(npy["name"]), np.asarray(npy["keys"], dtype=np.uint32), int(npy["pos"]),
                       int(npy["has_gauss"]), float(npy["cached_gaussian"]))
        torch_state = state["torch"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"RNG state in an unknown layout ({type(e).__name__}: {e}): "
                         "was the checkpoint written by another version of quarl?") from None
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tensors(obj: Any, prefix: str):
    """(dotted name, tensor) for every tensor in nested dicts/lists/tuples."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}.{i}")


_PLAIN = (bool, int, float, str, bytes, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)


def _check_plain(obj: Any, name: str) -> None:
    """TypeError unless `obj` is made of types torch.load(weights_only=True) reads back (else the checkpoint would
    be written fine and then never load)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_plain(k, f"{name} key")
            _check_plain(v, f"{name}.{k}")
    elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_plain(v, f"{name}.{i}")
    elif not isinstance(obj, _PLAIN) or (isinstance(obj, (int, float, str)) and type(obj) not in _PLAIN):
        raise TypeError(f"checkpoint field {name} is a {type(obj).__name__}: only plain types (int, float, str, "
                        "bool, None, tensors, lists, tuples, dicts) load with weights_only=True")


def check_finite(named_tensors) -> None:
    """ValueError naming the first floating-point tensor holding NaN/Inf (one isfinite().all() per tensor, one
    host sync per device)."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named_tensors:
        if t.is_floating_point() or t.is_complex():
            by_device.setdefault(t.device, []).append((name, t))
    bad = []
    for items in by_device.values():
        ok = torch.stack([torch.isfinite(t).all() for _, t in items]).cpu()
        bad += [items[i] for i in range(len(items)) if not ok[i]]
    if bad:
        name, t = bad[0]
        n = int((~torch.isfinite(t)).sum())
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise ValueError(f"refusing to save a checkpoint: {name} holds {n} non-finite value(s) (NaN/Inf) out of "
                         f"{t.numel()}{more}; the previous checkpoint is kept")


# ------------------------------------------------------------------------------------------------ save

def _step_of(path: Path) -> int | None:
    m = CHECKPOINT_NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


def checkpoint_files(folder: str | Path) -> list[Path]:
    """step_*.pt files in `folder` (plain names only), oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _step_of(p) is not None and p.is_file()]
    return sorted(found, key=_step_of)


def remove_orphans(folder: str | Path) -> list[Path]:
    """Remove temporary files a crash left in the checkpoints folder, and checksums whose checkpoint is gone."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for pattern in ORPHAN_PATTERNS:
        removed += [p for p in folder.glob(pattern) if p.is_file()]
    for p in folder.glob("step_*.pt" + CHECKSUM_SUFFIX):
        pt = p.with_name(p.name[: -len(CHECKSUM_SUFFIX)])
        if CHECKPOINT_NAME.fullmatch(pt.name) and not pt.exists():
            removed.append(p)
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, keep: int = 2, **extra) -> Path:
    """Write the state after `step` completed RL steps; keep the newest `keep` (>= 1) checkpoints. Returns the path.

    Refuses (ValueError, nothing written) when a trainable parameter, an optimizer tensor or a tensor among the
    `extra` values (e.g. a critic's weights and optimizer state) holds NaN/Inf. Writes
    the .pt, then its .sha256, then `latest`, each atomically; then removes older checkpoints beyond `keep`, any
    with a higher step (left from before a resume that fell back past them) and temporary files a crash left
    behind. `extra` values must be plain types (weights_only=True loads them).
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: must be an integer >= 1 (checkpoints to keep)")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: must be an integer >= 0")
    folder = Path(run_dir) / "checkpoints"
    path = folder / f"step_{step:06d}.pt"
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer_state = optimizer.state_dict()
    for key, value in extra.items():
        _check_plain(value, key)
    check_finite(list(trainable.items()) + list(_tensors(optimizer_state, "optimizer"))
                 + [item for key, value in extra.items() for item in _tensors(value, key)])
    state = {
        "step": step,
        "model": {n: p.detach().cpu().clone() for n, p in trainable.items()},
        "optimizer": optimizer_state,
        "rng": rng_state(),
        **extra,
    }
    remove_orphans(folder)  # a crashed save's partial file: free its space before writing the next one
    digest = atomic_torch_save(state, path)
    atomic_write_bytes(checksum_path(path), f"{digest}  {path.name}\n".encode())
    atomic_write_bytes(folder / "latest", path.name.encode())
    # Keep this one and the keep-1 before it. Higher steps than this one are left from a timeline the run has
    # abandoned (it resumed from an older checkpoint because they were damaged): they go too.
    older = [p for p in checkpoint_files(folder) if _step_of(p) < step]
    drop = older[: max(len(older) - (keep - 1), 0)] + [p for p in checkpoint_files(folder) if _step_of(p) > step]
    for p in drop:
        p.unlink(missing_ok=True)  # the .pt first: a crash in between leaves an orphan checksum, not a bare .pt
        checksum_path(p).unlink(missing_ok=True)
    remove_orphans(folder)
    return path


# ------------------------------------------------------------------------------------------------ verify / load

def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def verify_checkpoint(path: str | Path) -> str | None:
    """Why the checkpoint file is not intact (missing, empty, no checksum, checksum mismatch), or None when its
    bytes match its .sha256 file. Reads the whole file once."""
    path = Path(path)
    if not path.is_file():
        return "missing"
    if path.stat().st_size == 0:
        return "empty file"
    sums = checksum_path(path)
    if not sums.is_file():
        return f"no checksum file {sums.name}"
    try:
        fields = sums.read_text(errors="replace").split()
    except OSError as e:
        return f"unreadable checksum file ({_short(e)})"
    if not fields or not re.fullmatch(r"[0-9a-fA-F]{64}", fields[0]):
        return f"malformed checksum file {sums.name}"
    try:
        actual = file_sha256(path)
    except OSError as e:
        return f"unreadable ({_short(e)})"
    if actual != fields[0].lower():
        return "SHA-256 mismatch (truncated or corrupted)"
    return None


def read_checkpoint(path: str | Path) -> dict:
    """The verified state dict of one checkpoint file (torch.load with weights_only=True: no code runs).
    Raises CheckpointCorrupt (a ValueError) with a one-line reason when the file is not intact."""
    path = Path(path)
    reason = verify_checkpoint(path)
    if reason is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch/pickle/zip errors: reported in one line, not as a traceback wall
            reason = f"torch.load failed ({_short(e)})"
        else:
            if not isinstance(state, dict):
                reason = f"holds a {type(state).__name__}, not a checkpoint dict"
    if reason is not None:
        raise CheckpointCorrupt(f"checkpoint {path} is not intact: {reason}")
    return state


def _read_pointer(folder: Path) -> Path | None:
    """The checkpoint `latest` names, or None; a name that is not a plain step_NNNNNN.pt in `folder` (a path,
    `..`, an absolute path) is ignored with a warning."""
    pointer = folder / "latest"
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text(errors="replace").strip()
    except OSError as e:
        warnings.warn(f"{pointer}: unreadable ({_short(e)}); using the newest intact checkpoint",
                      CheckpointWarning, stacklevel=4)
        return None
    if not CHECKPOINT_NAME.fullmatch(name):
        warnings.warn(f"{pointer} names {name[:80]!r}, not a step_NNNNNN.pt file in that folder: ignored; using the "
                      "newest intact checkpoint", CheckpointWarning, stacklevel=4)
        return None
    path = folder / name
    if not path.is_file():
        warnings.warn(f"{pointer} names {name}, which does not exist; using the newest intact checkpoint",
                      CheckpointWarning, stacklevel=4)
        return None
    return path


def _candidates(folder: Path) -> list[Path]:
    """The checkpoint `latest` names first, then every step_*.pt, newest step first."""
    first = _read_pointer(folder)
    rest = [p for p in reversed(checkpoint_files(folder)) if p != first]
    return ([first] if first is not None else []) + rest


def _no_intact_error(folder: Path, bad: list[str]) -> FileNotFoundError:
    shown = "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
    return FileNotFoundError(f"no intact checkpoint in {folder} ({shown})")


def _skip_warning(path: Path, reason: str) -> None:
    warnings.warn(f"checkpoint {path} is not intact ({reason}): falling back to an older one",
                  CheckpointWarning, stacklevel=3)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest intact checkpoint of a run (the one `latest` names when it is intact, else the newest step_*.pt
    whose checksum matches; a warning names each skipped file). None when the run has no checkpoint at all;
    FileNotFoundError when it has some but none is intact. Verifies checksums only: prefer `load_latest_intact`,
    which also falls back past a file torch.load cannot read and reads each file's bytes once less."""
    folder = Path(run_dir) / "checkpoints"
    candidates = _candidates(folder)
    if not candidates:
        return None
    bad = []
    for path in candidates:
        reason = verify_checkpoint(path)
        if reason is None:
            return path
        _skip_warning(path, reason)
        bad.append(f"{path.name}: {reason}")
    raise _no_intact_error(folder, bad)


REQUIRED_KEYS = ("step", "model")
RESUME_KEYS = ("optimizer", "rng")


def apply_checkpoint(state: dict, model, optimizer=None, path: str | Path = "checkpoint") -> dict:
    """Copy a checkpoint's weights (and, with `optimizer`, its optimizer and RNG states) into place."""
    need = REQUIRED_KEYS + (RESUME_KEYS if optimizer is not None else ())
    missing_keys = [k for k in need if k not in state]
    if missing_keys:
        raise ValueError(f"checkpoint {path} lacks {missing_keys}: it was not written by quarl's save_checkpoint")
    if not isinstance(state["model"], dict) or not all(isinstance(v, torch.Tensor) for v in state["model"].values()):
        raise ValueError(f"checkpoint {path}: 'model' is not a dict of tensors")
    params = dict(model.named_parameters())
    missing = [n for n in state["model"] if n not in params]
    if missing:
        raise ValueError(
            f"checkpoint {path} holds parameters this model lacks ({missing[:3]}...): was the run's config changed?"
        )
    absent = [n for n, p in params.items() if p.requires_grad and n not in state["model"]]
    if absent:
        raise ValueError(f"checkpoint {path} lacks {len(absent)} trainable parameter(s) of this model "
                         f"({absent[:3]}...): was the run's config (LoRA, precision) changed?")
    shapes = [f"{n} {tuple(v.shape)} vs {tuple(params[n].shape)}" for n, v in state["model"].items()
              if v.shape != params[n].shape]
    if shapes:
        raise ValueError(f"checkpoint {path}: parameter shapes differ from this model's ({shapes[0]}"
                         f"{'...' if len(shapes) > 1 else ''}): was the model changed?")
    with torch.no_grad():
        for name, value in state["model"].items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
    if optimizer is not None:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
            raise ValueError(f"checkpoint {path}: its optimizer state does not fit this optimizer ({_short(e)}): "
                             "was the run's config changed?") from None
        set_rng_state(state["rng"])
    return state


def load_checkpoint(path: str | Path, model, optimizer=None) -> dict:
    """Verify and restore one checkpoint in place (weights; with `optimizer` also its state and the RNG states);
    returns the whole state dict (step, extra fields). CheckpointCorrupt (a ValueError) when it is not intact."""
    return apply_checkpoint(read_checkpoint(path), model, optimizer, path)


def load_latest_intact(run_dir: str | Path, model, optimizer=None) -> tuple[dict, Path]:
    """Restore the newest intact checkpoint of a run in place; returns (state, path).

    Tries the checkpoint `latest` names, then older ones, newest first; each one that is not intact (checksum
    missing or wrong, empty, truncated, torch.load fails) is skipped with a one-line CheckpointWarning.
    FileNotFoundError (one line, naming the folder) when the run has no intact checkpoint. A checkpoint that is
    intact but does not fit the model (config changed) raises ValueError: an older one would not fit either.
    """
    folder = Path(run_dir) / "checkpoints"
    candidates = _candidates(folder)
    if not candidates:
        if folder.is_dir() and any(folder.glob("step_*.dcp")):
            raise FileNotFoundError(f"{folder} holds only sharded checkpoints, written under torchrun: resume the run "
                                    "under torchrun (`quarl train --nproc N CONFIG resume=RUN_DIR`, N >= 1)")
        raise FileNotFoundError(f"no checkpoint in {folder}")
    bad = []
    for path in candidates:
        try:
            state = read_checkpoint(path)
        except CheckpointCorrupt as e:
            reason = str(e).split(" is not intact: ", 1)[-1]
            _skip_warning(path, reason)
            bad.append(f"{path.name}: {reason}")
            continue
        return apply_checkpoint(state, model, optimizer, path), path
    raise _no_intact_error(folder, bad)
