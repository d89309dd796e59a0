"""Optional GPU fast paths, as data: the `fast_paths` section of a run's config.

Each field turns one fused or stacked path on or off. Every path computes what the plain path computes (the same
values, or within the rounding its comment names), so a switch changes speed, not results. Reasons to turn one
off: to measure what it is worth (`quarl bench step --without NAME`), or to rule it out when a run on another GPU
or software stack misbehaves (each kernel also checks itself against torch on first use and falls back on its
own). On a CPU none of them applies.

One `FastPaths` is passed explicitly, never read from a module global: `QuarlForCausalLM(config, fast_paths=...)`
or `model.set_fast_paths(...)` for the training forward and the answer log-probs, and
`FastRolloutEngine(..., fast_paths=...)` for the fused decode, whose CUDA graphs are keyed by it. The trainer
passes `RunConfig.fast_paths` to both, and the run's config.yaml records it. Frozen: a captured CUDA graph keeps
the path it was captured with, so a change is a new `FastPaths` (and new graphs), never an edit in place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FastPaths:
    """Optional GPU fast paths: true = the fused or stacked path where it applies, false = the plain torch path."""

    # training RoPE: one Triton pass each way, torch's roundings; off: torch ops
    fused_rope: bool = True
    # answer log-probs from model-dtype logits, one Triton pass; off: float32 log-softmax
    fused_logprobs: bool = True
    # q/k/v and gate/up quantize their shared input once (same codes): FP8 training, and the unified and qlora flows
    # on bf16 GEMMs (fake-quantized activations, training and the rollout's module path); off: once per linear
    share_input_codes: bool = True
    # FP8 training linear (quantized_backward): all 3 GEMMs on cuBLAS on Hopper (same operands); off: per-GEMM path
    fused_cublas_path: bool = True
    # per-GEMM FP8 training path: weight gradient on the FP8 tensor cores, bf16 output; off: bf16 GEMM of Q(g), Q(x)
    fp8_weight_grad_kernel: bool = False
    # fused decode with LoRA: norm / SiLU·mul hand 8-bit codes to the base GEMMs; off: bases read bf16
    lora_codes_handoff: bool = True
    # fused decode: q/k/v's and gate/up's adapters as one stacked GEMM pair; off: one pair per linear
    stack_rollout_lora: bool = True
    # MoE experts in one launch per projection: bf16 on Hopper (grouped_mm), int8 / fp8 W8A8 experts in rollouts and
    # the unified training forward (grouped Triton kernel); off: one call per expert
    grouped_experts: bool = True


DEFAULT = FastPaths()


def fast_paths_of(obj) -> FastPaths:
    """The `FastPaths` an object carries (`obj.fast_paths`: a model, a module, an engine), else the defaults."""
    paths = getattr(obj, "fast_paths", None)
    return paths if isinstance(paths, FastPaths) else DEFAULT
