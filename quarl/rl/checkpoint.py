"""Atomic checkpoints of a training run: trainable weights, optimizer, RNG states, step (the learning rate is a
function of the step).

Files live in RUN_DIR/checkpoints/step_NNNNNN.pt; RUN_DIR/checkpoints/latest names the newest one. Every file is
written to a temporary name in the same folder and renamed into place, so a crash never leaves a half-written
checkpoint behind (rename is atomic on POSIX file systems).
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (POSIX: the directory entry lives in the folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that training changes (frozen bases are rebuilt from the original checkpoint on resume)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, keep: int = 2, **extra) -> Path:
    """Write the state after `step` completed RL steps; keep the newest `keep` checkpoints. Returns the path."""
    folder = Path(run_dir) / "checkpoints"
    path = folder / f"step_{step:06d}.pt"
    state = {
        "step": step,
        "model": trainable_state(model),
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        **extra,
    }
    atomic_torch_save(state, path)
    atomic_write_bytes(folder / "latest", path.name.encode())
    for old in sorted(p for p in folder.glob("step_*.pt") if p != path)[: -(keep - 1) or None]:
        old.unlink(missing_ok=True)
    return path


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    folder = Path(run_dir) / "checkpoints"
    pointer = folder / "latest"
    if pointer.is_file():
        path = folder / pointer.read_text().strip()
        if path.is_file():
            return path
    found = sorted(folder.glob("step_*.pt"))
    return found[-1] if found else None


def load_checkpoint(path: str | Path, model, optimizer=None) -> dict:
    """Restore a checkpoint in place; returns the whole state dict (step, extra fields)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    params = dict(model.named_parameters())
    missing = [n for n in state["model"] if n not in params]
    if missing:
        raise ValueError(
            f"checkpoint {path} holds parameters this model lacks ({missing[:3]}...): was the run's config changed?"
        )
    with torch.no_grad():
        for name, value in state["model"].items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
    return state
