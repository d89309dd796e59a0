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


_capabilities: dict = {}  # (torch.cuda.get_device_capability, device index) -> (major, minor)


def capability(device: torch.device | str | None = None) -> tuple[int, int]:
    """torch.cuda.get_device_capability(device), asked once per device index: every quantized linear asks in each
    forward and backward, and the torch call costs microseconds of Python each time. The current device (None, or
    "cuda" without an index) is asked every time, since torch.cuda.set_device can change it. Keyed by the torch
    function too, so a test that patches it gets its own answers."""
    ask = torch.cuda.get_device_capability
    index = None if device is None else torch.device(device).index
    if index is None:
        return ask(device)
    key = (ask, index)
    cap = _capabilities.get(key)
    if cap is None:
        cap = _capabilities[key] = tuple(ask(device))
    return cap


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
    return capability(device) >= (8, 0)


def triton_interpreter_on() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1, read at Triton's import): then they take
    CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and _triton_importable()


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether a Triton kernel can run on tensors of `device`: `kernels_available` there, or the interpreter on."""
    return kernels_available(device) or triton_interpreter_on()


def fp8_kernels_available(device: torch.device | None = None) -> bool:
    """`kernels_available` and FP8 E4M3 in Triton, which needs compute capability >= 8.9 (Ada, Hopper): the
    kernels that read or write FP8 values. Older GPUs take the reference paths for FP8 (emulated, exact)."""
    return kernels_available(device) and capability(device) >= (8, 9)


def format_kernels_available(fmt: str, device: torch.device | None = None) -> bool:
    """Whether the Triton kernels can handle `fmt`'s values on `device`: `fp8_kernels_available` for a format
    whose kernels decode E4M3 values (codes or block scales), else `kernels_available`."""
    from quarl.formats.registry import FORMATS

    return (fp8_kernels_available if FORMATS[fmt].needs_fp8_hardware else kernels_available)(device)
