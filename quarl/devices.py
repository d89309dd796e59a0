"""Device selection shared by the trainer and the command line."""

from __future__ import annotations

import re

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N (N = GPU index)"
_CUDA = re.compile(r"^cuda(?::(\d+))?$")


def resolve_device(name: str | torch.device) -> torch.device:
    """"auto" -> cuda when a GPU is visible, else cpu; "cpu"; "cuda" / "cuda:N" when that GPU is visible.

    Raises ValueError (one line, naming the value and the accepted ones) for anything else (e.g. "tpu", "gpu"),
    for cuda without a visible GPU and for a GPU index beyond the visible GPUs.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise ValueError(f"device {name!r} is not a device name; use {DEVICE_CHOICES}")
    text = name.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    m = _CUDA.match(text)
    if m is None:
        hint = " (write cuda for a GPU)" if text in ("gpu", "nvidia") or text.startswith("gpu:") else ""
        raise ValueError(f"device {name!r} is not supported{hint}; use {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asks for a GPU but none is visible (torch.cuda.is_available() is "
                         "False: no GPU, no driver, or a CPU-only PyTorch build); use device cpu or auto")
    if m.group(1) is not None:
        index, count = int(m.group(1)), torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"device {name!r} asks for GPU {index} but {count} GPU(s) are visible "
                             f"(cuda:0 .. cuda:{count - 1}); check CUDA_VISIBLE_DEVICES or pick another index")
        return torch.device("cuda", index)
    return torch.device("cuda")
