"""Sibling linears that read one input (q/k/v; gate/up), run together in the training forward.

`shared_input_linears(linears, x, fast_paths)` returns `[linear(x) for linear in linears]`; with the FP8-block
training GEMMs (`precision.quantized_backward`) the group quantizes x once instead of once per linear
(`fp8_training.shared_input_codes`; `FastPaths.share_input_codes`). LoRA adapters are stacked only in the rollout
(`quarl.rollout.fused_decode.FusedProjection`, `FastPaths.stack_rollout_lora`): stacking them in training gained
nothing measurable and changed how the bf16 gradients round (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch

from quarl.fast_paths import DEFAULT as DEFAULT_FAST_PATHS, FastPaths
from quarl.model import fp8_training
from quarl.model.qlinear import QuantLinear


def shared_input_linears(linears: list[QuantLinear], x: torch.Tensor,
                         fast_paths: FastPaths = DEFAULT_FAST_PATHS) -> list[torch.Tensor]:
    """x [..., K] -> [y_i [..., N_i]], each linear's forward of x; fast_paths: the model's (`share_input_codes`)."""
    with fp8_training.shared_input_codes(fast_paths.share_input_codes):
        return [linear(x) for linear in linears]
