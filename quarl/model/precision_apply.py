"""Model-level precision helpers: configure every QuantLinear from a PrecisionConfig, sync, rollout mode, checks.

They work on any nn.Module tree and find layers by type and name, so they serve the decoder, tests and
user-built models alike.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from quarl.model.qlinear import QuantLinear
from quarl.precision import PrecisionConfig

LM_HEAD = "lm_head"


def _last(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _is_norm(module: nn.Module) -> bool:
    """RMSNorm / LayerNorm modules of any origin (ours, Hugging Face's LlamaRMSNorm, torch.nn.RMSNorm)."""
    return "norm" in type(module).__name__.lower()


def wants_quantization(name: str, precision: PrecisionConfig) -> bool:
    """Whether the linear called `name` is quantized under `precision` (lm_head only with quantize_lm_head)."""
    return precision.resolved_format is not None and (_last(name) != LM_HEAD or precision.quantize_lm_head)


def base_settings(precision: PrecisionConfig, hidden_size: int | None = None) -> dict:
    """`precision.linear_settings(hidden_size)` without adapters: what a linear's base needs, before LoRA is added."""
    return {**precision.linear_settings(hidden_size), "lora_rank": 0, "lora_alpha": None, "lora_dropout": 0.0}


def hidden_size(model: nn.Module, precision: PrecisionConfig) -> int | None:
    """The model's hidden size as `precision` resolves by it: its config's `hidden_size` (a QuarlForCausalLM), else
    the narrowest input of the linears it configures (q/k/v, gate/up and o_proj read the hidden size, a dense
    down_proj the wider MLP; a mixture of experts' down_proj reads the narrower expert width, hence the config
    first); None without either."""
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(size, int):
        return size
    return min((m.in_features for _, m in _configured_linears(model, precision)), default=None)


def _configured_linears(model: nn.Module, precision: PrecisionConfig) -> list[tuple[str, QuantLinear]]:
    """(name, module) of every QuantLinear `apply_precision` configures (lm_head only with quantize_lm_head)."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, QuantLinear)
            and (_last(name) != LM_HEAD or precision.quantize_lm_head)]


def apply_precision(model: nn.Module, precision: PrecisionConfig) -> list[str]:
    """Configure every QuantLinear of `model` for `precision`, quantize the rollout copies, freeze for LoRA.

    - A module whose name ends in `lm_head` is left untouched (full precision, no LoRA) unless
      precision.quantize_lm_head.
    - LoRA adapters go only on linears whose last name part is in precision.lora.targets; the others get the
      same quantization with lora_rank 0.
    - With LoRA on, every parameter except the adapters is frozen; norm weights stay trainable iff
      precision.lora.train_norms.
    - precision.kernel_forward None resolves by the model's hidden size (`hidden_size`).
    - precision.batch_invariant switches the model's kernels (`QuarlForCausalLM.set_batch_invariant`), before any
      linear changes (it refuses a model the kernels do not cover).
    Returns the names of the configured linears (in module order).
    """
    settings = precision.linear_settings(hidden_size(model, precision))  # validates, before any linear changes
    if precision.batch_invariant or getattr(model, "batch_invariant", False):
        if not hasattr(model, "set_batch_invariant"):
            raise ValueError("precision.batch_invariant switches a whole QuarlForCausalLM (its norms and attention "
                             f"too), got a {type(model).__name__}; apply it to a QuarlForCausalLM or turn it off")
        model.set_batch_invariant(precision.batch_invariant)
    configured = []
    for name, module in _configured_linears(model, precision):
        layer_settings = dict(settings)
        if _last(name) not in precision.lora.targets:
            layer_settings["lora_rank"] = 0
        module.configure(**layer_settings)
        configured.append(name)
    if precision.lora.enabled:
        _freeze_for_lora(model, precision.lora.train_norms)
    refresh_rollout_weights(model)
    return configured


def _freeze_for_lora(model: nn.Module, train_norms: bool) -> None:
    for module in model.modules():
        norm = _is_norm(module)
        for pname, param in module.named_parameters(recurse=False):
            if pname in ("lora_A", "lora_B"):
                param.requires_grad_(True)
            else:
                param.requires_grad_(bool(norm and train_norms))


def refresh_rollout_weights(model: nn.Module, only_if_changed: bool = False) -> None:
    """Re-quantize every QuantLinear's master weight into its rollout copy, in place (the per-step sync);
    only_if_changed skips frozen weights that did not change since (see `QuantLinear.refresh`)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.refresh(only_if_changed)


@contextlib.contextmanager
def rollout_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block every module with a `set_rollout` method runs its rollout forward (quantized linears,
    AQN noise); on exit, also on an exception, every one of them is set back to training mode (False)."""
    modules = [m for m in model.modules() if callable(getattr(m, "set_rollout", None))]
    try:
        for m in modules:
            m.set_rollout(True)
        yield model
    finally:
        for m in modules:
            m.set_rollout(False)


@contextlib.contextmanager
def full_precision(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block every QuantLinear that keeps a master weight computes x @ W^T + b in the compute dtype, in
    rollout and training mode alike (its formats are set aside and restored on exit, also on an exception): the
    trained policy without quantization. A frozen (qlora) base has no master weight and keeps its dequantized base,
    which is its full-precision function. Use it with the reference engine: the fast engine's CUDA graphs and
    stacked projections were built for the quantized paths."""
    saved = [(m, m.rollout_format, m.train_format) for m in model.modules()
             if isinstance(m, QuantLinear) and m.weight is not None]
    try:
        for m, _, _ in saved:
            m.rollout_format = m.train_format = None
        yield model
    finally:
        for m, rollout_format, train_format in saved:
            m.rollout_format, m.train_format = rollout_format, train_format


def unquantized_linears(model: nn.Module, precision: PrecisionConfig) -> list[str]:
    """Names of linear layers (nn.Linear or QuantLinear) that this precision should quantize but that are not
    quantized in its format (BRIEF §7: a linear silently left in bf16 by a name-matching bug).

    Empty for the bf16 flow. lm_head counts only when precision.quantize_lm_head.
    """
    fmt = precision.validate().resolved_format
    missing = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, QuantLinear)) or not wants_quantization(name, precision):
            continue
        if not isinstance(module, QuantLinear) or module.rollout_format != fmt:
            missing.append(name)
    return missing


def trainable_parameter_count(model: nn.Module) -> int:
    """Number of scalar parameters with requires_grad (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
