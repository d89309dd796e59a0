"""Device selection shared by the trainer and the command line."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when a GPU is visible, else cpu; an explicit cuda device without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asks for a GPU but none is visible; use cpu or auto")
    return device
