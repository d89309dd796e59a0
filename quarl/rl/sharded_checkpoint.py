"""Sharded checkpoints of a run on many ranks, with `torch.distributed.checkpoint` (DCP).

Folder layout in RUN_DIR/checkpoints/:

    step_NNNNNN.dcp/            the state after NNNNNN completed RL steps
        .metadata, __*_*.distcp DCP's files: every rank writes its own shards of the trainable parameters (float32
                                masters) and of the AdamW state; DCP's metadata records the global shapes
        quarl.json              step, run counters, the world size it was written on, and the SHA-256 of every
                                other file of the folder

Written atomically: every rank writes into `.step_NNNNNN.dcp.tmp/`, the ranks checksum the files (each a share, in
parallel), rank 0 writes quarl.json last and renames the folder into place (rename is atomic on POSIX file systems). A folder counts as
intact only when quarl.json exists and every checksum matches; a run killed while writing leaves only a `.tmp`
folder, which loading ignores and the next save removes. Loading reshards: DCP reads the global tensors into
however many ranks load them (1 included). Frozen parameters (a LoRA base) are not saved: they come from the
model as loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from quarl import distributed as qdist
from quarl.rl.checkpoint import CheckpointWarning, _fsync_dir, atomic_write_bytes, file_sha256
from quarl.rl.master_weights import MasterWeightAdamW

SHARDED_NAME = re.compile(r"step_(\d{6,})\.dcp")
META_NAME = "quarl.json"


def _state(model, optimizer):
    """{"model": trainable parameters, "optim": AdamW state} as DCP state dicts: of the sharded model (DTensors) and
    its AdamW, or, for a one-rank run that keeps the one-process model, of a `MasterWeightAdamW` (`_master_state`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if isinstance(optimizer, MasterWeightAdamW):
        return _master_state(model, optimizer)
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model_state, "optim": optim_state}


def _master_state(model, optimizer: MasterWeightAdamW) -> dict:
    """The state dicts `get_state_dict(..., ignore_frozen_params=True)` gives for the sharded model, built from an
    unsharded model and its optimizer: "model" holds every entry of the model's state dict except frozen parameters
    (a trainable parameter as its float32 master, under each name it has: tied embeddings appear as both
    embed_tokens and lm_head; buffers such as a qlora base's codes as they are), "optim" AdamW's state and param
    groups by parameter name. The tensors are the model's and the optimizer's own (a parameter without AdamW state
    yet gets zeros and step 0, which AdamW's first step treats as a fresh state), so DCP loads straight into them.
    Checkpoints are the same whichever way they were written and load on any number of ranks."""
    names = {id(p): n for n, p in model.named_parameters()}
    fqn = {id(m): names[id(p)] for p, m in zip(optimizer.params, optimizer.masters)}
    master_of = {id(p): m for p, m in zip(optimizer.params, optimizer.masters)}
    model_state = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.nn.Parameter):
            if id(t) in master_of:
                model_state[name] = master_of[id(t)]
            elif t.requires_grad:
                raise RuntimeError(f"{name} trains but MasterWeightAdamW does not hold it")
            # else frozen: not saved (it comes from the model as loaded)
        else:
            model_state[name] = t
    adamw = optimizer.optimizer
    state = {}
    for master in optimizer.masters:
        s = adamw.state[master]
        if not s:
            s.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master))
        state[fqn[id(master)]] = s
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[id(m)] for m in g["params"]]}
              for g in adamw.param_groups]
    return {"model": model_state, "optim": {"state": state, "param_groups": groups}}


def _drop_absent_optimizer_state(state: dict, checkpoint: str) -> None:
    """Leave out of a load the AdamW states the checkpoint lacks, and give those parameters a fresh state: a
    sharded run saves none for a parameter that never had a gradient (an expert no token reached)."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    for name in [n for n in state["optim"]["state"] if f"optim.state.{n}.exp_avg" not in saved]:
        for t in state["optim"]["state"].pop(name).values():
            t.zero_()


def sharded_checkpoints(run_dir: str | Path) -> list[Path]:
    """The finished sharded checkpoint folders of a run, oldest first (intact or not)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := SHARDED_NAME.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def verify_sharded(path: str | Path, part: int = 0, parts: int = 1) -> str | None:
    """None when the folder is intact (quarl.json present, every checksum matches), else the reason in words.
    part / parts: check only every parts-th file from the part-th on (the ranks share the hashing)."""
    path = Path(path)
    meta_path = path / META_NAME
    if not meta_path.is_file():
        return f"no {META_NAME} (the save did not finish)"
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable {META_NAME} ({e})"
    for name, digest in sorted(files.items())[part::parts]:
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if file_sha256(f) != digest:
            return f"{name} does not match its checksum"
    return None


