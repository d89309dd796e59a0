"""Fused elementwise kernels of the rollout decode step (one token per sequence; rows = sequences).

Unfused, each RMSNorm is seven PyTorch kernels, rotary embedding five per tensor, SiLU·mul two, and every W8A8
linear first quantizes its input in a kernel of its own. At a rollout batch these small kernels take a large
share of a decode step (bench/results/rollout.md). Here each group is one pass:

  rms_norm_rows   (x + delta) -> residual, RMSNorm(residual) * (w + noise) -> h (w + noise in float32), and
                  optionally h's 8-bit codes and scales, per token or (fp8-block) per 1x128 group: the next
                  linear's activation quantization (of h / s when the linear is smoothed, `smooth`);
  silu_mul_rows   silu(gate) * up -> h, optionally with its codes and scales (of h / s, `smooth`);
  rope_rows       rotary embedding of the q and k heads of the fused q/k/v projection output.

Every kernel rounds where the PyTorch modules round (bf16 after the residual add, after the norm, after silu,
after the product; the rotary products and their sum), so the values equal the module path's up to float32
summation order in the norm's mean square. Quantization follows `quarl.formats` bit for bit from those values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.kernels.quant_utils import _INTERPRETING, quantize_tile, safe_scale


@triton.jit
def _store_codes(q_ptr, s_ptr, row, offs, mask, h, amax, QUANT_INT8: tl.constexpr, GROUPED: tl.constexpr = False,
                 start=0, N=0, stride_sg=0):
    """Codes of h (float32 [B], columns offs of one row) at q_ptr + offs (int8, or fp8 as raw bytes).
    Per-row: the row's scale from amax, stored at s_ptr + row. GROUPED (fp8-block): each 128 columns from `start`
    (a multiple of 128; B a multiple of 128) get their own scale, stored at s_ptr + group * stride_sg + row for the
    groups that begin before N (amax unused)."""
    if GROUPED:
        G: tl.constexpr = h.shape[0] // 128
        hg = tl.reshape(h, (G, 128))
        sg = safe_scale(tl.max(tl.abs(hg), axis=1), 448.0)
        q = tl.reshape(quantize_tile(hg, sg[:, None], False), (G * 128,)).to(tl.uint8, bitcast=True)
        tl.store(q_ptr + offs, q, mask=mask)
        group = start // 128 + tl.arange(0, G)
        tl.store(s_ptr + group * stride_sg + row, sg, mask=group * 128 < N)
    else:
        QMAX: tl.constexpr = 127.0 if QUANT_INT8 else 448.0
        s = safe_scale(amax, QMAX)
        q = quantize_tile(h, s, QUANT_INT8)
        if QUANT_INT8:
            q = q.to(tl.int8)
        else:
            q = q.to(tl.uint8, bitcast=True)
        tl.store(q_ptr + offs, q, mask=mask)
        tl.store(s_ptr + row, s)


@triton.jit
def _to_quantize(h, sm_ptr, cols, ok, SMOOTH: tl.constexpr):
    """The float32 values whose codes are stored for h (columns cols of a row, in the activations' dtype): h, or,
    SMOOTH, h / s (s float32 at sm_ptr + cols) divided in float32 with IEEE rounding and rounded to h's dtype, as
    `QuantLinear.smooth_input` computes it."""
    if SMOOTH:
        s = tl.load(sm_ptr + cols, mask=ok, other=1.0)
        return tl.math.div_rn(h.to(tl.float32), s).to(h.dtype).to(tl.float32)
    else:
        return h.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, ds_ptr, dc_ptr, w_ptr, n_ptr, r_ptr, h_ptr, q_ptr, s_ptr, sm_ptr, H, eps,
                     stride_x, stride_d, stride_sg, HAS_DELTA: tl.constexpr, DELTA_SCALED: tl.constexpr,
                     HAS_NOISE: tl.constexpr, WRITE_H: tl.constexpr, QUANT: tl.constexpr, QUANT_INT8: tl.constexpr,
                     GROUPED: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row; the whole row stays in registers (BLOCK >= H). DELTA_SCALED: delta is a unit-scale
    FP8 product, multiplied here by its per-token (ds [M]) and per-channel (dc [H]) scales and rounded. GROUPED:
    fp8-block codes (1x128 groups, scales at stride_sg per group, see `_store_codes`)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + offs, mask=ok, other=0.0)
        if DELTA_SCALED:
            d = (d.to(tl.float32) * tl.load(ds_ptr + row) * tl.load(dc_ptr + offs, mask=ok, other=0.0)).to(
                x_ptr.dtype.element_ty)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the residual add, rounded
        tl.store(r_ptr + row * H + offs, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)  # rsqrtf, as torch.rsqrt
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_NOISE:  # AQN: the rollout weight is w + noise in float32, never rounded to the weight's dtype
        w = w + tl.load(n_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    h = (xf * inv * w).to(h_ptr.dtype.element_ty)
    if WRITE_H:
        tl.store(h_ptr + row * H + offs, h, mask=ok)
    if QUANT:
        hf = _to_quantize(h, sm_ptr, offs, ok, SMOOTH)
        _store_codes(q_ptr + row * H, s_ptr, row, offs, ok, hf, tl.max(tl.abs(hf), axis=0), QUANT_INT8, GROUPED, 0,
                     H, stride_sg)


@triton.jit
def _silu_mul_block(g_row, u_row, start, ar, N, out_dtype: tl.constexpr, rs, cg_ptr, cu_ptr, SCALED: tl.constexpr):
    """silu(gate) * up for columns start + ar of one row, rounded as PyTorch rounds (silu, then the product):
    (h in out_dtype, in-range mask). SCALED: gate and up are unit-scale FP8 products, first multiplied by the
    row's scale rs and their per-channel scales (cg, cu [N]) and rounded."""
    ok = start + ar < N
    g = tl.load(g_row + start + ar, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_row + start + ar, mask=ok, other=0.0)
    if SCALED:
        g = (g * rs * tl.load(cg_ptr + start + ar, mask=ok, other=0.0)).to(u.dtype).to(tl.float32)
        u = (u.to(tl.float32) * rs * tl.load(cu_ptr + start + ar, mask=ok, other=0.0)).to(u.dtype)
    s = (g * _sigmoid(g)).to(u.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(out_dtype), ok


@triton.jit
def _sigmoid(g):
    """1 / (1 + exp(-g)) in float32 from two MUFU operations: ex2.approx.ftz and rcp.approx.ftz (about 2^-22
    relative error each, like tl.exp's and the fast division's; it shows only as a rare one-rounding difference in
    the bf16 silu). The non-ftz forms add a subnormal range check and two multiplies each, and the row-on-chip
    SiLU·mul is bound by issued instructions: sm_90 SASS per thread at 18944 columns, 1424 with tl.exp and the
    fast division, 1160 with these. Flushing cannot matter here: a subnormal exp(-g) vanishes next to 1, and
    1 / (1 + e) is subnormal only for g < -87, where silu(g) is below 1e-35 in magnitude (it becomes -0).
    The interpreter runs no inline assembly: there, the plain formula."""
    if _INTERPRETING:
        return 1.0 / (1.0 + tl.exp(-g))
    else:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [g * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, rs_ptr, cg_ptr, cu_ptr, sm_ptr, N, stride_g, stride_u,
                     stride_sg, WRITE_H: tl.constexpr, QUANT: tl.constexpr, QUANT_INT8: tl.constexpr,
                     SCALED: tl.constexpr, GROUPED: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row, BLOCK columns at a time; with QUANT a first pass finds the row's amax (the second
    pass recomputes h from the L2-resident inputs rather than storing and re-reading it). GROUPED: fp8-block
    codes, one pass (a group's scale needs only its own 128 columns). SMOOTH: codes of h / s (`_to_quantize`)."""
    row = tl.program_id(0).to(tl.int64)
    ar = tl.arange(0, BLOCK)
    g_row = g_ptr + row * stride_g
    u_row = u_ptr + row * stride_u
    out_dtype: tl.constexpr = h_ptr.dtype.element_ty
    rs = tl.load(rs_ptr + row) if SCALED else 1.0
    row_amax = 0.0
    if QUANT and not GROUPED:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            h, ok = _silu_mul_block(g_row, u_row, start, ar, N, out_dtype, rs, cg_ptr, cu_ptr, SCALED)
            amax = tl.maximum(amax, tl.abs(_to_quantize(h, sm_ptr, start + ar, ok, SMOOTH)))
        row_amax = tl.max(amax, axis=0)
    for start in range(0, N, BLOCK):
        h, ok = _silu_mul_block(g_row, u_row, start, ar, N, out_dtype, rs, cg_ptr, cu_ptr, SCALED)
        if WRITE_H:
            tl.store(h_ptr + row * N + start + ar, h, mask=ok)
        if QUANT:
            _store_codes(q_ptr + row * N, s_ptr, row, start + ar, ok, _to_quantize(h, sm_ptr, start + ar, ok, SMOOTH),
                         row_amax, QUANT_INT8, GROUPED, start, N, stride_sg)


@triton.jit
def _silu_mul_row_kernel(g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, rs_ptr, cg_ptr, cu_ptr, sm_ptr, N, stride_g, stride_u,
                         stride_sg, WRITE_H: tl.constexpr, QUANT_INT8: tl.constexpr, SCALED: tl.constexpr,
                         GROUPED: tl.constexpr, SMOOTH: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr,
                         C2: tl.constexpr):
    """One program per row, the whole row on chip in up to three power-of-two pieces (C0 >= C1 >= C2, 0 = none;
    C0 + C1 + C2 >= N): each product is computed once, then the row's scale and codes. Used with quantization,
    where `_silu_mul_kernel` would compute every product twice (one pass for the amax, one for the codes).
    SMOOTH: codes of h / s (`_to_quantize`)."""
    row = tl.program_id(0).to(tl.int64)
    g_row = g_ptr + row * stride_g
    u_row = u_ptr + row * stride_u
    out_dtype: tl.constexpr = h_ptr.dtype.element_ty
    rs = tl.load(rs_ptr + row) if SCALED else 1.0
    # Every piece's loads are issued before the first reduction: a reduction's barriers would otherwise hold
    # the next piece's loads back, one memory latency per piece.
    cols0 = tl.arange(0, C0)
    h0, ok0 = _silu_mul_block(g_row, u_row, 0, cols0, N, out_dtype, rs, cg_ptr, cu_ptr, SCALED)
    if C1 > 0:
        cols1 = C0 + tl.arange(0, C1)
        h1, ok1 = _silu_mul_block(g_row, u_row, C0, tl.arange(0, C1), N, out_dtype, rs, cg_ptr, cu_ptr, SCALED)
    if C2 > 0:
        cols2 = C0 + C1 + tl.arange(0, C2)
        h2, ok2 = _silu_mul_block(g_row, u_row, C0 + C1, tl.arange(0, C2), N, out_dtype, rs, cg_ptr, cu_ptr,
                                  SCALED)
    v0 = _to_quantize(h0, sm_ptr, cols0, ok0, SMOOTH)
    amax = tl.max(tl.abs(v0), axis=0)
    if C1 > 0:
        v1 = _to_quantize(h1, sm_ptr, cols1, ok1, SMOOTH)
        amax = tl.maximum(amax, tl.max(tl.abs(v1), axis=0))
    if C2 > 0:
        v2 = _to_quantize(h2, sm_ptr, cols2, ok2, SMOOTH)
        amax = tl.maximum(amax, tl.max(tl.abs(v2), axis=0))
    _store_piece(q_ptr, h_ptr, s_ptr, row, N, 0, cols0, ok0, h0, v0, amax, WRITE_H, QUANT_INT8, GROUPED, stride_sg)
    if C1 > 0:
        _store_piece(q_ptr, h_ptr, s_ptr, row, N, C0, cols1, ok1, h1, v1, amax, WRITE_H, QUANT_INT8, GROUPED,
                     stride_sg)
    if C2 > 0:
        _store_piece(q_ptr, h_ptr, s_ptr, row, N, C0 + C1, cols2, ok2, h2, v2, amax, WRITE_H, QUANT_INT8, GROUPED,
                     stride_sg)


@triton.jit
def _store_piece(q_ptr, h_ptr, s_ptr, row, N, start, cols, ok, h, v, amax, WRITE_H: tl.constexpr,
                 QUANT_INT8: tl.constexpr, GROUPED: tl.constexpr, stride_sg):
    """One piece of a row (columns cols = start + arange, values h; v: the float32 values to quantize, h or
    h / s) -> v's codes under the row's amax (GROUPED: under each 128-column group's own), and h itself with
    WRITE_H."""
    _store_codes(q_ptr + row * N, s_ptr, row, cols, ok, v, amax, QUANT_INT8, GROUPED, start, N, stride_sg)
    if WRITE_H:
        tl.store(h_ptr + row * N + cols, h, mask=ok)


def row_pieces(n: int, pieces: int = 3, smallest: int = 128) -> tuple[int, ...]:
    """n split into `pieces` power-of-two sizes, largest first, covering n with the least padding: the binary
    digits of n from the top, the last piece rounded up (0 = unused piece). 18944 -> (16384, 2048, 512)."""
    sizes, rest = [], n
    while rest > 0 and len(sizes) < pieces - 1:
        top = 1 << (rest.bit_length() - 1)
        if top < smallest:
            break
        sizes.append(top)
        rest -= top
    if rest > 0:
        sizes.append(max(smallest, triton.next_power_of_2(rest)))
    return tuple(sizes + [0] * (pieces - len(sizes)))


@triton.jit
def _round_bf16(v):
    """float32 -> the nearest bf16 value (ties to even), still float32. Integer arithmetic on purpose: with a plain
    conversion the compiler contracts a rounded product and the add that follows into one bf16 FMA (one rounding
    where PyTorch has two)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded)


@triton.jit
def _rotate_store(a, b, cos_ptr, sin_ptr, q_ptr, k_ptr, row, head, dh, HQ, HK, stride_c, half: tl.constexpr):
    """Rotary embedding of bf16 head vectors given as their halves, a = x[:D/2] and b = x[D/2:] (float32
    [HEADS, D/2], columns dh), stored to the q heads (head < HQ) and k heads (HQ <= head < HQ + HK):
    rotate_half(x) = cat(-b, a), so y[:D/2] = a cos - b sin and y[D/2:] = b cos + a sin. Each value is loaded once
    (no gather of its partner). bf16 x bf16 is exact in float32, so each rounding below is PyTorch's bf16
    multiply / add."""
    c_row = cos_ptr + row * stride_c + dh
    s_row = sin_ptr + row * stride_c + dh
    ca, cb = tl.load(c_row).to(tl.float32), tl.load(c_row + half).to(tl.float32)
    sa, sb = tl.load(s_row).to(tl.float32), tl.load(s_row + half).to(tl.float32)
    ya = _round_bf16(_round_bf16(a * ca) + _round_bf16(-b * sa)).to(tl.bfloat16)
    yb = _round_bf16(_round_bf16(b * cb) + _round_bf16(a * sb)).to(tl.bfloat16)
    D: tl.constexpr = 2 * half
    q_out = q_ptr + (row * HQ + head) * D + dh
    k_out = k_ptr + (row * HK + head - HQ) * D + dh
    is_q, is_k = head < HQ, (head >= HQ) & (head < HQ + HK)
    tl.store(q_out, ya, mask=is_q)
    tl.store(q_out + half, yb, mask=is_q)
    tl.store(k_out, ya, mask=is_k)
    tl.store(k_out + half, yb, mask=is_k)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, HQ, HK, stride_x, stride_c, D: tl.constexpr,
                 HEADS: tl.constexpr):
    """Program (row, group of HEADS heads) over the HQ query heads then the HK key heads of one fused projection
    row (a program per head would be tens of thousands of one-warp programs at a rollout batch)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    half: tl.constexpr = D // 2
    dh = tl.arange(0, half)[None, :]  # [1, D/2]
    ok = head < HQ + HK
    x_row = x_ptr + row * stride_x + head * D + dh
    a = tl.load(x_row, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(x_row + half, mask=ok, other=0.0).to(tl.float32)
    _rotate_store(a, b, cos_ptr, sin_ptr, q_ptr, k_ptr, row, head, dh, HQ, HK, stride_c, half)


@triton.jit
def _scaled_half(y_ptr, sw_ptr, b_ptr, row, stride_y, col, ok, sx, HAS_BIAS: tl.constexpr):
    """bf16(y[row, col] * sx * sw[col] (+ bias[col])) as float32: a unit-scale product's value as the scaled
    GEMM epilogue would have written it."""
    v = tl.load(y_ptr + row * stride_y + col, mask=ok, other=0.0).to(tl.float32) * sx * \
        tl.load(sw_ptr + col, mask=ok, other=0.0)
    if HAS_BIAS:
        v = v + tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
    return _round_bf16(v)


@triton.jit
def _rope_scaled_kernel(y_ptr, sx_ptr, sw_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, HQ, HK, stride_y,
                        stride_c, D: tl.constexpr, HEADS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """As `_rope_kernel` on a unit-scale FP8 q/k/v product y: program (row, group of HEADS heads) over the HQ
    query, HK key and HK value heads; x = bf16(y * sx[row] * sw[col] + bias[col]); q and k heads rotated, v heads
    written as x."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    half: tl.constexpr = D // 2
    dh = tl.arange(0, half)[None, :]  # [1, D/2]
    ok = head < HQ + 2 * HK
    sx = tl.load(sx_ptr + row)
    col = head * D + dh
    a = _scaled_half(y_ptr, sw_ptr, b_ptr, row, stride_y, col, ok, sx, HAS_BIAS)
    b = _scaled_half(y_ptr, sw_ptr, b_ptr, row, stride_y, col + half, ok, sx, HAS_BIAS)
    _rotate_store(a, b, cos_ptr, sin_ptr, q_ptr, k_ptr, row, head, dh, HQ, HK, stride_c, half)
    v_out = v_ptr + (row * HK + head - HQ - HK) * D + dh
    is_v = (head >= HQ + HK) & ok
    tl.store(v_out, a.to(tl.bfloat16), mask=is_v)
    tl.store(v_out + half, b.to(tl.bfloat16), mask=is_v)


def _codes(m: int, n: int, quant: str | None, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Code and scale buffers: codes [m, n]; scales [m, 1], or for fp8-block [m, ceil(n/128)] column-major (the
    transposed view of a [groups, m] buffer: the layout torch._scaled_mm's 1x128 scaling reads)."""
    if quant is None:
        return None, None
    dtype = torch.int8 if quant == "int8" else torch.uint8
    codes = torch.empty((m, n), dtype=dtype, device=device)
    if quant == "fp8-block":
        return codes, torch.empty((-(-n // 128), m), dtype=torch.float32, device=device).t()
    return codes, torch.empty((m, 1), dtype=torch.float32, device=device)


def _typed(codes: torch.Tensor | None, quant: str | None) -> torch.Tensor | None:
    return codes.view(torch.float8_e4m3fn) if codes is not None and quant in ("fp8", "fp8-block") else codes


def _check_quant(quant: str | None) -> None:
    if quant not in (None, "int8", "fp8", "fp8-block"):
        raise ValueError(f"fused decode kernels quantize to 'int8', 'fp8' (per token) or 'fp8-block' (1x128 "
                         f"groups), got {quant!r}")


def _group_stride(quant: str | None, scales: torch.Tensor | None) -> int:
    """The scale buffer's stride between 128-column groups (fp8-block), 0 otherwise."""
    return scales.stride(1) if quant == "fp8-block" else 0


def rms_norm_rows(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, noise: torch.Tensor | None,
                  eps: float, quant: str | None = None, write_h: bool = True, num_warps: int | None = None,
                  delta_scales: tuple[torch.Tensor, torch.Tensor] | None = None, smooth: torch.Tensor | None = None):
    """x, delta: [M, H] (bf16/fp16, rows contiguous); weight, noise: [H] -> (residual, h, codes, scales).

    residual = x + delta ([M, H], new tensor; x itself when delta is None); h = RMSNorm(residual) with weight
    (+ noise) ([M, H], None unless write_h): (residual * rsqrt(mean(residual^2) + eps)) * (weight + noise) in
    float32, rounded once to x's dtype. noise (AQN; RMSNorm keeps it float32) is read as float32 and added to
    the weight in float32, never rounded to the weight's dtype (a narrower noise tensor is widened on load).
    quant "int8"/"fp8": codes [M, H] (int8 / float8_e4m3fn) and scales float32 [M, 1] of h per token;
    "fp8-block": float8_e4m3fn codes [M, H] and scales float32 [M, ceil(H/128)] per 1x128 group, column-major;
    else None, None. num_warps: per row (default by row length).
    delta_scales: (per-token float32 [M, 1], per-channel float32 [H]) when delta is a unit-scale FP8 product:
    delta * both scales, rounded to x's dtype, is what gets added.
    smooth: the next linear's SmoothQuant factors s (float32 [H], `QuantLinear.rollout_smoothing`): the codes are
    those of h / s (divided in float32, rounded to x's dtype), h itself is written undivided.
    """
    _check_quant(quant)
    M, H = x.shape
    smooth = _check_smooth(smooth, H, quant)
    if x.stride(1) != 1 or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1)):
        raise ValueError(f"rms_norm_rows needs x and delta [M, H] with contiguous rows, got {tuple(x.shape)}")
    if delta is None and delta_scales is not None:
        raise ValueError("rms_norm_rows: delta_scales given without a delta to scale")
    ds, dc = _check_scales(delta_scales, M, (H,), "delta_scales")
    residual = torch.empty_like(x) if delta is not None else x
    h = torch.empty((M, H), dtype=x.dtype, device=x.device) if write_h else None
    codes, scales = _codes(M, H, quant, x.device)
    block = max(triton.next_power_of_2(H), 128 if quant == "fp8-block" else 1)  # whole 128-column groups
    if M:
        _rms_norm_kernel[(M,)](
            x, delta if delta is not None else x, ds if ds is not None else x, dc if dc is not None else x, weight,
            noise if noise is not None else weight, residual, h if h is not None else x,
            codes if codes is not None else x, scales if scales is not None else x,
            smooth if smooth is not None else x,
            H, eps, x.stride(0), delta.stride(0) if delta is not None else 0, _group_stride(quant, scales),
            HAS_DELTA=delta is not None, DELTA_SCALED=ds is not None, HAS_NOISE=noise is not None,
            WRITE_H=write_h, QUANT=quant is not None, QUANT_INT8=quant == "int8", GROUPED=quant == "fp8-block",
            SMOOTH=smooth is not None, BLOCK=block,
            num_warps=num_warps or min(16, max(4, block // 256)))
    return residual, h, _typed(codes, quant), scales


ROW_ON_CHIP_MAX = 32768  # longest row `_silu_mul_row_kernel` holds (32 warps: 32 values per thread)
# Warps per row of `_silu_mul_row_kernel`: long rows (a 7B model's 18944-wide MLP) need many loads in flight.
SILU_ROW_WARPS = 32


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor, quant: str | None = None, write_h: bool = True,
                  in_scales: tuple[torch.Tensor, torch.Tensor] | None = None, smooth: torch.Tensor | None = None):
    """gate, up: [M, N] (rows contiguous; may be the two halves of one fused projection output) ->
    (h = silu(gate) * up [M, N] or None unless write_h, codes [M, N] or None, scales float32 [M, 1] or None;
    quant as `rms_norm_rows`, "fp8-block" giving scales [M, ceil(N/128)] column-major).
    in_scales: (per-token float32 [M, 1], per-channel float32 [2N] for gate then up) when gate and up are the
    halves of a unit-scale FP8 product: each is first multiplied by its scales and rounded to up's dtype.
    smooth: float32 [N], the codes are those of h / s (as `rms_norm_rows`)."""
    _check_quant(quant)
    M, N = gate.shape
    smooth = _check_smooth(smooth, N, quant)
    if up.shape != gate.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"silu_mul_rows needs gate and up [M, N] with contiguous rows, got {tuple(gate.shape)} "
                         f"and {tuple(up.shape)}")
    rs, cols = _check_scales(in_scales, M, (2 * N,), "in_scales")
    h = torch.empty((M, N), dtype=up.dtype, device=up.device) if write_h else None
    codes, scales = _codes(M, N, quant, up.device)
    if scales is not None and N == 0:
        scales.fill_(1.0)  # empty rows: scale 1, as quarl.formats gives an all-zero row (no kernel writes it)
    scale_args = (rs, cols, cols[N:]) if rs is not None else (up, up, up)  # unused pointers when not scaled
    if M and quant is not None and 0 < N <= ROW_ON_CHIP_MAX:
        c0, c1, c2 = row_pieces(N)
        _silu_mul_row_kernel[(M,)](
            gate, up, h if h is not None else up, codes, scales, *scale_args, smooth if smooth is not None else up, N,
            gate.stride(0), up.stride(0), _group_stride(quant, scales), WRITE_H=write_h, QUANT_INT8=quant == "int8",
            SCALED=rs is not None, GROUPED=quant == "fp8-block", SMOOTH=smooth is not None, C0=c0, C1=c1, C2=c2,
            num_warps=SILU_ROW_WARPS)
    elif M:
        _silu_mul_kernel[(M,)](
            gate, up, h if h is not None else up, codes if codes is not None else up,
            scales if scales is not None else up, *scale_args, smooth if smooth is not None else up, N,
            gate.stride(0), up.stride(0), _group_stride(quant, scales), WRITE_H=write_h, QUANT=quant is not None,
            QUANT_INT8=quant == "int8", SCALED=rs is not None, GROUPED=quant == "fp8-block",
            SMOOTH=smooth is not None, BLOCK=2048, num_warps=8)
    return h, _typed(codes, quant), scales


def _check_smooth(smooth: torch.Tensor | None, n: int, quant: str | None) -> torch.Tensor | None:
    """The smoothing factors as the kernels read them (float32 [n], contiguous), or None."""
    if smooth is None:
        return None
    if quant is None:
        raise ValueError("smoothing factors given without a quant format: they divide only the codes' values")
    if smooth.dtype != torch.float32 or smooth.numel() != n:
        raise ValueError(f"smoothing factors must be float32 [{n}], got {smooth.dtype} {tuple(smooth.shape)}")
    return smooth.reshape(n).contiguous()


def _check_scales(pair, m: int, col_shape: tuple, name: str):
    """(row [M, 1] float32, cols float32 of col_shape, contiguous) or (None, None) for pair None."""
    if pair is None:
        return None, None
    rows, cols = pair
    if (rows.dtype != torch.float32 or cols.dtype != torch.float32 or tuple(rows.shape) != (m, 1)
            or tuple(cols.shape) != col_shape or not rows.is_contiguous() or not cols.is_contiguous()):
        raise ValueError(f"{name} must be contiguous float32 ([{m}, 1], {list(col_shape)}), got "
                         f"{rows.dtype} {tuple(rows.shape)} and {cols.dtype} {tuple(cols.shape)}")
    return rows, cols


def _heads_per_program(head_dim: int) -> int:
    """Heads per rotary program: about 1024 values each, at most 8 heads."""
    return max(1, min(8, 1024 // head_dim))


def rope_rows(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv: [M, >= (Hq + Hkv) * D] bf16 (q heads then k heads first in each row, rows contiguous); cos, sin:
    [M, D] bf16 (rows contiguous) -> (q [M, Hq, D], k [M, Hkv, D]) rotated, new contiguous tensors."""
    M = qkv.shape[0]
    D = head_dim
    if qkv.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16:
        raise ValueError(f"rope_rows rounds like PyTorch's bf16 ops and takes bf16 tensors, got {qkv.dtype}")
    if D & (D - 1) or qkv.stride(1) != 1 or qkv.shape[1] < (num_heads + num_kv_heads) * D:
        raise ValueError(f"rope_rows needs a power-of-two head_dim and rows of >= (Hq + Hkv) * D contiguous "
                         f"values; got head_dim={D}, qkv {tuple(qkv.shape)}")
    if cos.shape != (M, D) or sin.shape != (M, D) or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"cos and sin must be [M, D] = [{M}, {D}] with contiguous rows")
    q = torch.empty((M, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((M, num_kv_heads, D), dtype=qkv.dtype, device=qkv.device)
    if M:
        heads = _heads_per_program(D)
        _rope_kernel[(M, triton.cdiv(num_heads + num_kv_heads, heads))](
            qkv, cos, sin, q, k, num_heads, num_kv_heads, qkv.stride(0), cos.stride(0), D=D, HEADS=heads,
            num_warps=4)
    return q, k


def rope_rows_scaled(y: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor, bias: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope_rows` for a q/k/v projection run as a unit-scale FP8 GEMM: y [M, (Hq + 2 Hkv) D] bf16 (the product
    of the codes, rows contiguous), row_scales float32 [M, 1], col_scales float32 [(Hq + 2 Hkv) D], bias bf16
    [(Hq + 2 Hkv) D] or None; cos, sin [M, D] bf16 -> (q [M, Hq, D], k [M, Hkv, D] rotated, v [M, Hkv, D]), where
    every head is first bf16(y * row scale * column scale + bias)."""
    M, D = y.shape[0], head_dim
    n = (num_heads + 2 * num_kv_heads) * D
    if y.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16:
        raise ValueError(f"rope_rows_scaled rounds like PyTorch's bf16 ops and takes bf16 tensors, got {y.dtype}")
    if D & (D - 1) or y.stride(1) != 1 or y.shape[1] != n:
        raise ValueError(f"rope_rows_scaled needs a power-of-two head_dim and rows of (Hq + 2 Hkv) * D = {n} "
                         f"contiguous values; got head_dim={D}, y {tuple(y.shape)}")
    if cos.shape != (M, D) or sin.shape != (M, D) or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"cos and sin must be [M, D] = [{M}, {D}] with contiguous rows")
    rows, cols = _check_scales((row_scales, col_scales), M, (n,), "row_scales, col_scales")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    q = torch.empty((M, num_heads, D), dtype=y.dtype, device=y.device)
    k = torch.empty((M, num_kv_heads, D), dtype=y.dtype, device=y.device)
    v = torch.empty((M, num_kv_heads, D), dtype=y.dtype, device=y.device)
    if M:
        heads = _heads_per_program(D)
        _rope_scaled_kernel[(M, triton.cdiv(num_heads + 2 * num_kv_heads, heads))](
            y, rows, cols, bias if bias is not None else cols, cos, sin, q, k, v, num_heads, num_kv_heads,
            y.stride(0), cos.stride(0), D=D, HEADS=heads, HAS_BIAS=bias is not None, num_warps=4)
    return q, k, v
