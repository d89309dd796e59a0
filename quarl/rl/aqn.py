"""AQN, adaptive quantization noise (QeRL; BRIEF §5).

At every sync, Gaussian noise N(0, σ²) is written into the float32 `rollout_noise` buffer of the RMSNorms in front
of q/k/v and gate/up. The decoder's RMSNorm adds that buffer to its weight, in float32 (a bf16 sum would round
σ <= 1e-3 away), only in rollout mode, so the training forward never sees it; because the norm weight scales the
input channels of the following projections, the noise acts as per-input-channel multiplicative noise on those
weights. σ follows a stage schedule: training is split into K equal stages, stage 0 has no noise, stages 1..K-1
decay exponentially from σ_start to σ_end.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from quarl.rl.uaq import UAQ_GROUPS, decoder_layers


def aqn_sigma(step: int, total_steps: int, sigma_start: float, sigma_end: float, stages: int) -> float:
    """σ for RL step `step` (0-based) of `total_steps`. Stage 0 -> 0; stages 1..K-1 decay geometrically."""
    if sigma_start <= 0 or stages < 2:
        return 0.0
    stage = min(stages - 1, step * stages // max(total_steps, 1))
    if stage == 0:
        return 0.0
    if stages == 2 or sigma_end <= 0:
        return sigma_start if stages == 2 or stage == 1 else 0.0
    return sigma_start * (sigma_end / sigma_start) ** ((stage - 1) / (stages - 2))


def noised_norms(model: nn.Module) -> list[nn.Module]:
    """The RMSNorm modules AQN perturbs (input_layernorm and post_attention_layernorm of every layer)."""
    norms = []
    for layer in decoder_layers(model):
        for norm_name, _ in UAQ_GROUPS:
            norm = layer.get_submodule(norm_name)
            if not hasattr(norm, "rollout_noise"):
                # The pitfall QeRL hit: a norm class without the rollout hook silently gets no noise.
                raise TypeError(f"{norm_name} ({type(norm).__name__}) has no rollout_noise buffer; AQN cannot act")
            norms.append(norm)
    return norms


@torch.no_grad()
def set_aqn_noise(model: nn.Module, sigma: float, generator: torch.Generator | None = None) -> int:
    """Draw fresh N(0, σ²) noise into every targeted norm's rollout_noise (float32 [dim], the norm weight's shape;
    σ = 0 clears it). Returns #norms.

    The noise is drawn in float32 (on the CPU, from `generator`, one draw for all the norms in their order) and
    written in place into the float32 buffers, which the norms add to their weight in float32: a buffer of another
    dtype is refused, since rounding the noise (or w + noise) to bf16 erases σ <= 1e-3 next to weights near 1 (one
    bf16 ulp at 1.0 is 2^-7). The draw crosses to each device in one copy rather than one blocking copy per norm
    (a 135M model has 60 noised norms)."""
    norms = noised_norms(model)
    for norm in norms:
        buf = norm.rollout_noise
        if buf.dtype != torch.float32:
            raise TypeError(f"AQN noise must be float32, {type(norm).__name__}.rollout_noise is {buf.dtype}")
    buffers = [norm.rollout_noise for norm in norms]
    for norm in norms:
        norm.aqn_enabled = True  # the rollout forward adds the noise from now on (also when it is zero)
    if sigma <= 0:
        torch._foreach_zero_(buffers)
        return len(norms)
    noise = torch.randn(sum(b.numel() for b in buffers), generator=generator, dtype=torch.float32).mul_(sigma)
    on_device = {device: noise.to(device) for device in {b.device for b in buffers}}  # one copy per device
    parts, start = [], 0
    for b in buffers:
        parts.append(on_device[b.device][start:start + b.numel()].view(b.shape))
        start += b.numel()
    torch._foreach_copy_(buffers, parts)
    return len(norms)
