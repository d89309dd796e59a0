"""INT8 W8A8 (BRIEF §3): symmetric, one scale per row (weight: per output channel; activation: per token).

s = max_k |x_k| / 127 (as amax * float32(1/127), see base.div_const; 1 when the row is all zeros);
q = clamp(round(x / s), -127, 127) (ties to even); dequant = q * s. -128 is never used, so the code range is symmetric.
"""

from __future__ import annotations

import torch

from quarl.formats.base import QuantizedTensor, div_const, safe_scale

INT8_MAX = 127.0


def quantize_int8(x32: torch.Tensor, role: str):
    """x32 float32 [..., K] -> (codes int8 [..., K], scale float32 [..., 1], None)."""
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = safe_scale(div_const(amax, INT8_MAX))
    q = torch.round(x32 / scale).clamp_(-INT8_MAX, INT8_MAX)  # torch.round: half to even
    return q.to(torch.int8), scale, None


def dequantize_int8(qt: QuantizedTensor) -> torch.Tensor:
    """-> float32 [..., Kp]."""
    return qt.data.to(torch.float32) * qt.scale
