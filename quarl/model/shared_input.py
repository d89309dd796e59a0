"""Sibling linears that read one input (q/k/v; gate/up), run together in the training forward.

`shared_input_linears(linears, x, fast_paths)` returns `[linear(x) for linear in linears]`, computed with less
traffic:
- the FP8-block training GEMMs quantize x once for the group (`fp8_training.shared_input_codes`;
  `FastPaths.share_input_codes`);
- in training with LoRA on two or more of them (no dropout), the adapters' first products run as one GEMM,
  x @ [A_1; A_2; ...]^T [M, R]: x is read once, and the backward runs one input-gradient GEMM
  (g_xa [M, R] @ [A_1; ...] [R, K]) and one A-gradient GEMM instead of one each per linear, with no sum of
  per-linear input gradients. Each linear then adds its own (x A_i^T) @ (B_i * scaling)^T in its second GEMM's
  epilogue, as `QuantLinear.add_lora` does.
Rollout mode, dropout, single adapters and linears with forward hooks take the linears one by one
(`QuantLinear.forward`). The stacking is off by default (`FastPaths.stack_lora`): in bf16 the stacked GEMM may sum
in another order, so gradients can differ from the per-linear path's by bf16 rounding, for 0.3 % of an update
micro-batch (bench/results/gemm.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quarl.fast_paths import DEFAULT as DEFAULT_FAST_PATHS, FastPaths
from quarl.model import fp8_training
from quarl.model.qlinear import QuantLinear


def shared_input_linears(linears: list[QuantLinear], x: torch.Tensor,
                         fast_paths: FastPaths = DEFAULT_FAST_PATHS) -> list[torch.Tensor]:
    """x [..., K] -> [y_i [..., N_i]], each linear's forward of x (see the module docstring); fast_paths: the
    model's (`share_input_codes`, `stack_lora`)."""
    with fp8_training.shared_input_codes(fast_paths.share_input_codes):
        if not _stack_adapters(linears, fast_paths.stack_lora):
            return [linear(x) for linear in linears]
        adapted = [linear for linear in linears if linear.lora_rank]
        a = torch.cat([linear.lora_A for linear in adapted]).to(x.dtype)  # [R, K]: A_1; A_2; ...
        parts = iter(F.linear(x.reshape(-1, x.shape[-1]), a).split([linear.lora_rank for linear in adapted], 1))
        return [linear.add_lora(linear.base_forward(x), x, xa=next(parts)) if linear.lora_rank
                else linear.base_forward(x) for linear in linears]


def _stack_adapters(linears: list, enabled: bool) -> bool:
    """Whether the group's adapters run stacked: `enabled` (`FastPaths.stack_lora`); QuantLinears not in rollout
    mode, with one input size, at least two of them with an adapter, no adapter dropout now (each linear draws its
    own mask), and no forward hooks (the stacked path calls `base_forward`, which would skip them)."""
    if not enabled or not all(isinstance(linear, QuantLinear) for linear in linears):
        return False
    adapted = [linear for linear in linears if linear.lora_rank]
    return len(adapted) >= 2 and len({linear.in_features for linear in linears}) == 1 and not any(
        linear.rollout or linear.lora_dropout_p() > 0 or linear._forward_hooks or linear._forward_pre_hooks
        for linear in linears)
