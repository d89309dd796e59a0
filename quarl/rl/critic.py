"""A value head and the clipped value loss for PPO with a critic (GAE advantages: quarl.rl.advantages).

The critic reads the policy backbone's last hidden states (or a separate model's) and maps each position to a
scalar V(s_t). The value loss is PPO's clipped form (as in verl and OpenAI baselines): with V_old the critic's
values when the batch was collected and ε the value clip range,
    V_clip = V_old + clamp(V − V_old, −ε, ε),   L_V = ½ · max((V − G)², (V_clip − G)²)
averaged over the counted tokens, so one update cannot move a value prediction far from where it was.
The trainer does not use the critic yet: it trains GRPO-family objectives whose advantages need no values.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ValueHead(nn.Module):
    """Linear(hidden_size → 1) on hidden states [B, T, H] → values [B, T] (float32 compute for low-precision
    inputs). Initialised at zero so a fresh critic predicts 0 and its first advantages are the returns."""

    def __init__(self, hidden_size: int):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size!r} must be a positive int (the backbone's hidden size)")
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        if hidden.dim() != 3 or hidden.shape[-1] != self.proj.in_features:
            raise ValueError(f"hidden must be [B, T, {self.proj.in_features}]; got {tuple(hidden.shape)}")
        x = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        w, b = self.proj.weight.to(x.dtype), self.proj.bias.to(x.dtype)  # cast a copy, the module keeps its dtype
        return nn.functional.linear(x, w, b).squeeze(-1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float | None = 0.2) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss.

    Args:
        values: [B, T] float, V of the current critic, with grad.
        old_values: [B, T] float, V when the batch was collected (no grad).
        returns: [B, T] float, targets G (e.g. from `gae_advantages`).
        mask: [B, T] bool or 0/1 float, 1 = a counted token.
        clip_range: ε > 0, or None for the unclipped ½(V − G)².
    Returns:
        (loss: 0-dim, mean over counted tokens (0 when none count); metrics "critic/clip_frac" (share of tokens
        where the clipped error is the larger) and "critic/value_mean").
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError("values, old_values, returns and mask must share one [B, T] shape")
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range={clip_range} must be > 0, or None for no value clipping")
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    dtype = torch.promote_types(values.dtype, torch.float32)
    v, old, g = values.to(dtype), old_values.detach().to(dtype), returns.detach().to(dtype)
    err = (v - g) ** 2
    clipped = torch.zeros_like(m)
    if clip_range is not None:
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        err_clip = (v_clip - g) ** 2
        clipped = err_clip > err
        err = torch.maximum(err, err_clip)
    zero = torch.zeros((), dtype=dtype, device=v.device)
    n = m.sum().clamp(min=1)
    loss = 0.5 * torch.where(m, err, zero).sum() / n
    metrics = {"critic/clip_frac": float((clipped & m).sum() / n),
               "critic/value_mean": float(torch.where(m, v.detach(), zero).sum() / n)}
    return loss, metrics
