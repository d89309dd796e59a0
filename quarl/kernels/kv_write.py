"""Decode-step KV-cache write in one launch: the new token's keys and values of every slot, FP8-rounded if the
cache is FP8, stored at each slot's column.

The torch write (`quarl.rollout.fast_cache.SlotKVCache.to_storage` + an index_put per tensor) takes four to five
kernels for keys and as many for values per layer; this is one. Values are bit for bit the torch ones:
  * single-scale FP8: codes = e4m3(clamp(x * float32(1 / kv_scale), +-448)), round to nearest even (PyTorch's
    CUDA division by a scalar is that multiplication);
  * token-scaled FP8: scale = amax over head_dim * float32(1/448) (stored as 0 for an all-zero vector), codes =
    e4m3(clamp(x / scale, +-448)): `quarl.formats` "fp8" rows, as `SlotKVCache.quantize_tokens`;
  * other cache dtypes: a plain cast.

Imports Triton: load it only when `quarl.kernels.kernels_available()` says the kernels can run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.kernels.quant_utils import quantize_tile, safe_scale


@triton.jit
def _to_cache(x, inv_scale, FP8: tl.constexpr, TOKEN_SCALES: tl.constexpr, dtype: tl.constexpr):
    """One head's vector x [BLOCK_D] (zeros past head_dim) -> (codes in the cache dtype, its float32 scale)."""
    s = inv_scale
    if TOKEN_SCALES:
        x32 = x.to(tl.float32)
        amax = tl.max(tl.abs(x32), axis=0)
        s = safe_scale(amax, 448.0)
        q = quantize_tile(x32, s, False).to(dtype)
        s = tl.where(amax > 0, s, 0.0)  # an all-zero vector stores scale 0 (see SlotKVCache.quantize_tokens)
    elif FP8:
        q = tl.maximum(x.to(tl.float32) * inv_scale, -448.0, propagate_nan=tl.PropagateNan.ALL)
        q = tl.minimum(q, 448.0, propagate_nan=tl.PropagateNan.ALL).to(dtype)  # NaN stays NaN, as in torch
    else:
        q = x.to(dtype)
    return q, s


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, pos_ptr, stride_kb, stride_kh, stride_vb,
                     stride_vh, stride_cs, stride_ch, stride_cc, stride_ss, stride_sh, inv_scale, D,
                     FP8: tl.constexpr, TOKEN_SCALES: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, h): k[b, h, :D], v[b, h, :D] -> caches [slot b, head h, column pos[b], :D] (and with
    TOKEN_SCALES their scales -> ks, vs [slot b, head h, column pos[b]])."""
    b = tl.program_id(0).to(tl.int64)  # b * slot stride can pass 2^31 in a large cache
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    col = tl.load(pos_ptr + b)
    dst = b * stride_cs + h * stride_ch + col * stride_cc + d
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + d, mask=ok, other=0.0)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + d, mask=ok, other=0.0)
    kq, ks = _to_cache(k, inv_scale, FP8, TOKEN_SCALES, kc_ptr.dtype.element_ty)
    vq, vs = _to_cache(v, inv_scale, FP8, TOKEN_SCALES, vc_ptr.dtype.element_ty)
    tl.store(kc_ptr + dst, kq, mask=ok)
    tl.store(vc_ptr + dst, vq, mask=ok)
    if TOKEN_SCALES:
        tl.store(ks_ptr + b * stride_ss + h * stride_sh + col, ks)
        tl.store(vs_ptr + b * stride_ss + h * stride_sh + col, vs)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             positions: torch.Tensor, kv_scale: float = 1.0, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """k, v [B, Hkv, D] (last dim contiguous) -> k_cache[b, :, positions[b]] and v_cache[...] for b < B.

    k_cache, v_cache: [S >= B, Hkv, C, D] contiguous, same shape and dtype (the model dtype or float8_e4m3fn);
    positions: long [B], each < C. kv_scale: a single-scale FP8 cache's dequantisation scale (ignored
    otherwise). k_scales, v_scales: [S, Hkv, C] float32 contiguous for a token-scaled FP8 cache (both or none).
    """
    B, H, D = k.shape
    if (k.stride(-1) != 1 or v.stride(-1) != 1 or v.shape != k.shape or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or v_cache.shape != k_cache.shape or k_cache.shape[0] < B
            or k_cache.shape[1] != H or k_cache.shape[3] != D):
        raise ValueError(f"write_kv needs k, v [B, Hkv, D] of one shape with a contiguous last dimension and two "
                         f"contiguous caches [>= B, Hkv, C, D]; got k {tuple(k.shape)}, caches {tuple(k_cache.shape)}")
    token = k_scales is not None
    if token and any(t is None or t.dtype != torch.float32 or not t.is_contiguous() or t.shape != k_cache.shape[:3]
                     for t in (k_scales, v_scales)):
        raise ValueError("a token-scaled cache needs k_scales and v_scales [S, Hkv, C] float32, contiguous")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # float32(1 / float32(kv_scale)): what x / kv_scale multiplies by in PyTorch's CUDA kernels.
    inv = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(kv_scale, dtype=torch.float32))
    ks, vs = (k_scales, v_scales) if token else (k_cache, v_cache)  # unused pointers without token scales
    if B:
        _kv_write_kernel[(B, H)](k, v, k_cache, v_cache, ks, vs, positions, k.stride(0), k.stride(1), v.stride(0),
                                 v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                 ks.stride(0) if token else 0, ks.stride(1) if token else 0, inv, D,
                                 FP8=fp8, TOKEN_SCALES=token, BLOCK_D=triton.next_power_of_2(D), num_warps=1)
