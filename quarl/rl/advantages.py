"""Group-relative advantages (GRPO / Dr.GRPO) and DAPO's dynamic sampling and soft overlong punishment.

Rewards are laid out group by group: [B*G] with the G answers of prompt b at positions b*G .. b*G+G-1.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_SCALES = ("std", "none")
_STD_EPS = 1e-6


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (answers sampled per prompt)")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B*G]; got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}; "
                         "pass all G answers of every prompt, grouped contiguously")
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, scale: str = "std") -> Tensor:
    """Group-relative advantages.

    scale="std" (GRPO): A_i = (r_i − mean_g(r)) / (std_g(r) + 1e-6) with the *unbiased* (Bessel, divide by G−1)
    standard deviation — what TRL's GRPOTrainer (`rewards.view(-1, G).std(dim=1)`) and verl's GRPO estimator
    (`torch.std`) use. A group of one answer has no spread and gets advantage 0.
    scale="none" (Dr.GRPO): A_i = r_i − mean_g(r).

    Args:
        rewards: [B*G] float (or int/bool), grouped contiguously.
        group_size: G.
        scale: "std" | "none".
    Returns:
        [B*G] float32 (float64 for float64 input). A group whose rewards are all equal gets all-zero advantages.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale={scale!r} is unknown; choose 'std' (GRPO) or 'none' (Dr.GRPO)")
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "std":
        if group_size == 1:
            return torch.zeros_like(centred).view(-1)  # unbiased std of one sample is undefined; A = 0 anyway
        centred = centred / (grouped.std(dim=1, unbiased=True, keepdim=True) + _STD_EPS)
    return centred.reshape(-1)


def dynamic_sampling_keep(rewards: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: which groups carry a learning signal.

    Args:
        rewards: [B*G] float, grouped contiguously.
        group_size: G.
    Returns:
        [B] bool, True for groups whose rewards are not all equal (exact comparison: all-equal groups have
        zero advantage and contribute no policy gradient).
    """
    grouped = _grouped(rewards, group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO soft overlong punishment, added to the reward.

    0 for len ≤ max_new_tokens − buffer, then linear: ((max_new_tokens − buffer) − len) / buffer · penalty,
    reaching −penalty at len = max_new_tokens; lengths beyond max_new_tokens stay at −penalty (DAPO's −1 case).

    Args:
        lengths: [N] int or float, answer lengths in tokens.
        max_new_tokens: L_max, the rollout's generation limit.
        buffer: L_cache ≥ 1, the width of the penalty ramp (≤ max_new_tokens).
        penalty: the penalty at (and beyond) L_max, ≥ 0 (DAPO: 1.0).
    Returns:
        [N] float32, values in [−penalty, 0].
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"buffer={buffer!r} must be an int in [1, max_new_tokens={max_new_tokens}] "
                         "(to disable the soft penalty, skip this call)")
    if not penalty >= 0:
        raise ValueError(f"penalty={penalty!r} must be >= 0 (it is subtracted from the reward)")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [N]; got shape {tuple(lengths.shape)}")
    start = max_new_tokens - buffer
    excess = (lengths.to(torch.float32) - start).clamp(min=0.0, max=float(buffer))
    return -excess / buffer * float(penalty)


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95,
                   whiten: bool = True) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al.) over each answer's counted tokens, for PPO with a critic.

    Over the counted tokens k = 1..n of an answer (positions where `mask` is set, in order):
    δ_k = r_k + γ·V_{k+1} − V_k (V_{n+1} = 0: the answer ends), A_k = Σ_{l≥0} (γλ)^l δ_{k+l}, returns G_k = A_k + V_k.
    Masked positions are skipped (the recursion carries across them), so padding and answers of any length in
    one [B, T] layout are handled alike; they get advantage and return 0.

    Args:
        rewards: [B, T] float, per-token rewards (an outcome reward sits on the answer's last token; a KL
            penalty, if any, on every token).
        values: [B, T] float, V(s_t) of the critic, no grad needed (detached here).
        mask: [B, T] bool or 0/1 float, 1 = a counted answer token.
        gamma, lam: discount γ and GAE λ, each in [0, 1] (LLM RL uses γ = 1; verl's default λ = 0.95).
        whiten: normalise the advantages to mean 0 / std 1 over the counted tokens (the returns are not).
    Returns:
        (advantages [B, T], returns [B, T]) in float32, or float64 for float64 inputs; 0 outside the mask.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(f"rewards, values and mask must share one [B, T] shape; got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}={v} must lie in [0, 1] (LLM RL: gamma 1.0, lam 0.95)")
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    r, v = rewards.detach().to(dtype), values.detach().to(dtype)
    m = (mask.bool() if mask.dtype == torch.bool else mask != 0)
    mf = m.to(dtype)
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])
    last = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        # at a masked position nothing changes: the recursion continues with the next counted token
        last = mf[:, t] * (delta + gamma * lam * last) + (1 - mf[:, t]) * last
        next_v = mf[:, t] * v[:, t] + (1 - mf[:, t]) * next_v
        adv[:, t] = last
    adv = torch.where(m, adv, torch.zeros_like(adv))
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    if whiten and bool(m.any()):
        sel = adv[m]
        std = sel.std(unbiased=False) if sel.numel() > 1 else torch.ones((), dtype=dtype)
        adv = torch.where(m, (adv - sel.mean()) / (std + _STD_EPS), torch.zeros_like(adv))
    return adv, returns


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Outcome rewards laid out per token for GAE: each answer's reward on its last counted token, 0 elsewhere.

    Args:
        rewards: [B] float, one reward per answer.
        mask: [B, T] bool or 0/1 float, 1 = a counted answer token.
    Returns:
        [B, T] float32 (float64 for float64 rewards); an answer with no counted token receives no reward.
    """
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards must be [B] and mask [B, T] with the same B; got {tuple(rewards.shape)} and "
                         f"{tuple(mask.shape)}")
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    # the last counted token: counted, and no counted token after it
    last = m & (m.long().cumsum(1) == m.long().sum(1, keepdim=True))
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    return torch.where(last, r.unsqueeze(1).expand_as(last), torch.zeros((), dtype=r.dtype))
