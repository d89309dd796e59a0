"""Shared test helpers: tiny random models with O(1) logits, and random token prompts."""

import torch

from quarl.model.decoder import QuarlForCausalLM
from quarl.model.tiny import tiny_config


def randomize_(model: torch.nn.Module, std: float = 0.25) -> torch.nn.Module:
    """Weights with O(1) logits and non-trivial attention (HF's 0.02 init gives nearly uniform outputs): norm
    weights 1 + 0.3 N(0, 1), every other parameter N(0, std). Works on ours and on transformers' models."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return model


def make_model(arch="llama", dtype=torch.float32, std=0.25, **overrides):
    """A tiny model with O(1) logits (so sampling parameters visibly change the distribution)."""
    return randomize_(QuarlForCausalLM(tiny_config(arch, **overrides)), std).to(dtype).eval()


def rand_prompts(lengths):
    """Random byte-token prompts of the given lengths (lists of ids < 256)."""
    return [torch.randint(0, 256, (n,)).tolist() for n in lengths]
