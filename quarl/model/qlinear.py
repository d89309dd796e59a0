"""Quantization-aware linear layer used by every linear of the decoder.

PLACEHOLDER: full-precision behaviour only; the quantized modes are being implemented
(see the docstrings for the contract).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class QuantLinear(nn.Module):
    """y = x @ W^T + b with a trainable master weight W [out_features, in_features].

    Contract (stable API used by the model, engine and trainer):
      - `configure(rollout_format, train_format, weight_only, frozen_base, lora_rank, lora_alpha, lora_dropout)`
        (the keyword arguments of `PrecisionConfig.linear_settings()`).
      - `set_rollout(on: bool)`: rollout forward (quantized rollout copy) vs training forward.
      - `refresh()`: re-quantize the master weight into the rollout copy in place.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.rollout = False

    def configure(self, **settings) -> None:
        if settings.get("rollout_format") or settings.get("lora_rank"):
            raise NotImplementedError("quantized / LoRA modes are not implemented yet")

    def set_rollout(self, on: bool) -> None:
        self.rollout = bool(on)

    def refresh(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
