"""silu(gate) * up with its backward, one Triton pass each, for the training forward of the SiLU-gated MLP.

PyTorch's `F.silu(gate) * up` runs two kernels forward (silu, then the product: five passes over [M, N]) and four
backward, and autograd keeps three [M, N] tensors (gate, silu(gate), up). Here the forward reads gate and up
and writes h, the backward reads gate, up and dh and writes dgate and dup, and the saved tensors are gate and up.
Each value is rounded where PyTorch rounds it (bf16/fp16 after silu, after the product; backward after dh * up,
dh * silu(gate) and the silu gradient), the arithmetic in float32 as PyTorch's opmath. The float32 exp and the
order of the silu gradient's products may differ from PyTorch's in the last float32 bit, which can round a value
one spacing apart and a product computed from it up to two: within two spacings of the dtype (tests/test_silu_mul.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements per program: a multiple of the 16-byte vector width for every dtype


@triton.jit
def _silu_mul_fwd_kernel(g_ptr, u_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g_raw = tl.load(g_ptr + offs, mask=mask, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(g_raw.dtype).to(tl.float32)  # silu, rounded as F.silu's output
    tl.store(h_ptr + offs, (s * u).to(g_raw.dtype), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(g_ptr, u_ptr, d_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g_raw = tl.load(g_ptr + offs, mask=mask, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-g)
    sig = 1.0 / (1.0 + e)
    s = (g / (1.0 + e)).to(g_raw.dtype).to(tl.float32)  # as the forward computes it
    tl.store(du_ptr + offs, (d * s).to(g_raw.dtype), mask=mask)  # d(h)/d(up) = silu(gate)
    ds = (d * u).to(g_raw.dtype).to(tl.float32)  # the product's gradient wrt silu(gate), rounded as torch's
    tl.store(dg_ptr + offs, (ds * (sig * (1.0 + g * (1.0 - sig)))).to(g_raw.dtype), mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


class SiluMul(torch.autograd.Function):
    """h = silu(gate) * up for contiguous gate, up of one shape and dtype (bf16/fp16/float32) on a CUDA device ->
    h of that shape and dtype; backward gives dgate, dup of the same shape."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        h = torch.empty_like(up)
        n = up.numel()
        if n:
            _silu_mul_fwd_kernel[_grid(n)](gate, up, h, n, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(gate, up)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        dh = dh.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = up.numel()
        if n:
            _silu_mul_bwd_kernel[_grid(n)](gate, up, dh, dgate, dup, n, BLOCK=BLOCK, num_warps=4)
        return dgate, dup


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up through `SiluMul`; gate and up [..., N], same shape, dtype and device, contiguous."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device or \
            not (gate.is_contiguous() and up.is_contiguous()):
        raise ValueError(f"silu_mul needs contiguous gate and up of one shape, dtype and device, got "
                         f"{tuple(gate.shape)} {gate.dtype} {gate.device} and {tuple(up.shape)} {up.dtype} {up.device}")
    return SiluMul.apply(gate, up)


def self_check(device: torch.device, dtype: torch.dtype) -> bool:
    """`silu_mul` against F.silu(gate) * up on a small probe on `device` in `dtype`: output and both gradients
    within two spacings of the dtype (see the module docstring)."""
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(0)
    gate, up, dh = ((torch.randn(3, 700, device=device, generator=gen) * 3).to(dtype) for _ in range(3))
    spacing = 2 * torch.finfo(dtype).eps  # the relative spacing of the dtype's values
    results = []
    for fn in (silu_mul, lambda g, u: F.silu(g) * u):
        g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
        h = fn(g, u)
        h.backward(dh)
        results.append((h.detach(), g.grad, u.grad))
    tiny = torch.finfo(dtype).smallest_normal
    return all(bool(((a.double() - b.double()).abs() <= 2 * spacing * b.double().abs() + 2 * tiny).all())
               for a, b in zip(*results))
