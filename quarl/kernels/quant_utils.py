"""Triton device functions shared by the 8-bit kernels: exact code conversions and activation quantization.

They reproduce `quarl.formats` on a GPU bit for bit: scale = amax * float32(1 / qmax) (1 when amax = 0),
code = round_half_even(x / scale) clamped to +-127 (int8) or e4m3(clamp(x / scale, +-448)) (fp8).
"""

import os

import triton
import triton.language as tl

# Triton's interpreter evaluates fma as a rounded product plus an add, which the exact division below relies on
# not doing: there `div_by_scale` falls back to the IEEE division. Read once, at import.
_INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# Adding then subtracting 1.5 * 2^23 rounds a float32 |v| < 2^22 to an integer, ties to even (the hardware
# rounding of the add); written out because libdevice's rint has no interpreter (CPU) implementation.
_RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def int8_to_f16(w):
    """int8 codes -> the same integers in fp16, exactly, with two integer ops and one fp16 subtract.

    (w + 128) is placed in the low byte of the fp16 pattern 0x6400 (= 1024.0, whose ulp is 1), giving
    1024 + w + 128; subtracting 1152 leaves w. Cheaper than the int->float conversion unit.
    """
    u = w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x6480
    return (u.to(tl.int16).to(tl.float16, bitcast=True) - 1152.0).to(tl.float16)


@triton.jit
def codes_to_f16(w, IS_INT8: tl.constexpr):
    """int8 codes (int8) or fp8 codes (raw uint8 bytes) -> fp16 values, exactly (both fit fp16)."""
    if IS_INT8:
        return int8_to_f16(w)
    else:
        return w.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def codes_to(w, IS_INT8: tl.constexpr, dtype: tl.constexpr):
    """int8 codes or fp8 codes (raw uint8 bytes) -> `dtype` (bf16/fp16), exactly."""
    if IS_INT8:
        return int8_to_f16(w).to(tl.float32).to(dtype)
    else:
        return w.to(tl.float8e4nv, bitcast=True).to(dtype)


# float32(1 / qmax): PyTorch's CUDA kernels divide a tensor by a Python scalar as a multiplication by the
# float32 reciprocal, so `amax / 127` in `quarl.formats` on a GPU is amax * INV_127 (bit for bit).
INV_127 = tl.constexpr(0.007874015718698502)
INV_448 = tl.constexpr(0.0022321429569274187)


@triton.jit
def safe_scale(amax, QMAX: tl.constexpr):
    """amax / QMAX exactly as `quarl.formats` computes it on a GPU, 1 where that is 0 (an all-zero row/group)."""
    if QMAX == 127.0:
        s = amax * INV_127
    else:
        s = amax * INV_448
    return tl.where(s > 0, s, 1.0)


@triton.jit
def div_by_scale(v, s):
    """v / s correctly rounded, bit for bit `tl.math.div_rn(v, s)`, for float32 scales s shared by many values
    (s broadcastable to v: a row's or a group's scale).

    One IEEE reciprocal y = RN(1 / s) per scale, then per value q0 = RN(v y), the exact remainder r = v - q0 s (one
    fma) and q = RN(q0 + r y), which is RN(v / s) by Markstein's theorem (y within half an ulp of 1 / s, q0 within
    one ulp of v / s) as long as r does not underflow. Four operations instead of a full division per value
    (about 14 instructions with its slow-path branch), which dominated the quantizing kernels' instruction count.
    Scales below 2^-60 are scaled up by 2^96 with their values (exact), so 1 / s stays finite and every quotient
    of at least 2^-24 is exact; smaller quotients (far below any code's resolution: FP8's smallest step is 2^-9,
    int8's 1) may be a few ulps off. Where r is 0 or NaN or q0 infinite (an exact quotient, an inf/NaN value or
    scale, an overflow) q0 is the answer, sign of zero included.
    """
    if _INTERPRETING:
        return tl.math.div_rn(v, s)
    else:
        k = tl.where(s < 8.673617379884035e-19, 7.922816251426434e28, 1.0)  # 2^-60, 2^96
        s = s * k
        y = tl.math.div_rn(1.0, s)
        v = v * k
        q0 = v * y
        r = tl.math.fma(-q0, s, v)
        return tl.where((tl.abs(r) > 0) & (tl.abs(q0) < float("inf")), tl.math.fma(r, y, q0), q0)


@triton.jit
def quantize_tile(v, s, IS_INT8: tl.constexpr):
    """v float32 divided by its scales s (float32, broadcastable to v, e.g. [R, 1] row scales) -> codes.

    Returns int8 codes as integer-valued float32 (int8: round half to even, clamp +-127) or fp8 codes as a
    float8e4nv tensor (clamp +-448, then the round-to-nearest-even conversion). A NaN value gives an FP8 NaN
    code (the clamp propagates it) so that a NaN input stays visible downstream; int8 has no NaN code.
    """
    q = div_by_scale(v, s)
    if IS_INT8:
        q = (q + _RNE_MAGIC) - _RNE_MAGIC
        return tl.minimum(tl.maximum(q, -127.0), 127.0)
    else:
        q = tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL)
        return tl.minimum(q, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)