def save_sharded_checkpoint(run_dir: str | Path, step: int, model, optimizer, keep: int = 2, **extra) -> Path:
    """Save the sharded model and optimizer after `step` completed steps; every rank must call it. Keeps the newest
    `keep` folders (>= 1). Returns the folder. extra: plain numbers stored in quarl.json."""
    import torch.distributed.checkpoint as dcp

    folder = Path(run_dir) / "checkpoints"
    final = folder / f"step_{step:06d}.dcp"
    tmp = folder / f".{final.name}.tmp"
    if qdist.is_main():
        folder.mkdir(parents=True, exist_ok=True)
        for orphan in folder.glob(".step_*.dcp.tmp"):  # left by a run killed while saving
            shutil.rmtree(orphan, ignore_errors=True)
    qdist.barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=str(tmp))
    qdist.barrier()  # every rank's files are written
    # rank 0's listing for every rank: on a shared file system another rank's cached listing can miss a file
    every = qdist.broadcast_object(sorted(p.name for p in tmp.iterdir() if p.is_file()) if qdist.is_main() else None)
    names = every[qdist.rank()::qdist.world_size()]
    files = {}
    for part in qdist.all_gather_objects({name: file_sha256(tmp / name) for name in names}):  # hashed in parallel
        files.update(part)
    if qdist.is_main():
        meta = {"step": int(step), "world_size": qdist.world_size(), "files": files,
                **{k: int(v) for k, v in extra.items()}}
        atomic_write_bytes(tmp / META_NAME, json.dumps(meta, indent=1).encode())
        previous = None
        if final.exists():  # the same step saved again (a resumed run): moved aside first, deleted once replaced
            previous = folder / f".{final.name}.old"
            shutil.rmtree(previous, ignore_errors=True)
            os.replace(final, previous)
        os.replace(tmp, final)
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        _fsync_dir(folder)
        if keep >= 1:
            for old in sharded_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    qdist.barrier()
    return final


def load_latest_sharded(run_dir: str | Path, model, optimizer) -> tuple[dict, Path]:
    """Load the newest intact sharded checkpoint into the (sharded) model and optimizer on every rank, whatever
    number of ranks wrote it. Returns (quarl.json's contents, folder). FileNotFoundError when none is intact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    chosen = None
    candidates = qdist.broadcast_object([str(p) for p in reversed(sharded_checkpoints(run_dir))])
    for path in candidates:  # newest first; the ranks share the checksums of each folder
        reasons = [r for r in qdist.all_gather_objects(verify_sharded(path, qdist.rank(), qdist.world_size())) if r]
        if not reasons:
            chosen = path
            break
        if qdist.is_main():
            warnings.warn(f"skipping checkpoint {Path(path).name}: {reasons[0]}", CheckpointWarning, stacklevel=2)
    if chosen is None:
        raise FileNotFoundError(f"resume={run_dir}: no intact sharded checkpoint (step_*.dcp with {META_NAME}) in "
                                f"{Path(run_dir) / 'checkpoints'}; a run on many ranks resumes from those only")
    state = _state(model, optimizer)
    if isinstance(optimizer, MasterWeightAdamW):  # the masters and moments themselves are loaded into, in place
        # AdamW's hyperparameters come from the run's config (the learning rate is set every step)
        del state["optim"]["param_groups"]
        _drop_absent_optimizer_state(state, chosen)
        dcp.load(state, checkpoint_id=chosen)
        optimizer.masters_to_params()
    else:
        dcp.load(state, checkpoint_id=chosen)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))
    meta = json.loads((Path(chosen) / META_NAME).read_text())
    return meta, Path(chosen)
