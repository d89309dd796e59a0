"""Decode attention for the fast engine: one new query token per slot against that slot's cached keys/values.

`decode_attention_torch` is the plain-PyTorch definition (any device, any float dtype, CUDA-graph safe: static
shapes, no host synchronisation). `make_decode_attention` returns the function the engine uses: the Triton
kernel (`quarl.kernels.decode_attention`, reads only the filled columns) where it runs and agrees with the torch
definition on a self-check, the torch definition otherwise.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0

# fn(q [B, Hq, D], k_cache [S, Hkv, C, D], v_cache, lengths long [B], kv_len: int, k_scales=None, v_scales=None)
# -> [B, Hq, D]; k_scales / v_scales [S, Hkv, C] float32 for a token-scaled FP8 cache.
AttentionFn = Callable[..., torch.Tensor]


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                           kv_len: int, kv_scale: float = 1.0, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over the first lengths[b] columns of slot b.

    Args:
        q: [B, Hq, D] float; query head h uses kv head h // (Hq / Hkv) (grouped-query attention, as SDPA's
            enable_gqa and Hugging Face's repeat_kv).
        k_cache, v_cache: [S >= B, Hkv, C, D], q's dtype or FP8 E4M3: read as stored * kv_scale, or with
            per-token scales as float32(stored * scale) rounded to q's dtype.
        lengths: long [B], 1 <= lengths[b] <= kv_len.
        kv_len: static number of columns read (<= C); columns >= lengths[b] are masked out.
        k_scales, v_scales: [S, Hkv, C] float32 per-token scales of a token-scaled FP8 cache, or None.
    Returns:
        [B, Hq, D] in q's dtype. Scores and softmax in float32 (float64 for float64 q).
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    k = k_cache[:B, :, :kv_len]
    v = v_cache[:B, :, :kv_len]
    if k_scales is not None:
        k = (k.float() * k_scales[:B, :, :kv_len, None]).to(q.dtype)
        v = (v.float() * v_scales[:B, :, :kv_len, None]).to(q.dtype)
    elif k.dtype != q.dtype:
        k = k.to(q.dtype) * kv_scale if kv_scale != 1.0 else k.to(q.dtype)
        v = v.to(q.dtype) * kv_scale if kv_scale != 1.0 else v.to(q.dtype)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.view(B, Hkv, G, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)).to(acc_dtype) * (1.0 / math.sqrt(D))  # [B, Hkv, G, kv_len]
    cols = torch.arange(kv_len, device=q.device)
    scores = scores.masked_fill((cols[None, :] >= lengths[:, None])[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(B, Hq, D)


def invariant_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                               kv_len: int, *scales) -> torch.Tensor:
    """The `AttentionFn` of a batch-invariant model: q [B, Hq, D], slot b's query at column lengths[b] - 1, over
    its columns 0 .. lengths[b] - 1 of k_cache, v_cache [S >= B, Hkv, C, D] (q's dtype; no scales), lengths long
    [B] -> [B, Hq, D] in q's dtype, by `quarl.kernels.batch_invariant.attention` (the training forward's kernel;
    kv_len unused: the kernel reads each row's own length)."""
    from quarl.kernels import batch_invariant

    return batch_invariant.attention(q[:, :, None], k_cache, v_cache, torch.zeros_like(lengths), lengths - 1,
                                     lengths)[:, :, 0]


def _triton_attention(kv_scale: float, num_sms: int) -> AttentionFn:
    from quarl.kernels.decode_attention import choose_num_splits, decode_attention

    def attention(q, k_cache, v_cache, lengths, kv_len, k_scales=None, v_scales=None):
        splits = choose_num_splits(q.shape[0], k_cache.shape[1], kv_len, num_sms=num_sms)
        if k_scales is not None:
            k_scales, v_scales = k_scales[:, :, :kv_len], v_scales[:, :, :kv_len]
        return decode_attention(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], lengths, splits, kv_scale,
                                k_scales=k_scales, v_scales=v_scales)

    return attention


def _torch_attention(kv_scale: float) -> AttentionFn:
    def attention(q, k_cache, v_cache, lengths, kv_len, k_scales=None, v_scales=None):
        return decode_attention_torch(q, k_cache, v_cache, lengths, kv_len, kv_scale, k_scales, v_scales)

    return attention


def make_decode_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                          head_dim: int, kv_dtype: torch.dtype, kv_scale: float = 1.0,
                          backend: str = "auto", token_scales: bool = False) -> tuple[AttentionFn, str]:
    """The decode attention function for the engine and its name ("triton", "torch" or "invariant").

    backend "auto": Triton on a CUDA device with the kernels available, after a self-check against the torch
    definition on random data (a failure warns and falls back to torch); "triton" / "torch" force one;
    "invariant": the batch-invariant attention a batch-invariant model's training forward takes
    (`invariant_decode_attention`).
    """
    if backend not in ("auto", "triton", "torch", "invariant"):
        raise ValueError(f"attention backend must be 'auto', 'triton', 'torch' or 'invariant', got {backend!r}")
    if backend == "invariant":  # the engine has checked the cache's dtype and the model (`set_batch_invariant`)
        return invariant_decode_attention, "invariant"
    torch_fn = _torch_attention(kv_scale)
    if backend == "torch":
        return torch_fn, "torch"
    from quarl.kernels import fp8_kernels_available, kernel_passes_check, kernels_available

    available = fp8_kernels_available if kv_dtype == FP8_KV_DTYPE else kernels_available
    usable = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and available(device)
    if not usable:
        if backend == "triton":
            raise ValueError("the Triton decode attention needs a CUDA device (compute capability >= 8.0, >= 8.9 "
                             "for an FP8 cache), Triton and a bf16/fp16 model; use attention_backend='torch'")
        return torch_fn, "torch"
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    fn = _triton_attention(kv_scale, num_sms)
    if backend == "triton":
        return fn, "triton"
    if not kernel_passes_check("Triton decode attention", lambda: _self_check(
            fn, torch_fn, device, dtype, num_heads, num_kv_heads, head_dim, kv_dtype, token_scales) < 2e-2):
        return torch_fn, "torch"
    return fn, "triton"


@torch.no_grad()
def _self_check(fn, ref_fn, device, dtype, hq, hkv, d, kv_dtype, token_scales: bool = False) -> float:
    """Relative error of fn vs ref_fn on random inputs with ragged lengths (one sequence of length 1)."""
    gen = torch.Generator(device=device).manual_seed(1234)
    B, C = 5, 300
    q = torch.randn(B, hq, d, device=device, generator=gen).to(dtype)
    k = torch.randn(B + 2, hkv, C, d, device=device, generator=gen).to(kv_dtype)
    v = torch.randn(B + 2, hkv, C, d, device=device, generator=gen).to(kv_dtype)
    scales = ()
    if token_scales:  # scales over a few orders of magnitude, as keys/values of different sizes give; key
        # scales stay below ~10 so that scores are O(10): larger ones would measure fp16's rounding of q * scale
        scales = tuple(torch.exp(torch.randn(B + 2, hkv, C, device=device, generator=gen) * w) * c
                       for w, c in ((0.7, 0.3), (2.0, 1.0)))
    lengths = torch.tensor([1, 17, 64, 200, C], device=device)
    out = fn(q, k, v, lengths, C, *scales).float()
    ref = ref_fn(q.double(), k, v, lengths, C, *scales).float()  # the cache is widened to float64 inside
    torch.cuda.synchronize(device)
    return float((out - ref).norm() / ref.norm())
