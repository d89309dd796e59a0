"""W4A16 decode GEMMs for NVFP4 / MXFP4 weights and M <= 64 rows: out = x @ dequant(W)^T (+ bias).

Why a separate kernel family: at decode sizes the GEMM should stream 0.5625 byte per weight at HBM speed, which
on an H200 leaves the SMs only ~4-5 issued lane-instructions per weight. `fp4_gemm` / `gemv` spend more (byte
unpack, an fp32 scale multiply per weight, re-interleaving even/odd elements through shared memory), so they
are ALU-bound. Here:

* Codes are loaded as int32 words: word w of a row holds elements 8w..8w+7, element 8w+e in bits 4e..4e+3
  (little-endian bytes, low nibble first). Two shifts and one mask/or (`_pairs16`) give an fp16x2 bit pattern
  holding elements e and e+4: sign -> bit 15 / 31, (e1 e0 m) -> bits 11..9 / 27..25. Each half is exactly the
  E2M1 value times 2^-14 (see `fp4_gemm`), so a word decodes in 4 such steps with no byte unpacking.
* FMA path: x is loaded contiguously as [rows, words, 8] and split in registers into its 8 element positions;
  the dot product is then taken position by position over the words (a sum over K may be reordered), so
  nothing is re-interleaved. (The MMA path instead permutes K within each step, below.)
* FMA path (cfg.bm = 1, CUDA cores, M <= 8): per word the 8 products are summed first and the block scale
  multiplies that partial sum once (one FMA per 8 weights and row instead of one multiply per weight).
* MMA path (cfg.bm = 16, tensor cores, M <= 64): swap-AB, out^T [BN, Mp] = W [BN, K] @ x^T [K, Mp], so the
  weight rows fill the wgmma's 64-row dimension and M pads only to Mp = 16, 32 or 64. The weight is the MMA's
  register operand: its codes are copied to shared memory asynchronously (software-pipelined cp.async) and each
  thread reads back, with one 16-byte load per row, exactly the 4 words its wgmma register fragment needs, decodes
  them in registers and feeds the MMA with no shared-memory round trip of the decoded weight. That works because
  a sum over K may be reordered: within every 128-element step the kernel multiplies logical position
  kl = 16 (2 w + j1) + 8 s + 2 c + h with physical element p = 32 c + 8 w + 4 h + 2 j1 + s (c = lane % 4 of the
  fragment, w = word of the thread's 4, nibble e = 4 h + 2 j1 + s of the word), and x is permuted the same way in
  registers before it is staged for the MMA (x is small: Mp x 128 per step). With cfg.native (and K a multiple
  of 128) x is instead permuted once, by one copy before the launch, and streams into the MMA's shared-memory
  operand untouched: no staging through registers (Triton then issues the MMA in 8 waited pieces); it pays
  with more rows, so the tuning table picks it per shape and M.
  A pair (nibbles e, e + 4 of a word) becomes one 16x2 bit pattern in 2 shifts and 2 LOP3s (`_pairs16`) and is
  scaled by one packed multiply (`_scaled_pair`), which is exact: bf16 x takes the patterns as E2M1 x 2^-126 and
  the block scale folded with 2^118 (NVFP4's E4M3 value x 2^118; MXFP4's 2^(e-127) x 2^102 = 2^(e-25)); fp16 x
  takes E2M1 x 2^-14 and the E4M3 scale as it is. A code has <= 2 significant bits and an E4M3 scale 4, so
  every product is exact in 16 bits; the powers of two go back into the fp32 result in the epilogue.
* The NVFP4 fp32 global scale and the folded power of two multiply the fp32 result once, in the epilogue: 2^14
  on the FMA path (MXFP4's E8M0 scale carries the 2^14 itself, as in `fp4_gemm`; exponents above 240 would
  overflow it), 2^8 / 2^14 / 2^24 on the MMA path for bf16 NVFP4 / fp16 NVFP4 / MXFP4. MXFP4 on the MMA path is
  exact for E8M0 exponents 26 <= e <= 152 (block scales 2^-101 .. 2^25; weights use about 2^-15 .. 2^3), where
  every scaled code is a normal bf16. Below, the products become bf16 subnormals (exact only as far as the
  hardware keeps them; from e < 19 bits are lost, values under ~1e-31); above, the scale is made +inf, so such
  a block turns the output into inf / NaN instead of silently wrong numbers.
* Split-K (cfg.split_k > 1, for small N) stays one launch: every program stores its fp32 partial tile, takes a
  ticket from a per-tile atomic counter, and the program that draws the last ticket sums all partials in split
  order (deterministic) and writes the output, then resets the counter to 0 (no memset per call). The counters
  are cached per device and stream: split-K launches of this module must not run concurrently on one stream's
  counters (kernels on one stream, graph replays included, run one after the other, which is the case here).

Results equal `x.float() @ dequantize(W, float32).T` up to fp32 summation order and the final rounding to
x.dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quarl.kernels.tuning import FP4_DECODE_FMA_MAX_M, FP4_DECODE_MAX_M, Cfg, check_fp4_decode_cfg

__all__ = ["fp4_decode_matmul", "check_fp4_decode_inputs"]

_FORMATS = ("nvfp4", "mxfp4")


# ---------------------------------------------------------------------------------------------- device functions


@triton.jit
def _pairs16(v, E: tl.constexpr, BF16: tl.constexpr):
    """int32 code words [...] -> int32 16x2 patterns [...]: low half nibble E, high half nibble E + 4 of the word.
    BF16: each half is the E2M1 value times 2^-126 as a bf16 (sign -> bit 15, e1 e0 m -> bits 8..6, the E2M1
    subnormal 0.5 landing on the bf16 subnormal 2^-127); else times 2^-14 as an fp16 (e1 e0 m -> bits 11..9)."""
    if BF16:
        MAG: tl.constexpr = 6 - 4 * E
        MAG_BITS: tl.constexpr = 0x01C001C0
    else:
        MAG: tl.constexpr = 9 - 4 * E
        MAG_BITS: tl.constexpr = 0x0E000E00
    if MAG >= 0:
        mag = v << MAG
    else:
        mag = v >> (-MAG)  # arithmetic shift: the sign-extended top bits fall outside the mask
    SIGN: tl.constexpr = 12 - 4 * E
    if SIGN == 0:
        sg = v
    else:
        sg = v << SIGN
    # -2147450880 is the int32 0x80008000 (the two sign bits), written signed to stay an int32 constant.
    return (mag & MAG_BITS) | (sg & -2147450880)


@triton.jit
def _halves_f32(t, INTERPRETED: tl.constexpr):
    """int32 fp16x2 patterns -> (low, high) halves as float32 (exact).

    On the GPU one inline-PTX block per register (two cvt.f32.f16): going through Triton's int16 / float16
    tensors makes the compiler re-lay the 16-bit values out through shared memory (a bar.sync pair per call in
    the K loop). Triton's CPU interpreter runs no PTX, so it takes the tensor route."""
    if INTERPRETED:
        lo = t.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=f,=f,r", [t], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _split8(x3, R: tl.constexpr, W: tl.constexpr):
    """x [R, W, 8] -> its 8 element positions [R, W] as float32, returned as the decode pairs
    (e0, e4), (e1, e5), (e2, e6), (e3, e7). Splits of an in-register last dimension move no data."""
    ev, od = tl.split(tl.reshape(x3.to(tl.float32), (R, W, 4, 2)))  # positions 0,2,4,6 and 1,3,5,7
    e04, e26 = tl.split(tl.reshape(ev, (R, W, 2, 2)))
    o15, o37 = tl.split(tl.reshape(od, (R, W, 2, 2)))
    x0, x4_ = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3_, x7 = tl.split(o37)
    return x0, x4_, x1, x5, x2, x6, x3_, x7


