"""Linears that read the same input (q/k/v, gate/up) as one FP8-block GEMM in the training forward.

With `precision.quantized_backward` and a base frozen under LoRA, each linear's FP8 codes are fixed, so the
codes of its siblings can be stacked once (`fp8_training.stack_frozen_codes`): the input is quantized once
instead of once per linear, one GEMM runs over [sum N, K] instead of three narrower ones (the rollout's fused
decode stacks them the same way), and the backward runs one input-gradient GEMM with no sum of per-linear input
gradients. Each linear's bias and LoRA term are applied to its own columns. Anywhere else (a trained base, rollout
mode, other formats, N not a multiple of 128) the linears run one by one, unchanged.
"""

from __future__ import annotations

import torch

from quarl.model import fp8_training
from quarl.model.qlinear import QuantLinear

# Stack sibling linears in the FP8 training forward where they qualify (see the module docstring). Off until
# measured on a GPU (bench/update_profile.py "+stack"); tested on the CPU against the linears one by one.
STACK_SHARED_INPUTS = False


class SharedInputLinears:
    """Callable over x [..., K] -> [y_i [..., N_i] for each linear], the linears' own outputs (module
    docstring). Holds the stacked codes (about K * sum N bytes twice) while the weights are unchanged."""

    def __init__(self, linears: list[QuantLinear]):
        self.linears = list(linears)
        self._codes: fp8_training.FrozenWeightCodes | None = None
        self._keys: list[tuple] | None = None  # each linear's weight state the codes were built from

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        codes = self._stacked_codes(x) if STACK_SHARED_INPUTS else None
        if codes is None:
            return [linear(x) for linear in self.linears]
        n = [linear.out_features for linear in self.linears]
        biases = [linear.bias for linear in self.linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.to(x.dtype) if b is not None else x.new_zeros(size) for b, size in zip(biases, n)])
        y = fp8_training.fp8_block_linear(x, None, bias, codes)
        outs = y.split(n, dim=-1)  # one concatenation of the gradients in the backward
        return [linear.add_lora(out, x) if linear.lora_rank else out for linear, out in zip(self.linears, outs)]

    def _qualifies(self, x: torch.Tensor) -> bool:
        linears = self.linears
        return len(linears) > 1 and len({linear.in_features for linear in linears}) == 1 and all(
            linear.quantized_backward and linear.train_format == fp8_training.FORMAT and not linear.rollout
            and linear.weight is not None and not linear.weight.requires_grad and linear.out_features % 128 == 0
            and x.dtype == linear.compute_dtype for linear in linears)

    def _stacked_codes(self, x: torch.Tensor) -> fp8_training.FrozenWeightCodes | None:
        if not self._qualifies(x):
            self._codes = self._keys = None
            return None
        extra = [(linear.weight.data_ptr(), x.dtype) for linear in self.linears]
        if self._keys is None or not all(linear._same_state(key, *e)
                                         for linear, key, e in zip(self.linears, self._keys, extra)):
            self._codes = None  # free the old stack before building the new one
            self._codes = fp8_training.stack_frozen_codes([linear.fp8_codes(x.dtype) for linear in self.linears])
            self._keys = [linear._weight_state(*e) for linear, e in zip(self.linears, extra)]
        return self._codes
