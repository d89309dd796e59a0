"""Log-probability of each row's target token (and the row's entropy) straight from bf16/fp16 logits, with its
backward, one Triton pass each: the training loss's log-softmax without a float32 copy of the logits.

The PyTorch path (`quarl.rl.batch.answer_logprobs`) turns [rows, vocab] logits into float32, divides by the
temperature, takes logsumexp and gathers the targets: several passes over a float32 tensor twice the logits' size,
which autograd keeps. Here the forward reads the logits once per row (an online logsumexp in float32, Milakov &
Gimelshein 2018) and keeps only the row's logsumexp; the backward reads them again and writes
dlogits = g * (onehot(target) - softmax) / temperature in the logits' dtype.

Per row i with z = logits[i] / temperature (float32): lse = log sum exp z, logprob = z[target] - lse,
entropy = lse - sum softmax(z) * z. Values agree with the float32 PyTorch path up to float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary entries per loop step of one row


@triton.jit
def _logprob_fwd_kernel(logits_ptr, target_ptr, lp_ptr, lse_ptr, ent_ptr, V, stride_row, inv_t,
                        BLOCK: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    # Running max m, sum exp(z - m) and sum exp(z - m) z over the blocks so far: rescaled once per block, so
    # each logit costs one exp.
    m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    w = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    for start in range(0, V, BLOCK):
        z = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        finite = m_new > float("-inf")  # else every logit so far is -inf: nothing to add (and no exp(nan))
        scale = tl.where(finite, tl.exp(m - m_new), 0.0)
        e = tl.where(finite, tl.exp(z - m_new), 0.0)
        s = s * scale + tl.sum(e, axis=0)
        if WITH_ENTROPY:
            w = w * scale + tl.sum(tl.where(e > 0, e * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(target_ptr + row)
    tl.device_assert((target >= 0) & (target < V), "token_logprobs: a target id is outside the vocabulary")
    z_t = tl.load(base + target).to(tl.float32) * inv_t
    tl.store(lp_ptr + row, z_t - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        # lse - E[z] >= 0 exactly; float32 round-off can take a one-hot row a hair below zero
        tl.store(ent_ptr + row, tl.maximum(lse - w / s, 0.0))


@triton.jit
def _logprob_bwd_kernel(logits_ptr, target_ptr, lse_ptr, g_ptr, grad_ptr, V, stride_row, stride_grad, inv_t,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    out = grad_ptr + row * stride_grad
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row).to(tl.float32)
    target = tl.load(target_ptr + row)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        x = tl.load(base + idx, mask=mask, other=0.0)
        p = tl.exp(x.to(tl.float32) * inv_t - lse)
        d = g * inv_t * (tl.where(idx == target, 1.0, 0.0) - p)
        tl.store(out + idx, d.to(x.dtype), mask=mask)


class TokenLogprobs(torch.autograd.Function):
    """(logprobs [N] float32, entropy [N] float32 or None) for logits [N, V] (bf16/fp16/float32, rows with unit
    column stride) on a CUDA device, targets long [N], temperature > 0; the gradient flows to the logits only
    (entropy is detached, as the trainer uses it)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
        n, v = logits.shape
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if with_entropy else None
        if n:
            _logprob_fwd_kernel[(n,)](logits, targets, lp, lse, lse if ent is None else ent, v, logits.stride(0),
                                      1.0 / temperature, BLOCK=BLOCK, WITH_ENTROPY=with_entropy, num_warps=8)
        ctx.save_for_backward(logits, targets, lse)
        ctx.inv_t = 1.0 / temperature
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor, _g_ent):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n, v = logits.shape
        if n:
            _logprob_bwd_kernel[(n,)](logits, targets, lse, g_lp.contiguous(), grad, v, logits.stride(0),
                                      grad.stride(0), ctx.inv_t, BLOCK=BLOCK, num_warps=8)
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V], targets long [...] (values in [0, V)) -> (logprobs [...] float32, entropy [...] float32
    or None) under softmax(logits / temperature), through `TokenLogprobs`."""
    if temperature <= 0:
        raise ValueError(f"token_logprobs needs temperature > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape or logits.stride(-1) != 1:
        raise ValueError(f"token_logprobs needs logits [..., V] with unit column stride and targets [...] of the "
                         f"leading shape; got logits {tuple(logits.shape)} strides {logits.stride()}, targets "
                         f"{tuple(targets.shape)}")
    lead = targets.shape
    lp, ent = TokenLogprobs.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).contiguous(),
                                  float(temperature), with_entropy)
    return lp.reshape(lead), (None if ent is None else ent.reshape(lead))


def self_check(device: torch.device, dtype: torch.dtype) -> bool:
    """`token_logprobs` against the float32 log-softmax on a small probe on `device` in `dtype`: log-probs and
    entropy within 1e-4 (absolute, log-sum-exps of O(10)), the logits' gradient within two spacings of the dtype
    plus 1e-6."""
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(3, 3000, device=device, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 3000, (3,), device=device, generator=gen)
    g = torch.randn(3, device=device, generator=gen)
    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs(x, targets, 0.8, with_entropy=True)
    lp.backward(g)
    xr = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(xr.float() / 0.8, dim=-1)
    lp_ref = logp.gather(-1, targets[:, None]).squeeze(-1)
    lp_ref.backward(g)
    ent_ref = -(logp.exp() * logp).sum(-1).detach()
    spacing = 2 * torch.finfo(dtype).eps
    grad_ok = bool(((x.grad.float() - xr.grad.float()).abs() <= 2 * spacing * xr.grad.float().abs() + 1e-6).all())
    return grad_ok and bool(((lp - lp_ref).abs() <= 1e-4).all()) and bool(((ent - ent_ref).abs() <= 1e-4).all())
