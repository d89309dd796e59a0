"""Decode attention over a slot KV cache (one query token per sequence), split-KV "flash decoding" in Triton.

Each program handles one sequence, one key/value head and one range of cache columns: it loads the G query heads
that share that kv head (grouped-query attention) once, streams the keys/values of its columns in blocks with an
online softmax, and writes an unnormalised partial result. Only the columns a sequence has filled are read, so
the cost follows the real context lengths, not the cache capacity. A short torch epilogue merges the column
ranges (`num_splits` > 1 keeps the GPU busy when the batch is small); with one range the kernel normalises and
writes the result itself.

The cache may hold bf16/fp16 or FP8 E4M3 values (FP8 KV cache: stored value = x / kv_scale, read back as
stored * kv_scale). Scores and the softmax are accumulated in float32. With an FP8 cache both dots take fp16
operands (the codes widen exactly; q * scale and the probabilities are rounded to fp16, finer than bf16), and
kv_scale is applied to q and to the result rather than to every cached value. A token-scaled FP8 cache
(per-token float32 scales next to the codes) multiplies each column's scores by its key scale and each
probability by its value scale, normalised by the largest value scale of the program's column range.

Imports Triton: load it only when `quarl.kernels.kernels_available()` says the kernels can run. The plain-torch
semantics are `quarl.rollout.fast_attention.decode_attention_torch`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from quarl.kernels.common import num_sms as sm_count
from quarl.kernels.quant_utils import div_by_scale

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_block(q, k_base, v_base, ks_base, vs_base, n0, end, offs_n, offs_d, d_ok, stride_kn, stride_vn,
                  m_i, l_i, acc, v_norm, FP8_KV: tl.constexpr, TOKEN_SCALES: tl.constexpr, MASKED: tl.constexpr,
                  D_MASK: tl.constexpr):
    """Online-softmax update of (m_i [G], l_i [G], acc [G, D] float32) with cache columns n0 .. n0 + BLOCK_N - 1.

    MASKED: the block may pass `end` (a range's last, partial block): columns >= end load as zeros and score
    -inf. D_MASK: head_dim is narrower than the block (padding lanes load as zeros)."""
    cols = n0 + offs_n
    n_ok = cols < end
    k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    elif D_MASK:
        k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if FP8_KV:
        # Triton's own widening: faster than an inline-asm one pinned before V's change of layout
        # (bench/results/decode_attention.md).
        v = v.to(tl.float16)
        k = k.to(tl.float16)
    s = tl.dot(q, tl.trans(k))  # [BLOCK_G, BLOCK_N] float32, in log2 units with an FP8 cache
    if not FP8_KV:
        s = s * LOG2E
    if TOKEN_SCALES:
        s = s * tl.load(ks_base + cols, mask=n_ok, other=1.0)[None, :]
    if MASKED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if TOKEN_SCALES:
        p = p * (tl.load(vs_base + cols, mask=n_ok, other=0.0) / v_norm)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, len_ptr, acc_ptr, m_ptr, l_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_sb, stride_sh,
    stride_ab, stride_ah, stride_as,
    stride_mb, stride_mh,
    sm_scale, kv_scale, split_len,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, TOKEN_SCALES: tl.constexpr, NORMALIZE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # b * slot stride can pass 2^31 in a large cache
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(len_ptr + b).to(tl.int32)  # int32 loop bounds whatever the lengths' dtype
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < HEAD_DIM
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    FP8_KV: tl.constexpr = k_ptr.dtype.element_ty != q_ptr.dtype.element_ty
    # Scores in log2 units, so the softmax takes exp2 directly. With an FP8 cache log2(e) is folded into q with the
    # softmax scale: one multiply less per score than exp.
    if FP8_KV:
        # FP8 cache: the E4M3 codes widen to fp16 exactly with one conversion per pair of values, so the dots run
        # in fp16 on the raw codes; kv_scale moves out of the loop (into q for the scores, onto acc at the end).
        q = (q.to(tl.float32) * (sm_scale * kv_scale * LOG2E)).to(tl.float16)
    else:
        # Fold the softmax scale into q once (float32), then back to the operand dtype for the tensor cores.
        # log2(e) stays out of q here: q is rounded to bf16, and the same rounding as the module path's scaled
        # scores keeps greedy decoding on the same tokens; this path is bound by its cache reads anyway.
        q = (q.to(tl.float32) * sm_scale).to(q_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    ks_base = ks_ptr + b * stride_sb + kvh * stride_sh
    vs_base = vs_ptr + b * stride_sb + kvh * stride_sh
    v_norm = 1.0
    if TOKEN_SCALES:
        # Per-token value scales enter as p * v_scale before the fp16 PV dot. Divided by their largest value in
        # this column range they lie in (0, 1] like p, so fp16 keeps them (a raw scale, amax / 448, can sit in
        # fp16's subnormal range); the factor goes back onto acc at the end.
        v_top = tl.zeros([BLOCK_N], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            v_top = tl.maximum(v_top, tl.load(vs_base + n0 + offs_n, mask=n0 + offs_n < end, other=0.0))
        v_norm = tl.max(v_top, 0)
        v_norm = tl.where(v_norm > 0, v_norm, 1.0)
    # Full blocks load without a column mask (less mask and select work: 851 against 1016 sm_90 SASS
    # instructions per 64-column block); the last, partial block of the range is masked.
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, ks_base, vs_base, n0, end, offs_n, offs_d, d_ok, stride_kn,
                                      stride_vn, m_i, l_i, acc, v_norm, FP8_KV, TOKEN_SCALES,
                                      MASKED=False, D_MASK=BLOCK_D != HEAD_DIM)
    if full_end < end:
        m_i, l_i, acc = _attend_block(q, k_base, v_base, ks_base, vs_base, full_end, end, offs_n, offs_d, d_ok,
                                      stride_kn, stride_vn, m_i, l_i, acc, v_norm, FP8_KV, TOKEN_SCALES,
                                      MASKED=True, D_MASK=True)

    if TOKEN_SCALES:
        acc = acc * v_norm
    elif FP8_KV:
        acc = acc * kv_scale
    out_ptrs = acc_ptr + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + offs_d[None, :]
    if NORMALIZE:
        # One column range: the result itself, in the output dtype (what merge_splits would compute). The IEEE
        # quotient acc / l from one reciprocal per head (`div_by_scale`): a full division per value (FCHK and a
        # slow-path call each, 32 per thread) would be about 4 % of the FP8 kernel's instructions.
        l_safe = tl.where(g_ok, l_i, 1.0)
        tl.store(out_ptrs, div_by_scale(acc, l_safe[:, None]).to(acc_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out_ptrs, acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(m_ptr + b * stride_mb + heads * stride_mh + split, m_i / LOG2E, mask=g_ok)  # natural units
        tl.store(l_ptr + b * stride_mb + heads * stride_mh + split, l_i, mask=g_ok)


def choose_num_splits(batch: int, num_kv_heads: int, capacity: int, block_n: int = 64,
                      num_sms: int | None = None) -> int:
    """Column ranges per sequence so that batch * kv_heads * splits gives every SM at least two programs (at least
    1, at most one range per `block_n` columns). More ranges cost a float32 partial per range and the torch merge,
    so no more are used than filling the SMs needs (at 128 sequences of the 7B geometry, 512 programs on 132 SMs,
    one range is faster than two)."""
    if num_sms is None:
        num_sms = sm_count() if torch.cuda.is_available() else 132
    target = 2 * num_sms
    splits = max(1, -(-target // max(1, batch * num_kv_heads)))
    return int(min(splits, max(1, -(-capacity // block_n))))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     num_splits: int = 1, kv_scale: float = 1.0, block_n: int = 64, num_warps: int | None = None,
                     num_stages: int = 3, k_scales: torch.Tensor | None = None,
                     v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for one query token per sequence over its first `lengths[b]` cache columns.

    Args:
        q: [B, Hq, D] bf16/fp16 (last dim contiguous); query head h reads kv head h // (Hq / Hkv).
        k_cache, v_cache: [S >= B, Hkv, C, D] (last dim contiguous), q's dtype or torch.float8_e4m3fn; row b of
            the batch is slot b of the cache.
        lengths: int32/int64 [B], 1 <= lengths[b] <= C (columns to attend over, the current token included).
        num_splits: column ranges per sequence (see `choose_num_splits`); kv_scale: FP8 dequantisation scale.
        block_n, num_warps, num_stages: the tile; the defaults are the sweep's choice for both cache dtypes at 128
            and 512 sequences (bench/results/decode_attention.md). num_warps None = 2 for
            an FP8 cache (the sweep's choice there), else 4.
        k_scales, v_scales: [S, Hkv, C] float32 (last dim contiguous) per-token scales of a token-scaled FP8
            cache (values = stored * scale; kv_scale must then be 1), or None.
    Returns:
        [B, Hq, D] in q's dtype.
    """
    B, Hq, D = q.shape
    S, Hkv, C, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape or S < B or Hq % Hkv:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit k/v caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} (need the same head_dim, >= B slots, Hq a multiple of Hkv)")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("decode_attention needs q, k_cache and v_cache contiguous in the last dimension")
    if k_cache.dtype != q.dtype and k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"decode_attention reads a cache in q's dtype ({q.dtype}) or float8_e4m3fn, the same for keys "
                         f"and values; got keys {k_cache.dtype}, values {v_cache.dtype}")
    token = k_scales is not None
    if token and (v_scales is None or k_scales.shape != k_cache.shape[:3] or v_scales.shape != k_scales.shape
                  or k_scales.stride() != v_scales.stride() or k_scales.stride(-1) != 1 or kv_scale != 1.0
                  or k_cache.dtype != torch.float8_e4m3fn or k_scales.dtype != torch.float32
                  or v_scales.dtype != torch.float32):
        raise ValueError(f"per-token scales must be two [S, Hkv, C] = {tuple(k_cache.shape[:3])} float32 tensors "
                         "with the same strides, contiguous in the last dimension, for an FP8 cache with kv_scale 1")
    G = Hq // Hkv
    split_len = -(-C // num_splits)
    split_len = -(-split_len // block_n) * block_n
    num_splits = -(-C // split_len)
    normalize = num_splits == 1  # the kernel writes the result; no partials to merge
    if num_warps is None:
        num_warps = 2 if k_cache.dtype == torch.float8_e4m3fn else 4
    if normalize:
        acc = torch.empty(B, Hq, 1, D, device=q.device, dtype=q.dtype)
        m = l_ = acc  # unused
    else:
        acc = torch.empty(B, Hq, num_splits, D, device=q.device, dtype=torch.float32)
        m = torch.empty(B, Hq, num_splits, device=q.device, dtype=torch.float32)
        l_ = torch.empty_like(m)
    grid = (B, Hkv, num_splits)
    ks, vs = (k_scales, v_scales) if token else (acc, acc)  # unused pointers without token scales
    _decode_attention_kernel[grid](
        q, k_cache, v_cache, ks, vs, lengths, acc, m, l_,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0) if token else 0, ks.stride(1) if token else 0,
        acc.stride(0), acc.stride(1), acc.stride(2),
        0 if normalize else m.stride(0), 0 if normalize else m.stride(1),
        1.0 / math.sqrt(D), float(kv_scale), split_len,
        G=G, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_N=block_n, TOKEN_SCALES=token, NORMALIZE=normalize,
        num_warps=num_warps, num_stages=num_stages,
    )
    if normalize:
        return acc[:, :, 0]
    return merge_splits(acc, m, l_).to(q.dtype)


def merge_splits(acc: torch.Tensor, m: torch.Tensor, l_: torch.Tensor) -> torch.Tensor:
    """Combine per-range partials: acc [B, H, S, D], running max m and sum l [B, H, S] -> float32 [B, H, D].

    Ranges past a sequence's length hold m = -inf, l = 0 and weigh nothing; range 0 is never empty.
    """
    if m.shape[-1] == 1:
        return acc[:, :, 0] / l_
    m_max = m.amax(-1, keepdim=True)
    w = torch.exp(m - m_max)  # exp(-inf) = 0 for empty ranges
    return (acc * w[..., None]).sum(2) / (l_ * w).sum(-1, keepdim=True)
