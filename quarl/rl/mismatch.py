"""Rollout/training mismatch metrics (BRIEF §6) and a numerically stable entropy.

These are the numbers users watch to see whether a low-precision rollout is drifting away from the training
policy (QuRL saw KL(μ‖π_prox) grow from 0.002 to 0.025 before collapse), so the metric names are part of the
interface.
"""

from __future__ import annotations

import torch
from torch import Tensor

MISMATCH_KEYS = ("mismatch/kl", "mismatch/k3_kl", "mismatch/max_abs_logp_diff", "mismatch/prob_diff_mean")


def mismatch_metrics(behaviour_logprobs: Tensor, proximal_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Mismatch between the behaviour policy μ and the proximal policy π_prox over the counted tokens.

    With d_t = log μ_t − log π_prox,t over the tokens where `mask` is set:
    "mismatch/kl" = mean(d) (k1 estimate of KL(μ‖π_prox), the tokens being sampled from μ);
    "mismatch/k3_kl" = mean(exp(−d) + d − 1) (k3: non-negative, lower variance);
    "mismatch/max_abs_logp_diff" = max |d|; "mismatch/prob_diff_mean" = mean |μ_t − π_prox,t|.

    Args:
        behaviour_logprobs: [B, T] float, log μ of the sampled tokens.
        proximal_logprobs: [B, T] float, log π_prox of the same tokens.
        mask: [B, T] bool or 0/1 float, 1 = an answer token that counts.
    Returns:
        dict of python floats with exactly the keys above; all 0.0 when no token counts.
    The reduction runs in float64: k3 of a small d is ≈ d²/2 and loses all its digits in float32 for
    d ≲ 1e-3, which is exactly the regime of a healthy INT8/FP8 rollout.
    """
    if behaviour_logprobs.shape != proximal_logprobs.shape or behaviour_logprobs.shape != mask.shape:
        raise ValueError("behaviour_logprobs, proximal_logprobs and mask must share one shape; got "
                         f"{tuple(behaviour_logprobs.shape)}, {tuple(proximal_logprobs.shape)}, {tuple(mask.shape)}")
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    if not bool(m.any()):
        return {k: 0.0 for k in MISMATCH_KEYS}
    with torch.no_grad():
        log_mu = behaviour_logprobs.detach()[m].double()
        log_prox = proximal_logprobs.detach()[m].double()
        d = log_mu - log_prox
        k3 = torch.expm1(-d) + d  # exp(−d) − 1 + d, without the cancellation of exp(−d) − 1 near d = 0
        return {
            "mismatch/kl": float(d.mean()),
            "mismatch/k3_kl": float(k3.mean()),
            "mismatch/max_abs_logp_diff": float(d.abs().max()),
            "mismatch/prob_diff_mean": float((log_mu.exp() - log_prox.exp()).abs().mean()),
        }


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H = −Σ_v p_v log p_v of softmax(logits) over the last dimension.

    Args:
        logits: [..., V] float (any float dtype; bf16/fp16 are computed in float32). Entries of −inf (tokens
            removed by top-k / top-p) are allowed and contribute 0; a row must keep at least one finite entry.
    Returns:
        [...] float32 (float64 for float64 input), differentiable.
    Uses log_softmax (max-shifted, so large logits cannot overflow) and defines p·log p = 0 where p = 0, so
    −inf logits never form 0·(−inf) = NaN, in the value or in the gradient.
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V > 0; got shape {tuple(logits.shape)}")
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_p = torch.log_softmax(x, dim=-1)
    p = log_p.exp()
    # p·log p := 0 where p = 0 (its limit). log p is replaced *before* the product: a `where` after it would
    # still send 0·(−inf) = NaN into the gradient of p.
    safe_log_p = torch.where(p > 0, log_p, torch.zeros((), dtype=x.dtype, device=x.device))
    return -(p * safe_log_p).sum(dim=-1)
