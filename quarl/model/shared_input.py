"""Sibling linears that read one input (q/k/v; gate/up), run together in the training forward.

`shared_input_linears(linears, x)` returns `[linear(x) for linear in linears]`, computed with less traffic:
- the FP8-block training GEMMs quantize x once for the group (`fp8_training.shared_input_codes`);
- in training with LoRA on two or more of them (no dropout), the adapters' first products run as one GEMM,
  x @ [A_1; A_2; ...]^T [M, R]: x is read once, and the backward runs one input-gradient GEMM
  (g_xa [M, R] @ [A_1; ...] [R, K]) and one A-gradient GEMM instead of one each per linear, with no sum of
  per-linear input gradients. Each linear then adds its own (x A_i^T) @ (B_i * scaling)^T in its second GEMM's
  epilogue, as `QuantLinear.add_lora` does.
Rollout mode, dropout, and single adapters take the linears one by one (`QuantLinear.forward`). The stacked
path calls each linear's `base_forward`, not the module itself, so forward hooks on those linears do not run
there (set `STACK_LORA = False` where hooks must see them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quarl.model import fp8_training
from quarl.model.qlinear import QuantLinear

# Stack the group's adapters in training (see the module docstring). Set False to run them per linear.
STACK_LORA = True


def shared_input_linears(linears: list[QuantLinear], x: torch.Tensor) -> list[torch.Tensor]:
    """x [..., K] -> [y_i [..., N_i]], each linear's forward of x (see the module docstring)."""
    with fp8_training.shared_input_codes():
        if not _stack_adapters(linears):
            return [linear(x) for linear in linears]
        ys = [linear.base_forward(x) for linear in linears]
        adapted = [linear for linear in linears if linear.lora_rank]
        x2d = x.reshape(-1, x.shape[-1])
        xa = F.linear(x2d, torch.cat([linear.lora_A.to(x.dtype) for linear in adapted]))  # [M, R]
        out, start = [], 0
        for linear, y in zip(linears, ys):
            if linear.lora_rank:
                part = xa[:, start:start + linear.lora_rank]  # [M, r_i]
                start += linear.lora_rank
                y2d = y.reshape(-1, linear.out_features)
                y = torch.addmm(y2d, part, linear._scaled_lora_B(x.dtype).t()).reshape(y.shape)
            out.append(y)
        return out


def _stack_adapters(linears: list) -> bool:
    """Whether the group's adapters run stacked: training-mode QuantLinears with one input size, at least two of
    them with an adapter, and no adapter dropout (each linear draws its own mask)."""
    if not STACK_LORA or not all(isinstance(linear, QuantLinear) for linear in linears):
        return False
    adapted = [linear for linear in linears if linear.lora_rank]
    return len(adapted) >= 2 and len({linear.in_features for linear in linears}) == 1 and not any(
        linear.rollout or (linear.training and linear.lora_dropout > 0) for linear in linears)
