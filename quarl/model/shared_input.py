"""Linears that read the same input (q/k/v, gate/up) as one FP8-block GEMM in the training forward.

With `precision.quantized_backward` and a base frozen under LoRA, each linear's FP8 codes are fixed, so the
codes of its siblings can be stacked once (`fp8_training.stack_frozen_codes`): the input is quantized once
instead of once per linear, one GEMM runs over [sum N, K] instead of three narrower ones (the rollout's fused
decode stacks them the same way), and the backward runs one input-gradient GEMM with no sum of per-linear input
gradients. Each linear's bias and LoRA term are applied to its own columns. Anywhere else (a trained base, rollout
mode, other formats or modules, N not a multiple of 128) the linears run one by one, unchanged.
"""

from __future__ import annotations

import weakref

import torch

from quarl.model import fp8_training
from quarl.model.qlinear import QuantLinear

# Stack sibling linears in the FP8 training forward where they qualify (see the module docstring). Off until
# measured on a GPU (bench/update_profile.py "+stack"); tested on the CPU against the linears one by one.
STACK_SHARED_INPUTS = False


class SharedInputLinears:
    """The stacked-codes cache of one group of sibling linears; call it with the group's current modules:
    (linears, x [..., K]) -> [y_i [..., N_i]], each linear's own output. The stacked codes (about K * sum N bytes
    twice) are kept between forwards, also through rollouts, until a linear's weight changes, is refreshed or moves
    (`QuantLinear.codes_epoch`), or `clear()`."""

    def __init__(self):
        self._codes: fp8_training.FrozenWeightCodes | None = None
        self._linears: list[weakref.ref] = []  # the modules the codes were built from
        self._keys: list[tuple] = []  # and their weight states then

    def clear(self) -> None:
        self._codes, self._linears, self._keys = None, [], []

    def __call__(self, linears, x: torch.Tensor) -> list[torch.Tensor]:
        linears = list(linears)
        codes = self._stacked_codes(linears, x) if STACK_SHARED_INPUTS and _qualify(linears, x) else None
        if codes is None:
            return [linear(x) for linear in linears]
        n = [linear.out_features for linear in linears]
        biases = [linear.bias for linear in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.to(x.dtype) if b is not None else x.new_zeros(size) for b, size in zip(biases, n)])
        y = fp8_training.fp8_block_linear(x, None, bias, codes)
        outs = y.split(n, dim=-1)  # one concatenation of the gradients in the backward
        return [linear.add_lora(out, x) if linear.lora_rank else out for linear, out in zip(linears, outs)]

    def _stacked_codes(self, linears: list[QuantLinear], x: torch.Tensor) -> fp8_training.FrozenWeightCodes:
        extra = [(linear.weight.data_ptr(), x.dtype, linear.codes_epoch) for linear in linears]
        current = len(self._linears) == len(linears) and all(
            ref() is linear and linear._same_state(key, *e)
            for ref, linear, key, e in zip(self._linears, linears, self._keys, extra))
        if not current:
            self.clear()  # free the old stack before building the new one
            self._codes = fp8_training.stack_frozen_codes([linear.fp8_codes(x.dtype) for linear in linears])
            self._linears = [weakref.ref(linear) for linear in linears]
            self._keys = [linear._weight_state(*e) for linear, e in zip(linears, extra)]
        return self._codes


def _qualify(linears: list, x: torch.Tensor) -> bool:
    """Whether the group can run stacked on x (see the module docstring)."""
    return len(linears) > 1 and all(isinstance(linear, QuantLinear) for linear in linears) and \
        len({linear.in_features for linear in linears}) == 1 and all(
            linear.quantized_backward and linear.train_format == fp8_training.FORMAT and not linear.rollout
            and linear.weight is not None and not linear.weight.requires_grad and linear.out_features % 128 == 0
            and x.dtype == linear.compute_dtype for linear in linears)
