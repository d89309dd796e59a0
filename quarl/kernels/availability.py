"""Whether the Triton kernels can run: an importable Triton, a CUDA GPU of compute capability >= 8.0 (>= 8.9 for the
kernels that read or write FP8 values), and QUARL_DISABLE_KERNELS unset. Importing this module never imports Triton."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while loading its backend
        return False
    return True


def kernels_available(device: torch.device | None = None) -> bool:
    """True when the Triton kernels can run on `device` (default: the current CUDA device).

    Needs CUDA, compute capability >= 8.0 and an importable Triton; QUARL_DISABLE_KERNELS=1 turns them off.
    """
    if os.environ.get("QUARL_DISABLE_KERNELS", "") not in ("", "0"):
        return False
    if not torch.cuda.is_available() or not _triton_importable():
        return False
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def fp8_kernels_available(device: torch.device | None = None) -> bool:
    """`kernels_available` and FP8 E4M3 in Triton, which needs compute capability >= 8.9 (Ada, Hopper): the
    kernels that read or write FP8 values. Older GPUs take the reference paths for FP8 (emulated, exact)."""
    return kernels_available(device) and torch.cuda.get_device_capability(device) >= (8, 9)