@triton.jit
def _scale_f32(sc, IS_MX: tl.constexpr):
    """Block-scale bytes (uint8) -> float32: E4M3 value (nvfp4), or 2^(e-127) * 2^14 (mxfp4, E8M0)."""
    if IS_MX:
        return ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    else:
        return sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _finish(acc, idx_m, idx_n, ok, gs_ptr, bias_ptr, out_ptr, stride_om, IS_MX: tl.constexpr,
            HAS_BIAS: tl.constexpr, POST: tl.constexpr):
    """acc fp32 (any 2-D orientation; idx_m / idx_n broadcast to its shape) -> out[m, n] in out's dtype, after
    the folded power of two POST, the global scale (nvfp4) and the bias."""
    if IS_MX:
        if POST != 1.0:
            acc = acc * POST
    else:
        acc = acc * (tl.load(gs_ptr) * POST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + idx_n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx_m * stride_om + idx_n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _epilogue(acc, idx_m, idx_n, ok, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, stride_om, pid_n, pid_k,
              IS_MX: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, POST: tl.constexpr):
    """Write the tile, directly (SPLIT_K == 1) or through the fp32 partials [SPLIT_K, M, N] and the ticket of
    tile pid_n: the last of the SPLIT_K programs sums the partials in split order and writes the output."""
    if SPLIT_K == 1:
        _finish(acc, idx_m, idx_n, ok, gs_ptr, bias_ptr, out_ptr, stride_om, IS_MX, HAS_BIAS, POST)
    else:
        part = part_ptr + idx_m * N + idx_n
        tl.store(part + pid_k * M * N, acc, mask=ok)
        # Every thread's partial must be written before the ticket (release, gpu scope) announces it.
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            tot = tl.load(part, mask=ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                # .cg: read from L2, where the other SMs' partials are (this SM's L1 is not coherent).
                tot += tl.load(part + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            _finish(tot, idx_m, idx_n, ok, gs_ptr, bias_ptr, out_ptr, stride_om, IS_MX, HAS_BIAS, POST)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def _load_step(w_ptrs, s_ptrs, x_ptrs, n_ok, m_ok, w_in_k, x_in_k, EVEN_K: tl.constexpr):
    """One K step's operands from pointer tensors in the layout the caller chose: code words v int32 and their
    block-scale bytes sc (the shape of w_ptrs / s_ptrs), x (the shape of x_ptrs, [..., BKW, 8]). n_ok / m_ok
    mask the rows past N / M, w_in_k / x_in_k the words past KW and the elements past K (not used with EVEN_K).
    Masked loads give zero codes and zero x."""
    if EVEN_K:
        v = tl.load(w_ptrs, mask=n_ok, other=0)
        sc = tl.load(s_ptrs, mask=n_ok, other=0)
        x3 = tl.load(x_ptrs, mask=m_ok, other=0.0)
    else:
        v = tl.load(w_ptrs, mask=n_ok & w_in_k, other=0)
        sc = tl.load(s_ptrs, mask=n_ok & w_in_k, other=0)
        # x's last dim is the unpadded K: the weight's zero padding meets x's masked zeros.
        x3 = tl.load(x_ptrs, mask=m_ok & x_in_k, other=0.0)
    return v, sc, x3


@triton.jit(do_not_specialize=["M"])
def _fp4_dec_fma_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, KW, words_per_split, stride_xm, stride_wn, stride_sn, stride_om,
    IS_MX: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """CUDA-core path. x [M, K] bf16/fp16 (unit stride along K); w int32 code words [N, KW] (KW = Kp/8);
    s uint8 block-scale bytes [N, Kp/G]; gs float32 [] (nvfp4); bias [N]; out [M, N] in x's dtype;
    part float32 [SPLIT_K, M, N] and cnt int32 [>= cdiv(N, BN)] for split-K. Grid (cdiv(N, BN), SPLIT_K)."""
    WPG: tl.constexpr = 4 if IS_MX else 2  # code words per block scale
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    n_ok = offs_n < N
    m_ok = offs_m < M
    ar_w = tl.arange(0, BKW)
    ar_e = tl.arange(0, 8)
    # Codes and scales are loaded as [1, BN, BKW], in the accumulator's [BM, BN, BKW] layout (loaded as [BN, BKW]
    # and expanded, they would be re-laid out through shared memory every step). Pointers advance by one K step
    # per iteration instead of being recomputed (64-bit address arithmetic per word is a visible cost here).
    w0 = pid_k * words_per_split + ar_w  # first step's word indices [BKW]
    nk_ok = n_ok[None, :, None]
    w_ptrs = w_ptr + offs_n[None, :, None] * stride_wn + w0[None, None, :]
    s_ptrs = s_ptr + offs_n[None, :, None] * stride_sn + (w0 // WPG)[None, None, :]
    kx = (w0[:, None] * 8 + ar_e[None, :])[None, :, :]  # element index [1, BKW, 8]
    x_ptrs = x_ptr + offs_m[:, None, None] * stride_xm + kx
    acc = tl.zeros((BM, BN, BKW), dtype=tl.float32)
    for it in range(0, words_per_split // BKW):
        # x as [BM, BKW, 8] (one 16-byte load per word and row), split in registers into element positions.
        v, sc, x3 = _load_step(w_ptrs, s_ptrs, x_ptrs, nk_ok, m_ok[:, None, None],
                               ((w0 + it * BKW) < KW)[None, None, :], kx + it * BKW * 8 < K, EVEN_K)
        w_ptrs += BKW
        s_ptrs += BKW // WPG
        x_ptrs += BKW * 8
        x0, x4, x1, x5, x2, x6, x3_, x7 = _split8(x3, BM, BKW)
        # One chain of fused multiply-adds per word (p + a * b contracts to one FMA).
        lo, hi = _halves_f32(_pairs16(v, 0, False), INTERPRETED)
        p = x0[:, None, :] * lo
        p = p + x4[:, None, :] * hi
        lo, hi = _halves_f32(_pairs16(v, 1, False), INTERPRETED)
        p = p + x1[:, None, :] * lo
        p = p + x5[:, None, :] * hi
        lo, hi = _halves_f32(_pairs16(v, 2, False), INTERPRETED)
        p = p + x2[:, None, :] * lo
        p = p + x6[:, None, :] * hi
        lo, hi = _halves_f32(_pairs16(v, 3, False), INTERPRETED)
        p = p + x3_[:, None, :] * lo
        p = p + x7[:, None, :] * hi
        # One scale per word's partial sum (a word lies inside one block).
        acc = acc + p * _scale_f32(sc, IS_MX)
    y = tl.sum(acc, axis=2)  # [BM, BN]
    ok = m_ok[:, None] & n_ok[None, :]
    _epilogue(y, offs_m[:, None], offs_n[None, :], ok, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N,
              stride_om, pid_n, pid_k, IS_MX, HAS_BIAS, SPLIT_K, 1.0 if IS_MX else 16384.0)


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """acc += a @ b. INTERPRETED (Triton's CPU interpreter only, whose bf16 dot multiplies raw bit patterns):
    the same exactly representable operands multiplied as float32."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _halves16_f32(t, DT: tl.constexpr):
    """int32 16x2 patterns of DT (bf16 / fp16) -> (low, high) halves as float32, exactly (interpreter route of
    `_scaled_pair`; a bf16 pattern is the top half of its float32)."""
    if DT == tl.bfloat16:
        return (t << 16).to(tl.float32, bitcast=True), (t & -65536).to(tl.float32, bitcast=True)
    else:
        return _halves_f32(t, True)


@triton.jit
def _scaled_pair(t, s2, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """16x2 patterns t times packed 16x2 scales s2 (both int32 [...]) -> the (low, high) products as DT tensors,
    exact (see the module docstring). One packed bf16x2 / f16x2 multiply per pair on the GPU; Triton's CPU interpreter
    runs no PTX, so there the halves are multiplied in float32 (the same exact products)."""
    if INTERPRETED:
        lo, hi = _halves16_f32(t, DT)
        slo, shi = _halves16_f32(s2, DT)
        return (lo * slo).to(DT), (hi * shi).to(DT)
    elif DT == tl.bfloat16:
        # fma with a -0 addend is the rounded product (sign of zero included) and, unlike mul.rn.bf16x2 (sm_90+),
        # exists from sm_80 on.
        return tl.inline_asm_elementwise(
            "{ .reg .b32 p, z; mov.b32 z, 0x80008000; fma.rn.bf16x2 p, $2, $3, z; mov.b32 {$0, $1}, p; }",
            "=h,=h,r,r", [t, s2], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 p; mul.rn.f16x2 p, $2, $3; mov.b32 {$0, $1}, p; }",
            "=h,=h,r,r", [t, s2], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def _packed_scales(sc, BN: tl.constexpr, Q: tl.constexpr, IS_MX: tl.constexpr, DT: tl.constexpr):
    """Block-scale bytes [BN, Q * 8] (nvfp4) / [BN, Q * 4] (mxfp4) of one K step -> int32 [BN, Q, 4, 4]: for
    every code word (c, w) of a thread's fragment the scale of its block as DT, duplicated into both halves.
    bf16: E4M3 value * 2^118 or 2^(e-127) * 2^102; fp16: the E4M3 value (all exact)."""
    if IS_MX:
        # 2^(e - 25) as float32 bits; e >= 153 saturates to +inf (exponent field 255), see the module docstring.
        sf = ((tl.minimum(sc.to(tl.int32), 153) + 102) << 23).to(tl.float32, bitcast=True)
    else:
        sf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if DT == tl.bfloat16:
            sf = sf * 3.32306998946228968226e35  # 2^118
    if DT == tl.bfloat16:
        h = (sf.to(tl.int32, bitcast=True) >> 16) & 0xFFFF  # exact in bf16: the low 16 bits are zero
    else:
        h = sf.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    s2 = h | (h << 16)
    # Physical word 4 c + w of a 128-element step lies in block (4 c + w) // words per block.
    if IS_MX:
        return tl.broadcast_to(tl.reshape(s2, (BN, Q, 4, 1)), (BN, Q, 4, 4))
    else:
        return tl.reshape(tl.broadcast_to(tl.reshape(s2, (BN, Q, 4, 2, 1)), (BN, Q, 4, 2, 2)), (BN, Q, 4, 4))


@triton.jit
def _mma_step(v, sc, xl, acc, BN: tl.constexpr, BMX: tl.constexpr, Q: tl.constexpr, IS_MX: tl.constexpr,
              DT: tl.constexpr, XP: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc [BN, BMX] fp32 += one K step: code words v int32 [BN, 16 Q] and scale bytes sc [BN, 16 Q / words per
    block] in physical order, x [BMX, 128 Q] in DT, physical order or (XP) already permuted into the logical
    order (see the module docstring for the K permutation)."""
    BK: tl.constexpr = 128 * Q
    BF16: tl.constexpr = DT == tl.bfloat16
    v = tl.reshape(v, (BN, Q, 4, 4))  # [row, step, c, w]
    s2 = _packed_scales(sc, BN, Q, IS_MX, DT)
    l0, h0 = _scaled_pair(_pairs16(v, 0, BF16), s2, DT, INTERPRETED)
    l1, h1 = _scaled_pair(_pairs16(v, 1, BF16), s2, DT, INTERPRETED)
    l2, h2 = _scaled_pair(_pairs16(v, 2, BF16), s2, DT, INTERPRETED)
    l3, h3 = _scaled_pair(_pairs16(v, 3, BF16), s2, DT, INTERPRETED)
    # nibble e = 4 h + 2 j1 + s -> [row, step, c, w, h, s, j1] -> logical [row, step, w, j1, s, c, h]
    t = tl.join(tl.join(tl.join(l0, h0), tl.join(l1, h1)), tl.join(tl.join(l2, h2), tl.join(l3, h3)))
    wt = tl.reshape(tl.permute(t, (0, 1, 3, 6, 5, 2, 4)), (BN, BK))
    # x physical [m, step, c, w, h, j1, s] -> the same logical order, transposed for the MMA's K x Mp operand
    if XP:  # x arrives permuted already
        return _dot(wt, tl.trans(xl), acc, INTERPRETED)
    xt = tl.permute(tl.reshape(xl, (BMX, Q, 4, 4, 2, 2, 2)), (0, 1, 3, 5, 6, 2, 4))
    return _dot(wt, tl.trans(tl.reshape(xt, (BMX, BK))), acc, INTERPRETED)


@triton.jit(do_not_specialize=["M"])
def _fp4_dec_mma_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, KW, words_per_split, stride_xm, stride_wn, stride_sn, stride_om,
    IS_MX: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BMX: tl.constexpr, BN: tl.constexpr, Q: tl.constexpr, XP: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Tensor-core path (swap-AB): same arguments as `_fp4_dec_fma_kernel` (with XP, x is the host's permuted
    copy); BMX >= M (16, 32 or 64) is the MMA's narrow dimension, Q steps of 128 elements (16 code words per row)
    per pipeline stage.

    The steps that lie wholly inside the split's words and x's K run unmasked; the one step at the end of a
    split that reaches past them runs masked after the loop (EVEN_K: there is none), so a ragged K or split
    costs only that step."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    WPG: tl.constexpr = 4 if IS_MX else 2  # code words per block scale
    BKW: tl.constexpr = 16 * Q
    BK: tl.constexpr = 128 * Q
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BMX)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w0 = pid_k * words_per_split
    ar_w = tl.arange(0, BKW)
    ar_s = tl.arange(0, BKW // WPG)
    ar_k = tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (w0 + ar_w)[None, :]
    s_ptrs = s_ptr + offs_n[:, None] * stride_sn + (w0 // WPG + ar_s)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (w0 * 8 + ar_k)[None, :]
    acc = tl.zeros((BN, BMX), dtype=tl.float32)
    if EVEN_K:
        n_full = words_per_split // BKW
    else:
        w_end = tl.minimum(w0 + words_per_split, KW)  # this split's words
        n_full = tl.maximum(tl.minimum(w_end, K // 8) - w0, 0) // BKW  # steps needing no mask
    for it in range(0, n_full):
        v = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        sc = tl.load(s_ptrs, mask=n_ok[:, None], other=0)
        xl = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w_ptrs += BKW
        s_ptrs += BKW // WPG
        x_ptrs += BK
        acc = _mma_step(v, sc, xl, acc, BN, BMX, Q, IS_MX, DT, XP, INTERPRETED)
    if not EVEN_K:
        for it in range(n_full, tl.cdiv(w_end - w0, BKW)):
            wi = w0 + it * BKW
            v = tl.load(w_ptrs, mask=n_ok[:, None] & (wi + ar_w < w_end)[None, :], other=0)
            sc = tl.load(s_ptrs, mask=n_ok[:, None] & (wi + ar_s * WPG < w_end)[None, :], other=0)
            # x's last dim is the unpadded K: the weight's zero padding meets x's masked zeros.
            xl = tl.load(x_ptrs, mask=m_ok[:, None] & (wi * 8 + ar_k < K)[None, :], other=0.0)
            w_ptrs += BKW
            s_ptrs += BKW // WPG
            x_ptrs += BK
            acc = _mma_step(v, sc, xl, acc, BN, BMX, Q, IS_MX, DT, XP, INTERPRETED)
    ok = n_ok[:, None] & m_ok[None, :]
    if IS_MX:
        POST: tl.constexpr = 16777216.0  # 2^24
    elif DT == tl.bfloat16:
        POST: tl.constexpr = 256.0
    else:
        POST: tl.constexpr = 16384.0
    _epilogue(acc, offs_m[None, :], offs_n[:, None], ok, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N,
              stride_om, pid_n, pid_k, IS_MX, HAS_BIAS, SPLIT_K, POST)


# ---------------------------------------------------------------------------------------------- host side

_TICKETS: dict[tuple, torch.Tensor] = {}
# Triton's CPU interpreter (used to check these kernels without a GPU) runs no inline PTX and needs the float32
# dot: see `_halves_f32`, `_scaled_pair` and `_dot`.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros [>= n], one counter per output tile, cached per (device, stream); kernels leave them at 0.

    The first call for a device/stream (or a larger n) allocates: make it outside CUDA-graph capture (a warm-up
    call, which also compiles the kernel)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    t = _TICKETS.get(key)
    if t is None or t.numel() < n:
        t = _TICKETS[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return t


def check_fp4_decode_inputs(x: torch.Tensor, qweight, bias: torch.Tensor | None, cfg: Cfg) -> None:
    """Raise ValueError (what is wrong and how to fix it) for inputs `fp4_decode_matmul` does not take."""
    check_fp4_decode_cfg(cfg)
    fmt = getattr(qweight, "fmt", None)
    if fmt not in _FORMATS:
        raise ValueError(f"fp4_decode_matmul takes nvfp4 / mxfp4 weight QuantizedTensors, got fmt={fmt!r}")
    if qweight.role != "weight" or len(qweight.shape) != 2:
        raise ValueError(f"fp4_decode_matmul needs a 2-D weight [N, K] (role 'weight'), got role={qweight.role!r} "
                         f"shape={tuple(qweight.shape)}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        what = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"fp4_decode_matmul needs x [M, K] in bfloat16 or float16, got {what}")
    m, k = x.shape
    n = qweight.shape[0]
    if m > FP4_DECODE_MAX_M:
        raise ValueError(f"fp4_decode_matmul is for decode, M <= {FP4_DECODE_MAX_M} rows, got M={m}; "
                         "use the fp4 GEMM or dequantize + cuBLAS plans for larger M")
    if cfg.bm == 1 and m > FP4_DECODE_FMA_MAX_M:
        raise ValueError(f"the CUDA-core path (cfg.bm=1) takes M <= {FP4_DECODE_FMA_MAX_M} rows, got M={m}; "
                         "use the tensor-core path (cfg.bm=16)")
    if x.stride(1) != 1:
        raise ValueError(f"fp4_decode_matmul needs x contiguous along K, got strides {x.stride()}; "
                         "pass x.contiguous()")
    if k != qweight.shape[1]:
        raise ValueError(f"x has K={k} input features but the weight is {tuple(qweight.shape)}; x must be [M, K]")
    if not (qweight.data.is_contiguous() and qweight.scale.is_contiguous()):
        raise ValueError("fp4_decode_matmul needs contiguous weight codes and scales (as quantize() makes them)")
    if qweight.data.device != x.device or qweight.scale.device != x.device:
        raise ValueError(f"x is on {x.device} but the weight is on {qweight.data.device}; move one of them")
    if fmt == "mxfp4" and x.dtype == torch.float16:
        raise ValueError("mxfp4 weights need bfloat16 x: E8M0 block scales can leave float16's range")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] tensor on {x.device}, got shape {tuple(bias.shape)} "
                         f"on {bias.device}")


def fp4_decode_matmul(x: torch.Tensor, qweight, bias: torch.Tensor | None, cfg: Cfg) -> torch.Tensor:
    """x [M <= 64, K] bf16/fp16 (unit stride along K) times an nvfp4/mxfp4 weight QuantizedTensor [N, K] -> [M, N] in
    x.dtype, = x @ dequantize(W)^T (+ bias [N]) up to fp32 summation order and the final rounding.

    cfg (a `quarl.kernels.tuning.Cfg`): bm = 1 CUDA-core FMA path (M <= 8) or 16 tensor-core path; bn output
    features per program; bk K elements per step (a power of two >= 64 / 128 or 256); split_k programs per output
    tile along K; warps, stages as Triton's num_warps / num_stages; native (bm = 16): x permuted beforehand
    (module docstring). Raises ValueError on unsupported input.
    """
    check_fp4_decode_inputs(x, qweight, bias, cfg)
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    is_mx = qweight.fmt == "mxfp4"
    try:
        words = qweight.data.view(torch.int32)  # [N, Kp/8]: Kp is a multiple of 16, so rows are whole words
    except RuntimeError as e:
        raise ValueError(f"the weight codes cannot be read as int32 words ({e}); pass a freshly quantized weight"
                         ) from None
    scale = qweight.scale.view(torch.uint8)
    gs = scale if is_mx else qweight.global_scale  # any tensor when unused
    kw = words.shape[1]
    bkw = cfg.bk // 8
    # Each split covers whole K steps; the split count is what is left after rounding.
    wps = triton.cdiv(triton.cdiv(kw, cfg.split_k), bkw) * bkw
    split = triton.cdiv(kw, wps)
    even_k = k == kw * 8 and kw % wps == 0
    n_tiles = triton.cdiv(n, cfg.bn)
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        cnt = _tickets(x.device, n_tiles)
    else:
        part = cnt = out  # unused
    xp = cfg.bm == 16 and cfg.native and k % 128 == 0
    if xp:  # x permuted once, by one copy, into the MMA path's K order (see the module docstring)
        x = x.unflatten(1, (k // 128, 4, 4, 2, 2, 2)).permute(0, 1, 3, 5, 6, 2, 4).reshape(m, k)
    args = (x, words, scale, gs, bias if bias is not None else out, out, part, cnt,
            m, n, k, kw, wps, x.stride(0), words.stride(0), scale.stride(0), out.stride(0))
    meta = dict(IS_MX=is_mx, HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_K=even_k, BN=cfg.bn,
                INTERPRETED=_INTERPRETED, num_warps=cfg.warps, num_stages=cfg.stages)
    if cfg.bm == 1:
        _fp4_dec_fma_kernel[(n_tiles, split)](*args, BM=triton.next_power_of_2(m), BKW=bkw, **meta)
    else:
        _fp4_dec_mma_kernel[(n_tiles, split)](*args, BMX=max(16, triton.next_power_of_2(m)), Q=cfg.bk // 128, XP=xp,
                                              **meta)
    return out
