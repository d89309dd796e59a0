"""INT8 W8A8 (BRIEF §3): symmetric, one scale per row (weight: per output channel; activation: per token).

s = max_k |x_k| / 127 (as amax * float32(1/127), see base.div_const; 1 when the row is all zeros);
q = clamp(round(x / s), -127, 127) (ties to even); dequant = q * s. -128 is never used, so the code range is symmetric.
"""

from __future__ import annotations

import torch

from quarl.formats.base import QuantizedTensor, div_const, safe_scale

INT8_MAX = 127.0


def int8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale (float32, amax's shape) of rows whose max |x| is amax."""
    return safe_scale(div_const(amax, INT8_MAX))


def int8_codes(x32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The codes of x32 under scale (broadcastable), as float32 integers in [-127, 127] (round half to even)."""
    return torch.round(x32 / scale).clamp_(-INT8_MAX, INT8_MAX)


def quantize_int8(x32: torch.Tensor, role: str):
    """x32 float32 [..., K] -> (codes int8 [..., K], scale float32 [..., 1], None)."""
    scale = int8_scale(x32.abs().amax(dim=-1, keepdim=True))
    return int8_codes(x32, scale).to(torch.int8), scale, None


def dequantize_int8(qt: QuantizedTensor) -> torch.Tensor:
    """-> float32 [..., Kp]."""
    return qt.data.to(torch.float32) * qt.scale
