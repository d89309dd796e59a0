"""The precision flow: the single source of truth for every precision decision (BRIEF §2).

A `PrecisionConfig` names the flow (`bf16`, `split`, `unified`, `qlora`) and the number format. `resolve()`
turns it into the per-linear settings that `quarl.model.qlinear.QuantLinear.configure` takes:

| flow      | rollout forward                          | training forward                              |
|-----------|------------------------------------------|-----------------------------------------------|
| `bf16`    | full precision                           | full precision                                |
| `split`   | Q(W) and Q(x) (weight-only for fp4)      | full precision                                |
| `unified` | Q(W) and Q(x)                            | the same Q on W and x, straight-through grads |
| `qlora`   | frozen Q(W) base (weight-only) + LoRA    | the same dequantized base + LoRA              |

"Full precision" is the run's compute dtype: bfloat16 on a GPU, float32 on a CPU (bf16 matmuls are slow on
most CPUs); `compute_dtype` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quarl.formats.registry import FORMATS

FLOWS = ("bf16", "split", "unified", "qlora")
QUANT_FORMATS = tuple(FORMATS)
# no FP4 tensor cores on Hopper: W4A16 (BRIEF §3)
WEIGHT_ONLY_FORMATS = tuple(name for name, spec in FORMATS.items() if spec.weight_only_default)
DEFAULT_FORMAT = {"bf16": None, "split": "int8", "unified": "fp8-block", "qlora": "nvfp4"}
GPTQ_FORMATS = ("nvfp4", "mxfp4", "int8")  # the qlora base formats `quarl.model.gptq` quantizes
LORA_INITS = ("zeros", "base_error")  # lora.init
# The smallest hidden size at which the unified and qlora flows multiply on the quantized kernels by default
# (`kernel_forward`)
KERNEL_FORWARD_MIN_HIDDEN = 2048
KV_CACHE_FORMATS = ("auto", "fp8", "fp8-token")


@dataclass
class LoraConfig:
    """LoRA adapters on every linear of the decoder (QeRL: rank 16-32 on q,k,v,o,gate,up,down, alpha = rank)."""

    rank: int = 0  # 0 = no LoRA (full fine-tuning)
    alpha: float | None = None  # None -> alpha = rank
    dropout: float = 0.0  # LoRA dropout (training forward only)
    # the linears that get adapters (by the last part of their name)
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    train_norms: bool = False  # also train the RMSNorm weights (QeRL option)
    # how the adapters start. "zeros": B = 0 (A kaiming-uniform, as PEFT), so training starts at the base model.
    # "base_error" (qlora with a GPTQ base): B A starts as the rank-r correction of the quantized base's error over
    # GPTQ's calibration inputs, so training starts nearer the full-precision model (quarl/model/lora_init.py).
    # None -> base_error for a GPTQ nvfp4 base (the case measured: B6, SmolLM2-135M, one H100, step 100, 1.2 points
    # below bf16 LoRA on seeds 0-2 where B = 0 was 3.9 below), else zeros
    init: str | None = None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / max(self.rank, 1)


@dataclass
class PrecisionConfig:
    """How rollout and training compute: the precision flow, its number format and the LoRA setup."""

    flow: str = "bf16"  # bf16 | split | unified | qlora (the four flows of the README)
    format: str | None = None  # None -> the flow's default (split: int8, unified: fp8-block, qlora: nvfp4)
    quantize_lm_head: bool = False  # lm_head (and embeddings) stay in full precision unless asked
    # None -> True for fp4 formats and for qlora; for the unified flow as `unified_weight_only_on_bf16` decides;
    # else W8A8
    weight_only: bool | None = None
    # unified flow with weight_only and kernel_forward null, no quantized_backward: quantize only the weights where
    # the model's hidden size makes kernel_forward choose bf16 GEMMs (below KERNEL_FORWARD_MIN_HIDDEN). There both
    # forwards multiply bf16 GEMMs anyway, and quantized activations add only launches and mismatch: a last-bit
    # difference between decode and training forward flips an 8-bit rounding (B6, SmolLM2-135M, one H100:
    # mismatch/kl 0.0011-0.0012 against bf16's 0.0011 and W8A8's 0.0034-0.0067; step 1.00x bf16's against
    # 1.09-1.12x). false: W8A8 there too. An explicit kernel_forward or weight_only is kept as given
    unified_weight_only_on_bf16: bool = True
    kv_cache: str = "auto"  # "auto" = compute dtype; "fp8" = E4M3, scale 1; "fp8-token" = E4M3, scale per token+head
    compute_dtype: str = "auto"  # "auto" | "bfloat16" | "float16" | "float32"
    quantized_backward: bool = False  # unified + fp8-block: the gradient GEMMs take FP8-block operands (Jet-RL)
    # unified and qlora flows: where rollout and training multiply the quantized values. true: the quantized GEMM
    # kernels on the codes (unified W8A8 on a GPU, rollout and training alike: exact code products, fp32 sums whose
    # order may differ by plan; qlora: the rollout on the weight-only kernels, training on the dequantized base);
    # false: bf16 GEMMs of the fake-quantized activations and the dequantized weights (a bf16 copy of every
    # quantized weight, kept), in rollout and training alike (always for a weight-only unified flow). null -> true
    # for models whose hidden size is at least 2048 (KERNEL_FORWARD_MIN_HIDDEN), false below, where the bf16 GEMMs
    # measured faster for the whole step: each quantized linear adds launches to a bf16 GEMM's one cuBLAS call,
    # which small GEMMs do not earn back (bench/results/step.md: unified fp8-block at hidden 576 and 1536;
    # quality.md: qlora at 576; an H100)
    kernel_forward: bool | None = None
    # rollout and training compute the same bits: every GEMM, RMSNorm and attention of the model runs on
    # batch-invariant Triton kernels (quarl/kernels/batch_invariant.py), whose output rows never depend on how many
    # rows a call has, and the engine decodes on the module path. The bf16 flow and the unified and qlora flows
    # (kernel_forward null then means bf16 GEMMs) are then on-policy to the bit: mismatch/kl 0 but for the
    # log-probs' float32 rounding (below 5e-5 on B6). Needs a CUDA GPU, a bf16/fp16 compute dtype, a dense model,
    # rollout.engine=fast, kv_cache auto, one process, no AQN, no top-p / top-k, no quantized_backward; B6 steps
    # took 1.3-1.4x bf16's at 135M (bench/results/quality.md)
    batch_invariant: bool = False
    # split flow, W8A8: SmoothQuant migration strength alpha in (0, 1) for the rollout copy (0 = off): activations
    # are divided per input channel by s = max|x|^alpha / max|W|^(1 - alpha) (calibrated on the first 64 training
    # prompts) and the weights multiplied by s before quantization, flattening the outlier channels the per-token
    # quantizer spends its range on. None -> 0.5 (SmoothQuant's default) for int8 W8A8 rollouts, where it cut B6's
    # mismatch 3x; 0 otherwise (fp8 gains little)
    smooth_alpha: float | None = None
    # qlora: how the frozen base is quantized. "rtn": each weight to its nearest code; "gptq": GPTQ, each input
    # column's rounding error moved onto the columns after it through the layer's input Hessian, calibrated on the
    # first 128 training prompts in full precision (nvfp4, mxfp4, int8; MoE experts keep rtn). None -> gptq for
    # those formats (B6, SmolLM2-135M NVFP4: held-out accuracy before training 0.20 against rtn's 0.07, full
    # precision 0.24), else rtn
    base_quantizer: str | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> "PrecisionConfig":
        if self.flow not in FLOWS:
            raise ValueError(f"precision.flow={self.flow!r} is not a precision flow; choose one of {FLOWS}")
        fmt = self.resolved_format
        if fmt is not None and fmt not in QUANT_FORMATS:
            raise ValueError(f"precision.format={fmt!r} is not a known format; choose one of {QUANT_FORMATS}")
        if self.flow == "bf16" and self.format not in (None, "bf16"):
            raise ValueError(
                f"precision.flow=bf16 runs everything in full precision but precision.format={self.format!r} "
                "was given; use flow=split (quantized rollout) or flow=unified, or drop the format"
            )
        if self.flow == "qlora" and not self.lora.enabled:
            raise ValueError(
                "precision.flow=qlora trains LoRA adapters on a frozen quantized base, but lora.rank is 0; "
                "set lora.rank (e.g. 16 or 32) or choose flow=split/unified for full fine-tuning"
            )
        if self.lora.init not in (None, *LORA_INITS):
            raise ValueError(f"lora.init={self.lora.init!r}; choose one of {LORA_INITS} (or null for the default)")
        if self.lora.init == "base_error" and (self.flow != "qlora" or self.resolved_base_quantizer != "gptq"):
            raise ValueError("lora.init=base_error starts the adapters as a correction of a GPTQ-quantized qlora "
                             f"base, but precision.flow={self.flow} with format={fmt} and base_quantizer="
                             f"{self.resolved_base_quantizer}; use flow=qlora with a {' / '.join(GPTQ_FORMATS)} "
                             "base and base_quantizer=gptq (its default), or lora.init=zeros")
        if self.flow in ("unified", "qlora") and fmt is not None and FORMATS[fmt].per_tensor_scale \
                and not self.resolved_weight_only:
            raise ValueError(
                f"precision.format={fmt} with precision.flow={self.flow} quantizes activations with one scale per "
                "tensor, so a token's rounding depends on the rest of the batch: rollout (a few tokens per step) and "
                "training (whole sequences) would compute different functions. Use precision.format=fp8 (per-token "
                "scales) or fp8-block, or precision.weight_only=true"
            )
        if self.kv_cache not in KV_CACHE_FORMATS:
            raise ValueError(f"precision.kv_cache={self.kv_cache!r}; choose one of {KV_CACHE_FORMATS}")
        if self.compute_dtype not in ("auto", "bfloat16", "float16", "float32", "float64"):
            raise ValueError(
                f"precision.compute_dtype={self.compute_dtype!r}; choose auto, bfloat16, float16, float32 or float64"
            )
        if self.quantized_backward and (self.flow != "unified" or fmt != "fp8-block" or self.resolved_weight_only):
            raise ValueError(
                "precision.quantized_backward=true quantizes the gradient GEMMs as Jet-RL does; it needs "
                f"precision.flow=unified with precision.format=fp8-block (W8A8), got flow={self.flow!r}, "
                f"format={fmt!r}, weight_only={self.resolved_weight_only}"
            )
        if self.batch_invariant:
            conflicts = [text for text, bad in (
                (f"precision.flow={self.flow} (rollout and training differ by design; use bf16, unified or qlora)",
                 self.flow == "split"),
                (f"precision.kv_cache={self.kv_cache} (set auto)", self.kv_cache != "auto"),
                ("precision.quantized_backward=true (set false)", self.quantized_backward),
                ("precision.kernel_forward=true (set null: bf16 GEMMs)", bool(self.kernel_forward)),
                (f"precision.compute_dtype={self.compute_dtype} (set auto, bfloat16 or float16)",
                 self.compute_dtype in ("float32", "float64"))) if bad]
            if conflicts:
                raise ValueError("precision.batch_invariant=true runs rollout and training on the 16-bit "
                                 "batch-invariant kernels, which do not cover " + "; ".join(conflicts))
        if self.smooth_alpha is not None and not 0.0 <= self.smooth_alpha < 1.0:
            raise ValueError(f"precision.smooth_alpha={self.smooth_alpha} must be in [0, 1) (0 = off; 0.5 is "
                             "SmoothQuant's default)")
        if self.smooth_alpha and (self.flow != "split" or fmt is None or self.resolved_weight_only):
            raise ValueError(
                "precision.smooth_alpha smooths the activations a W8A8 rollout quantizes; it needs "
                f"precision.flow=split with activations quantized, got flow={self.flow!r}, format={fmt!r}, "
                f"weight_only={self.resolved_weight_only}")
        if self.base_quantizer not in (None, "rtn", "gptq"):
            raise ValueError(f"precision.base_quantizer={self.base_quantizer!r}; choose rtn or gptq (or null for the "
                             "flow's default)")
        if self.base_quantizer == "gptq" and (self.flow != "qlora" or fmt not in GPTQ_FORMATS):
            raise ValueError(f"precision.base_quantizer=gptq quantizes the frozen base of precision.flow=qlora in "
                             f"{', '.join(GPTQ_FORMATS)}; got flow={self.flow!r}, format={fmt!r} (use rtn)")
        if self.lora.rank < 0 or self.lora.dropout < 0 or self.lora.dropout >= 1:
            raise ValueError("lora.rank must be >= 0 and lora.dropout in [0, 1)")
        return self

    @property
    def resolved_format(self) -> str | None:
        if self.flow == "bf16":
            return None
        if self.format in (None, "auto"):
            return DEFAULT_FORMAT[self.flow]
        return self.format

    @property
    def resolved_smooth_alpha(self) -> float:
        """`smooth_alpha`, or where it is None: 0.5 for the split flow's int8 W8A8 rollouts, else 0 (off)."""
        if self.smooth_alpha is not None:
            return float(self.smooth_alpha)
        return 0.5 if self.flow == "split" and self.resolved_format == "int8" and not self.resolved_weight_only \
            else 0.0

    @property
    def resolved_base_quantizer(self) -> str:
        """`base_quantizer`, or where it is None: "gptq" for a qlora base in a format GPTQ quantizes, else "rtn"."""
        if self.base_quantizer is not None:
            return self.base_quantizer
        return "gptq" if self.flow == "qlora" and self.resolved_format in GPTQ_FORMATS else "rtn"

    @property
    def resolved_lora_init(self) -> str:
        """`lora.init`, or where it is None: "base_error" for a qlora nvfp4 base that GPTQ quantizes, else "zeros"."""
        if self.lora.init is not None:
            return self.lora.init
        measured = self.flow == "qlora" and self.resolved_format == "nvfp4" and self.resolved_base_quantizer == "gptq"
        return "base_error" if measured else "zeros"

    @property
    def resolved_weight_only(self) -> bool:
        if self.weight_only is not None:
            return self.weight_only
        return self.flow == "qlora" or self.resolved_format in WEIGHT_ONLY_FORMATS

    @property
    def weight_only_by_hidden_size(self) -> bool:
        """Whether the model's hidden size decides `weight_only`: the unified flow, W8A8 by format, with
        weight_only and kernel_forward null, `unified_weight_only_on_bf16` and no quantized_backward (whose FP8
        gradient GEMMs need W8A8); weight-only below KERNEL_FORWARD_MIN_HIDDEN, where kernel_forward null chooses
        bf16 GEMMs."""
        return self.weight_only is None and self.flow == "unified" and self.kernel_forward is None \
            and self.unified_weight_only_on_bf16 and not self.quantized_backward and not self.resolved_weight_only

    def resolved_weight_only_at(self, hidden_size: int | None) -> bool:
        """`weight_only` for a model of hidden_size (None = unknown): `resolved_weight_only`, or true where
        `weight_only_by_hidden_size` and hidden_size is below KERNEL_FORWARD_MIN_HIDDEN."""
        if self.weight_only_by_hidden_size and hidden_size is not None and hidden_size < KERNEL_FORWARD_MIN_HIDDEN:
            return True
        return self.resolved_weight_only

    def resolved_kernel_forward(self, hidden_size: int | None) -> bool:
        """`kernel_forward`, or where it is None: whether hidden_size (the model's; None = unknown) is at least
        KERNEL_FORWARD_MIN_HIDDEN (unknown: true); false with `batch_invariant`."""
        if self.kernel_forward is not None:
            return bool(self.kernel_forward)
        if self.batch_invariant:
            return False
        return hidden_size is None or hidden_size >= KERNEL_FORWARD_MIN_HIDDEN

    def linear_settings(self, hidden_size: int | None = None) -> dict:
        """Keyword arguments for `QuantLinear.configure` (shared by every decoder linear); hidden_size: the model's,
        for `resolved_kernel_forward`.

        Returns dict(rollout_format, train_format, weight_only, frozen_base, lora_rank, lora_alpha, lora_dropout,
        quantized_backward, kernel_forward, bf16_gemms).
        """
        self.validate()
        fmt = self.resolved_format
        kernel_forward = self.resolved_kernel_forward(hidden_size)
        weight_only = self.resolved_weight_only_at(hidden_size)
        return dict(
            rollout_format=fmt,
            train_format=fmt if self.flow in ("unified", "qlora") else None,
            weight_only=weight_only,
            frozen_base=self.flow == "qlora",
            lora_rank=self.lora.rank,
            lora_alpha=self.lora.alpha if self.lora.alpha is not None else float(self.lora.rank),
            lora_dropout=self.lora.dropout,
            quantized_backward=self.quantized_backward,
            kernel_forward=kernel_forward,
            # the flows whose training forward multiplies quantized values, off the kernels: bf16 GEMMs in both; a
            # weight-only unified flow always (no weight-only training kernel to match a rollout kernel)
            bf16_gemms=self.flow in ("unified", "qlora") and not self.quantized_backward and (
                not kernel_forward or (self.flow == "unified" and weight_only)),
        )

    def torch_dtype(self, device: torch.device | str) -> torch.dtype:
        if self.compute_dtype != "auto":
            return getattr(torch, self.compute_dtype)
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
