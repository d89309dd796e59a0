"""Rotary embedding with its backward, one Triton pass each, for the training forward of attention.

`quarl.model.layers.apply_rope` is x * cos + rotate_half(x) * sin: in PyTorch five kernels forward (two
products, a negation, a concatenation, a sum), more backward, each a pass over q or k. Here one pass reads x (or
its gradient) and cos/sin and writes the result, for x in the projection's own layout [B, T, H, D] (before the
transpose to [B, H, T, D] that attention takes). Values are rounded where PyTorch rounds them (each product, then
the sum), so in bf16/fp16 the result is PyTorch's bit for bit. The launch turns off floating-point contraction:
otherwise the compiler fuses each rounded product and the sum into one bf16/fp16 fma, which rounds once.

With half = D / 2, x = (x1, x2) and cos = (c1, c2), sin = (s1, s2) split at half:
    forward:   out1 = x1 c1 - x2 s1,        out2 = x2 c2 + x1 s2
    backward:  dx1 = g1 c1 + g2 s2,         dx2 = g2 c2 - g1 s1
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, T, H, stride_xb, stride_xt, stride_cb, stride_ct,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr):
    """One program per (token, block of heads): x [B, T, H, 2*HALF] with contiguous heads, cos/sin rows of 2*HALF
    at (b * stride_cb + t * stride_ct)."""
    row = tl.program_id(0)
    b, t = row // T, row % T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, HALF)[None, :]  # [1, HALF]
    mask = h < H
    x_row = x_ptr + b.to(tl.int64) * stride_xb + t.to(tl.int64) * stride_xt + h * (2 * HALF)
    x1_raw = tl.load(x_row + d, mask=mask, other=0.0)
    dtype = x1_raw.dtype
    x1 = x1_raw.to(tl.float32)
    x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0).to(tl.float32)
    c_row = b.to(tl.int64) * stride_cb + t.to(tl.int64) * stride_ct
    c1 = tl.load(cos_ptr + c_row + d).to(tl.float32)
    c2 = tl.load(cos_ptr + c_row + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + c_row + d).to(tl.float32)
    s2 = tl.load(sin_ptr + c_row + HALF + d).to(tl.float32)
    # Each product rounded to the dtype (PyTorch's elementwise ops in bf16/fp16), then the sum rounded.
    if BACKWARD:
        o1 = (x1 * c1).to(dtype).to(tl.float32) + (x2 * s2).to(dtype).to(tl.float32)
        o2 = (x2 * c2).to(dtype).to(tl.float32) - (x1 * s1).to(dtype).to(tl.float32)
    else:
        o1 = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)
        o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    out_row = out_ptr + (b.to(tl.int64) * T + t) * H * (2 * HALF) + h * (2 * HALF)
    tl.store(out_row + d, o1.to(dtype), mask=mask)
    tl.store(out_row + HALF + d, o2.to(dtype), mask=mask)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [B, T, H, D] (heads contiguous: stride(3) == 1, stride(2) == D), cos/sin [B or 1, T, D] -> a new
    contiguous [B, T, H, D] in x.dtype."""
    B, T, H, D = x.shape
    out = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)
    block_h = min(triton.next_power_of_2(H), max(1, 4096 // D))
    grid = (B * T, triton.cdiv(H, block_h))
    _rope_kernel[grid](x, cos, sin, out, T, H, x.stride(0), x.stride(1), cos.stride(0), cos.stride(1),
                       HALF=D // 2, BLOCK_H=block_h, BACKWARD=backward, num_warps=4,
                       # Without this, ptxas turns "round the product, then add" into one bf16 fma (one rounding
                       # instead of PyTorch's two): results then differ from PyTorch by an ulp.
                       enable_fp_fusion=False)
    return out


class Rope(torch.autograd.Function):
    """rotated x for x [B, T, H, D] (bf16/fp16/float32 on a CUDA device, heads contiguous) and cos/sin
    [B or 1, T, D] in x.dtype with equal strides (no gradient) -> [B, T, H, D] contiguous; the gradient flows
    to x only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rope(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rope(g.contiguous(), cos, sin, backward=True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`Rope` on x [B, T, H, D] with cos/sin [B or 1, T, D] (or [B or 1, 1, T, D], the layout
    `RotaryEmbedding` returns)."""
    if cos.dim() == 4:
        cos, sin = cos[:, 0], sin[:, 0]
    B, T, H, D = x.shape
    if D % 2 or D & (D - 1) or cos.shape[-2:] != (T, D) or cos.shape[0] not in (1, B) or sin.shape != cos.shape \
            or cos.dtype != x.dtype or sin.dtype != x.dtype or cos.stride() != sin.stride() \
            or cos.stride(-1) != 1 or x.stride(3) != 1 or x.stride(2) != D:
        raise ValueError(f"rope needs x [B, T, H, D] with contiguous heads and D a power of two, and cos/sin "
                         f"[B or 1, T, D] of x's dtype with equal strides; got x {tuple(x.shape)} {x.dtype} "
                         f"strides {x.stride()}, cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)}")
    return Rope.apply(x, cos, sin)


def self_check(device: torch.device, dtype: torch.dtype) -> bool:
    """`rope` against `quarl.model.layers.apply_rope` on a small probe on `device` in `dtype` (bf16/fp16: equal
    bit for bit, forward and backward; float32 within 2^-20)."""
    from quarl.model.layers import apply_rope

    gen = torch.Generator(device=device).manual_seed(0)
    x, g = ((torch.randn(2, 5, 3, 64, device=device, generator=gen) * 3).to(dtype) for _ in range(2))
    cos, sin = ((torch.rand(2, 1, 5, 64, device=device, generator=gen) * 2 - 1).to(dtype) for _ in range(2))
    results = []
    for fn in (lambda t: rope(t, cos, sin), lambda t: apply_rope(t.transpose(1, 2), cos, sin).transpose(1, 2)):
        t = x.clone().requires_grad_(True)
        y = fn(t)
        y.backward(g)
        results.append((y.detach(), t.grad))
    if dtype == torch.float32:
        return all(torch.allclose(a, b, rtol=2**-20, atol=1e-6) for a, b in zip(*results))
    return all(torch.equal(a, b) for a, b in zip(*results))
