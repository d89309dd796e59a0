"""Decode-step KV-cache write in one launch: the new token's keys and values of every slot, FP8-rounded if the
cache is FP8, stored at each slot's column.

The torch write (`quarl.rollout.fast_cache.SlotKVCache.to_storage` + an index_put per tensor) takes four to five
kernels for keys and as many for values per layer; this is one. Values are bit for bit the torch ones: FP8
codes = e4m3(clamp(x * float32(1 / kv_scale), +-448)), round to nearest even (PyTorch's CUDA division by a
scalar is that multiplication), other cache dtypes a plain cast.

Imports Triton: load it only when `quarl.kernels.kernels_available()` says the kernels can run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, stride_kb, stride_kh, stride_vb, stride_vh,
                     stride_cs, stride_ch, stride_cc, inv_scale, D, FP8: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, h): k[b, h, :D], v[b, h, :D] -> caches [slot b, head h, column pos[b], :D]."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    col = tl.load(pos_ptr + b)
    dst = b * stride_cs + h * stride_ch + col * stride_cc + d
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + d, mask=ok)
    if FP8:
        k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_scale, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_scale, -448.0), 448.0)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             positions: torch.Tensor, kv_scale: float = 1.0) -> None:
    """k, v [B, Hkv, D] (last dim contiguous) -> k_cache[b, :, positions[b]] and v_cache[...] for b < B.

    k_cache, v_cache: [S >= B, Hkv, C, D] contiguous, same shape and dtype (the model dtype or float8_e4m3fn);
    positions: long [B], each < C. kv_scale: the FP8 cache's dequantisation scale (ignored for other dtypes).
    """
    B, H, D = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not k_cache.is_contiguous() or v.shape != k.shape:
        raise ValueError("write_kv needs k, v [B, Hkv, D] of one shape with a contiguous last dimension and "
                         "contiguous caches")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # float32(1 / float32(kv_scale)): what x / kv_scale multiplies by in PyTorch's CUDA kernels.
    inv = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(kv_scale, dtype=torch.float32))
    if B:
        _kv_write_kernel[(B, H)](k, v, k_cache, v_cache, positions, k.stride(0), k.stride(1), v.stride(0),
                                 v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), inv, D,
                                 FP8=fp8, BLOCK_D=triton.next_power_of_2(D), num_warps=1)
