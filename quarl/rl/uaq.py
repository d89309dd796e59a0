"""UAQ, update-aware quantization (QuRL; BRIEF §5).

Once before training, for every decoder layer: divide the q/k/v and gate/up master weights by a scalar s and
multiply the RMSNorm weight in front of them (input_layernorm, post_attention_layernorm) by s. The network computes
the same function (norm(x)·s · (W/s)^T = norm(x) · W^T; biases are untouched), but the weights are s times smaller,
so an optimizer update is s times larger relative to the quantization step. o_proj and down_proj are never touched:
no norm sits in front of them to absorb the factor. In a MoE layer the norm feeds the router and every expert's
gate/up, so all of them are divided (the router's logits, and hence its choices, are unchanged).
"""

from __future__ import annotations

import torch
import torch.nn as nn

# (norm in front, projections it feeds) in Hugging Face naming, which the decoder uses.
UAQ_GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a quarl (or Hugging Face) causal LM: `model.model.layers`."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError("expected a causal LM with decoder blocks at model.model.layers (Llama/Qwen layout)")
    return list(layers)


@torch.no_grad()
def apply_uaq(model: nn.Module, scale: float) -> int:
    """Fold `scale` into every decoder layer in place; returns the number of projections rescaled.

    Must run before `refresh_rollout_weights` so that the rollout copy is quantized from the rescaled weights.
    A frozen (LoRA / qlora) base is refused: the adapters would see a rescaled input and the base cannot change.
    """
    if scale <= 0:
        raise ValueError(f"UAQ scale must be > 0, got {scale} (QuRL uses 1.5; 1.0 is a no-op)")
    if scale == 1.0:
        return 0
    count = 0
    for layer in decoder_layers(model):
        for norm_name, proj_names in UAQ_GROUPS:
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if proj_names[0].startswith("mlp.") and experts is not None:  # a MoE block: router + every expert
                proj_names = ("mlp.gate",) + tuple(f"mlp.experts.{e}.{p}" for e in range(len(experts))
                                                   for p in ("gate_proj", "up_proj"))
            norm = layer.get_submodule(norm_name)
            norm.weight.mul_(scale)
            for name in proj_names:
                proj = layer.get_submodule(name)
                if proj.weight is None or not proj.weight.requires_grad:
                    raise ValueError(f"UAQ needs trainable master weights, but {name} is frozen (LoRA/qlora)")
                proj.weight.div_(scale)
                count += 1
    return count
