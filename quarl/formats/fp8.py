"""FP8 E4M3 formats (BRIEF §3): `fp8` (rowwise), `fp8-tensor` (one scale), `fp8-block` (DeepSeek-V3 style).

All three: s = amax / 448 over the scaling group (as amax * float32(1/448); 1 when amax = 0),
codes = e4m3(clamp(x / s, -448, 448)) (round to nearest even, saturating), dequant = code * s. Groups:
  fp8        one scale per row (weight: output channel, activation: token), scale [..., 1];
  fp8-tensor one scale for the whole tensor, scale 0-dim;
  fp8-block  weight: 128x128 tiles, scale [ceil(N/128), Kp/128] (a partial edge tile uses the rows present);
             activation: 1x128 groups along K, scale [..., Kp/128].
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from quarl.formats.base import QuantizedTensor, div_const, safe_scale

E4M3_MAX = 448.0
FP8_BLOCK = 128


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 -> torch.float8_e4m3fn, round to nearest even, saturating at +-448.

    Why the clamp: float8_e4m3fn has no infinity and older torch casts map overflow to NaN.
    """
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _amax_all(x32: torch.Tensor) -> torch.Tensor:
    """float32 0-dim max |x| (0 for an empty tensor, whose amax reduction would raise)."""
    if x32.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x32.device)
    return x32.abs().amax()


def quantize_fp8_rowwise(x32: torch.Tensor, role: str):
    """x32 float32 [..., K] -> (codes float8_e4m3fn [..., K], scale float32 [..., 1], None)."""
    scale = safe_scale(div_const(x32.abs().amax(dim=-1, keepdim=True), E4M3_MAX))
    return to_e4m3(x32 / scale), scale, None


def quantize_fp8_tensor(x32: torch.Tensor, role: str):
    """x32 float32 [..., K] -> (codes float8_e4m3fn [..., K], scale float32 0-dim, None)."""
    scale = safe_scale(div_const(_amax_all(x32), E4M3_MAX))
    return to_e4m3(x32 / scale), scale, None


def _expand_tiles(scale: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Tile scales [Nt, Kt] -> per-element scales [n_rows, Kt*128]."""
    return scale.repeat_interleave(FP8_BLOCK, dim=0)[:n_rows].repeat_interleave(FP8_BLOCK, dim=1)


def _expand_groups(scale: torch.Tensor) -> torch.Tensor:
    """Group scales [..., Kt] -> per-element scales [..., Kt*128]."""
    return scale.repeat_interleave(FP8_BLOCK, dim=-1)


def quantize_fp8_block(x32: torch.Tensor, role: str):
    """x32 float32 [..., Kp] (Kp % 128 == 0) -> (codes float8_e4m3fn [..., Kp], scale float32, None).

    weight [N, Kp]: scale [ceil(N/128), Kp/128]; activation [..., Kp]: scale [..., Kp/128].
    """
    kt = x32.shape[-1] // FP8_BLOCK
    if role == "weight":
        n = x32.shape[0]
        nt = -(-n // FP8_BLOCK)
        # Zero rows fill the partial edge tile for the amax only: they do not change it.
        padded = torch.zeros(nt * FP8_BLOCK, x32.shape[1], dtype=torch.float32, device=x32.device)
        padded[:n] = x32
        amax = padded.abs().reshape(nt, FP8_BLOCK, kt, FP8_BLOCK).amax(dim=(1, 3))
        scale = safe_scale(div_const(amax, E4M3_MAX))
        full = _expand_tiles(scale, n)
    else:
        amax = x32.abs().reshape(*x32.shape[:-1], kt, FP8_BLOCK).amax(dim=-1)
        scale = safe_scale(div_const(amax, E4M3_MAX))
        full = _expand_groups(scale)
    return to_e4m3(x32 / full), scale, None


def dequantize_fp8(qt: QuantizedTensor) -> torch.Tensor:
    """fp8 / fp8-tensor -> float32 [..., Kp] (the scale broadcasts)."""
    return qt.data.to(torch.float32) * qt.scale


def dequantize_fp8_block(qt: QuantizedTensor) -> torch.Tensor:
    """fp8-block -> float32 [..., Kp]."""
    if qt.role == "weight":
        full = _expand_tiles(qt.scale, qt.data.shape[0])
    else:
        full = _expand_groups(qt.scale)
    return qt.data.to(torch.float32) * full


def pad_block_groups(qweight: QuantizedTensor, multiple: int) -> QuantizedTensor:
    """An fp8-block weight [N, Kp] with Kp/128 rounded up to a multiple of `multiple` groups: zero codes (they add
    nothing to any product) with scale 1 appended. Why: cuBLAS blockwise FP8 returned wrong results for Kp/128 = 6
    (its [ceil(N/128), Kp/128] scale rows were 24 bytes apart; it appears to need 16-byte aligned rows), so the
    GEMM runs on Kp/128 a multiple of 4. Returns qweight itself when nothing is to add."""
    kp = qweight.data.shape[1]
    extra = (-(kp // 128) % multiple) * 128
    if not extra:
        return qweight
    data = F.pad(qweight.data.view(torch.uint8), (0, extra)).view(torch.float8_e4m3fn)
    return replace(qweight, data=data, scale=F.pad(qweight.scale, (0, extra // 128), value=1.0))
