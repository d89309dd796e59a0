"""4-bit formats with E2M1 elements (BRIEF §3): NVFP4 and MXFP4.

NVFP4 (blocks of 16 along K, two-level scaling):
    s_global = amax(|x|) / (448 * 6)                (float32; 1 when amax = 0)
    s_block  = e4m3(amax_block / 6 / s_global)      (float32 arithmetic, rounded to E4M3, saturating at 448)
    q        = e2m1(clamp(x / (s_block * s_global), -6, 6))
    dequant  = (q * s_block) * s_global
  Divisions by the constants 448*6 and 6 are multiplications by their float32 reciprocals (base.div_const).
  The element step uses the ROUNDED block scale, so the codes are the best E2M1 codes for the scale the
  kernels actually see. A block whose rounded scale is 0 (all zeros, or amax_block below the smallest E4M3
  subnormal relative to the tensor) gets codes 0. For activations the global scale is taken over the whole
  tensor given. s_global is stored as the multiplier; libraries that store 448*6/amax need 1/s_global at I/O.

MXFP4 (OCP microscaling; blocks of 32 along K, no tensor scale):
    X = 2^(floor(log2 amax_block) - 2) stored as the E8M0 biased exponent e = floor(log2 amax_block) + 125,
    clamped to 0..254 (255 is NaN in E8M0); e = 127 (X = 1) for an all-zero block;
    q = e2m1(clamp(x / X, -6, 6)); dequant = q * X.
  amax_block / X lies in [4, 8), so elements above 6 X saturate to 6 X (a known property of the format).
"""

from __future__ import annotations

import torch

from quarl.formats import e2m1
from quarl.formats.base import QuantizedTensor, div_const, safe_scale
from quarl.formats.fp8 import E4M3_MAX, _amax_all, to_e4m3

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E8M0_BIAS = 127


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., Kp] -> [..., Kp/block, block] (a view)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The NVFP4 tensor scale (float32) of a tensor whose max |x| is amax (any shape: one per tensor)."""
    return safe_scale(div_const(amax, E4M3_MAX * e2m1.E2M1_MAX))


def nvfp4_block_scale(amax_block: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales (float8_e4m3fn, amax_block's shape) of blocks whose max |x| is amax_block (float32),
    under the tensor scale global_scale (broadcastable)."""
    return to_e4m3(div_const(amax_block, e2m1.E2M1_MAX) / global_scale)


def nvfp4_codes(v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, v's shape) of float32 values v under their rounded scales step (= block scale x tensor
    scale, broadcastable to v); a zero step gives codes 0."""
    nonzero = step > 0
    v = v / torch.where(nonzero, step, torch.ones_like(step))
    return e2m1.encode(torch.where(nonzero, v, torch.zeros_like(v)).clamp_(-e2m1.E2M1_MAX, e2m1.E2M1_MAX))


def quantize_nvfp4(x32: torch.Tensor, role: str):
    """x32 float32 [..., Kp] (Kp % 16 == 0) -> (packed uint8 [..., Kp/2], block scales float8_e4m3fn
    [..., Kp/16], global scale float32 0-dim)."""
    global_scale = nvfp4_global_scale(_amax_all(x32))
    blocks = _blocks(x32, NVFP4_BLOCK)
    block_scale = nvfp4_block_scale(blocks.abs().amax(dim=-1), global_scale)
    step = block_scale.to(torch.float32) * global_scale  # the rounded scale the kernels see
    codes = nvfp4_codes(blocks, step.unsqueeze(-1)).reshape(x32.shape)
    return e2m1.pack(codes), block_scale, global_scale


def dequantize_nvfp4(qt: QuantizedTensor) -> torch.Tensor:
    """-> float32 [..., Kp]."""
    q = _blocks(e2m1.decode_packed(qt.data), NVFP4_BLOCK)
    out = (q * qt.scale.to(torch.float32).unsqueeze(-1)) * qt.global_scale
    return out.reshape(*qt.data.shape[:-1], qt.data.shape[-1] * 2)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponents (uint8, 0..254) -> exact float32 powers of two 2**(e - 127).

    Built from the float32 bit pattern so every value, including the subnormal 2**-127 (e = 0), is exact.
    """
    e32 = e.to(torch.int32)
    bits = torch.where(e32 > 0, e32 << 23, torch.full_like(e32, 1 << 22))
    return bits.view(torch.float32)


def mxfp4_exponent(amax_block: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponents (uint8, amax_block's shape) of blocks whose max |x| is amax_block (float32)."""
    # frexp: amax = m * 2^p with m in [0.5, 1), so floor(log2 amax) = p - 1 exactly (also for subnormals).
    _, p = torch.frexp(amax_block)
    e = (p.to(torch.int32) - 1 - 2 + E8M0_BIAS).clamp_(0, 254)
    return torch.where(amax_block > 0, e, torch.full_like(e, E8M0_BIAS)).to(torch.uint8)


def quantize_mxfp4(x32: torch.Tensor, role: str):
    """x32 float32 [..., Kp] (Kp % 32 == 0) -> (packed uint8 [..., Kp/2], E8M0 exponents uint8 [..., Kp/32], None)."""
    blocks = _blocks(x32, MXFP4_BLOCK)
    e = mxfp4_exponent(blocks.abs().amax(dim=-1))
    v = (blocks / e8m0_to_float(e).unsqueeze(-1)).clamp_(-e2m1.E2M1_MAX, e2m1.E2M1_MAX)
    codes = e2m1.encode(v).reshape(x32.shape)
    return e2m1.pack(codes), e, None


def dequantize_mxfp4(qt: QuantizedTensor) -> torch.Tensor:
    """-> float32 [..., Kp]."""
    q = _blocks(e2m1.decode_packed(qt.data), MXFP4_BLOCK)
    out = q * e8m0_to_float(qt.scale).unsqueeze(-1)
    return out.reshape(*qt.data.shape[:-1], qt.data.shape[-1] * 2)
