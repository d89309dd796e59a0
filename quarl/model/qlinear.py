"""Quantization-aware linear layer used by every linear of the decoder (BRIEF §2, §3, §5).

One class serves every precision flow; `configure(**PrecisionConfig.linear_settings())` picks the behaviour:

| mode                                   | forward                                                            |
|----------------------------------------|--------------------------------------------------------------------|
| training, no train_format (bf16/split) | x @ W^T + b                                                        |
| rollout, rollout_format set            | Q_act(x) @ deq(Q_w(W))^T + b  (Q_act skipped when weight_only)     |
| training, train_format set (unified)   | the same values as rollout, gradients straight-through to W and x  |
| frozen_base (qlora)                    | deq(base) (+ Q_act) in both modes; the master weight is dropped    |

plus, in every mode, the LoRA term dropout(x) @ A^T @ B^T * (alpha / r) in the compute dtype, never quantized.

The rollout copy of the weight is a `QuantizedTensor` whose buffers are registered on the module (so `.to(device)`
moves them) and re-quantized in place by `refresh()` — the per-step "sync" is a few in-place kernels, no new
memory. Its float buffers are stored under integer views (float32 scales as int32, FP8 codes as uint8) so that a
`model.to(torch.bfloat16)` cannot cast them; `qweight` rebuilds the typed views on each call (no copy).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from quarl import kernels
from quarl.fallbacks import report_fallback
from quarl.fast_paths import DEFAULT as DEFAULT_FAST_PATHS
from quarl.formats import FORMATS, QuantizedTensor, get_format, quantize
from quarl.formats.registry import quantize_unchecked
from quarl.model import fp8_training
from quarl.model.fp8_training import FrozenWeightCodes, fp8_block_linear

# Settings that define a frozen (qlora) base; once its master weight is dropped only the LoRA settings may change.
_BASE_SETTINGS = ("rollout_format", "train_format", "weight_only", "frozen_base", "bf16_gemms")

# Storage dtypes for the rollout buffers: integer types, which nn.Module.to(dtype) leaves alone.
_STORAGE = {torch.float32: torch.int32, torch.float8_e4m3fn: torch.uint8}


def _as_storage(t: torch.Tensor) -> torch.Tensor:
    target = _STORAGE.get(t.dtype)
    return t if target is None else t.view(target)


class _StraightThrough(torch.autograd.Function):
    """Forward: `value` itself; backward: the incoming gradient goes to `source` unchanged (the identity)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        # contiguous: GEMMs pick their kernel by layout, so a padded, sliced fake-quantized tensor would round
        # differently from the rollout's; then an alias (no copy) that autograd can attach this node to
        value = value.contiguous()
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


def _straight_through(value: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Forward value `value` exactly, gradient of the identity wrt `source` (same shape and dtype).

    An autograd node of its own rather than source + (value - source).detach(), which rounds (value - source) in
    the compute dtype (bf16) and would not reproduce `value`, or value + (source - source.detach()), which costs two
    elementwise passes in the forward and two in the backward over every quantized activation and weight.
    """
    if not (torch.is_grad_enabled() and source.requires_grad):
        return value.detach()  # nothing to differentiate
    return _StraightThrough.apply(value.detach(), source)


def fake_quantized_input(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`kernels.fake_quantize_activation(x, fmt)` for x [M, K], made once per input inside an open
    `fp8_training.shared_input_codes` block (q/k/v, gate/up: siblings reading one tensor) and reused by the others:
    the same values, fewer passes. The block keeps each input alive, so its address cannot name another tensor."""
    share = fp8_training.shared_input()
    if share is None:
        return kernels.fake_quantize_activation(x, fmt)
    key = ("fake-quantized", fmt, x.data_ptr(), x.device, x.dtype, tuple(x.shape), x.stride(), x._version)
    entry = share.get(key)
    if entry is None:
        entry = share[key] = (x, kernels.fake_quantize_activation(x, fmt))
    return entry[1]


def divided(x: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] / s (SmoothQuant factors, float32 [K]) in x's dtype, divided in float32 (float64 for a float64
    x) and rounded once; x itself for s None. What a smoothed linear's activation quantizer reads."""
    return x if s is None else (x / s).to(x.dtype)  # s is float32: the quotient promotes to float32 or wider


def _copy_quantized(dst: QuantizedTensor, src: QuantizedTensor) -> None:
    """src's codes, scales and tensor scale into dst's buffers (same format and sizes), in place."""
    dst.data.copy_(src.data)
    dst.scale.copy_(src.scale.reshape(dst.scale.shape))
    if dst.global_scale is not None:
        dst.global_scale.copy_(src.global_scale)


def _quantize_weight(w: torch.Tensor, fmt: str) -> QuantizedTensor:
    """Q(w) for w [out, in]: one Triton pass on a GPU where `kernels.try_quantize_weight` has one (the same codes),
    else the reference without its NaN/Inf scan (a device synchronisation per call)."""
    fresh = kernels.try_quantize_weight(w, fmt)
    return fresh if fresh is not None else quantize_unchecked(w, fmt, "weight")


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
    """F.linear(x, w, bias), on the batch-invariant kernel when `invariant` (`QuantLinear.batch_invariant`)."""
    if invariant:
        from quarl.kernels import batch_invariant

        return batch_invariant.linear(x, w, bias)
    return F.linear(x, w, bias)


class _FrozenBaseLinear(torch.autograd.Function):
    """y = x @ deq(base)^T + b for a frozen quantized base, keeping no dequantized weight for backward.

    Plain `F.linear(x, deq(base))` makes autograd hold every layer's dequantized [out, in] weight until backward
    (for a 72B model that is the whole bf16 model again, which the qlora flow exists to avoid). Here backward
    dequantizes the codes a second time instead: one more pass over 4-bit codes per layer, no stored weight.
    Only x (and a trainable bias) get gradients; the base is a buffer.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, layer: "QuantLinear") -> torch.Tensor:
        ctx.layer = layer  # the module outlives the graph; its buffers are never re-quantized (frozen base)
        ctx.has_bias = bias is not None
        return _linear(x, layer._dequantized_base(x.dtype), bias, layer.batch_invariant)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ ctx.layer._dequantized_base(grad_out.dtype)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_bias, None


class _KernelLinear(torch.autograd.Function):
    """Attach the straight-through gradients of y = Q(x) @ Q(W)^T + b to a product y a kernel computed.

    Forward returns y [M, N] itself; backward gives x [M, K] the gradient g @ Q(W) and W [N, K] the gradient
    g^T @ Q(x), and a bias its sum g.sum(0): exactly what autograd gives the fake-quantized path. Q(W) is the
    forward's own quantized weight `qweight` dequantized (one kernel on a GPU, `kernels.dequantize`), Q(x) is
    recomputed from x rather than kept from the forward. The weight's codes and scales are saved as tensors for
    backward: autograd then refuses a backward whose rollout copy was re-quantized in place since the forward, and
    activation checkpointing frees and recomputes a freshly quantized copy like any saved tensor."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                qweight: QuantizedTensor) -> torch.Tensor:
        ctx.save_for_backward(x, qweight.data, qweight.scale)
        ctx.fmt, ctx.shape, ctx.weight_dtype = qweight.fmt, qweight.shape, weight.dtype
        ctx.has_bias = bias is not None
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, data, scale = ctx.saved_tensors
        qweight = QuantizedTensor(ctx.fmt, "weight", data, scale, None, ctx.shape)  # an 8-bit format's codes
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_x = grad @ kernels.dequantize(qweight, grad.dtype)
        if ctx.needs_input_grad[2]:
            xq = kernels.fake_quantize_activation(x.detach(), ctx.fmt)
            grad_w = (grad.t() @ xq).to(ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = grad.sum(0)
        return None, grad_x, grad_w, grad_b, None


class _FakeQuantLinear(torch.autograd.Function):
    """y = Q(x) @ Q(W)^T + b on a bf16 GEMM with the straight-through gradients, as one autograd node (the unified
    flow's training forward off the kernels): x [..., K] and Q(W) [N, K] (`QuantLinear._fake_quantized_weight`) in
    the compute dtype -> y [..., N]. Q(x) is made here (fmt None: x itself, weight-only). Backward gives x the
    gradient g @ Q(W), W the gradient g^T @ Q(x) and a bias sum g, the formulas of `_KernelLinear`. One node
    rather than two straight-through nodes around F.linear: at small sizes each autograd node's Python costs more
    than its GEMM."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wq: torch.Tensor,
                fmt: str | None, invariant: bool) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # 2-D as the rollout forward multiplies: the same GEMM, the same rounding
        xq = x2d if fmt is None else fake_quantized_input(x2d, fmt)
        # Q(W) may be the rollout copy's cache: autograd then refuses a backward after an in-place re-quantization
        ctx.save_for_backward(xq, wq)
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        return _linear(xq, wq, bias, invariant).reshape(*x.shape[:-1], wq.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xq, wq = ctx.saved_tensors
        g2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g2d @ wq).reshape(*grad.shape[:-1], wq.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = (g2d.t() @ xq).to(ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


# Every buffer of a rollout copy: its codes and scales, the dequantized cache, the smoothing factors
ROLLOUT_BUFFERS = ("qweight_data", "qweight_scale", "qweight_global_scale", "weight_dequant", "rollout_smoothing")


class QuantLinear(nn.Module):
    """y = x @ W^T + b with a master weight W [out_features, in_features]; quantized modes via `configure`.

    Attributes after `configure`:
      weight: nn.Parameter [out, in] (the master weight), or None when frozen_base=True dropped it (qlora);
        None (not a 0-size placeholder) so that any code that still reads it fails loudly.
      bias: nn.Parameter [out] or None (kept in full precision, never quantized).
      lora_A: nn.Parameter [r, in] (kaiming-uniform), lora_B: nn.Parameter [out, r] (zeros), or None when r = 0;
        float32 for 16-bit models (small adapter updates would vanish in bf16), cast to the compute dtype in
        the forward. scaling = lora_alpha / r.
      qweight: the rollout copy as a QuantizedTensor (None without rollout_format).
      weight_dequant: buffer [out, in] in the compute dtype caching deq(qweight) (see cache_dequantized).
      rollout: True after set_rollout(True).
    cache_dequantized: True (cache from configure on), False (never), or None (default, automatic): on the
      CPU from configure on (the reference path would otherwise dequantize every forward); on a GPU from
      configure on with `bf16_gemms` (both forwards multiply it), else only once a rollout forward finds no kernel
      for its shape (the kernels read the codes directly, and a cache costs memory), and then never for a frozen
      (qlora) base, whose point is the memory saved.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.rollout = False
        self.cache_dequantized: bool | None = None
        self.rollout_format: str | None = None
        self.train_format: str | None = None
        self.weight_only = False
        self.frozen_base = False
        self.quantized_backward = False
        self.kernel_forward = False
        self.bf16_gemms = False
        # every GEMM on the batch-invariant kernel (`QuarlForCausalLM.set_batch_invariant`), rollout and training
        self.batch_invariant = False
        self.lora_rank = 0
        self.lora_alpha = 0.0
        self.lora_dropout = 0.0
        self.scaling = 0.0
        self.register_parameter("lora_A", None)
        self.register_parameter("lora_B", None)
        for name in ("qweight_data", "qweight_scale", "qweight_global_scale", "weight_dequant"):
            self.register_buffer(name, None)
        # SmoothQuant factors s [in] (float32) of a W8A8 rollout copy: it holds Q(W diag(s)) and the rollout forward
        # quantizes x / s (`quarl.model.smoothing`); None = not smoothed. Derived from calibration, not saved.
        self.register_buffer("rollout_smoothing", None, persistent=False)
        self._qdtypes: tuple[torch.dtype, torch.dtype] | None = None  # (code dtype, scale dtype) of qweight
        self._base_dtype = dtype if dtype is not None else self.weight.dtype
        self._frozen_by_lora = False
        self._settings: dict | None = None
        # Which master weight the rollout copy was quantized from: (a weak reference to the tensor, its version
        # (torch's in-place counter) then); a replaced tensor or an in-place change makes it stale. And the
        # FP8-block codes of a weight that gets no gradient (quantized_backward under LoRA), with their key.
        self._rollout_source: tuple | None = None
        self._frozen_codes: FrozenWeightCodes | None = None
        self._frozen_codes_key: tuple | None = None
        # The adapter as rollouts use it, (A [r, in], B * scaling [out, r]) in the compute dtype (set_rollout);
        # may be views into a `FusedProjection`'s stacked adapters, which set_rollout then rewrites in place.
        self._rollout_adapter: tuple[torch.Tensor, torch.Tensor] | None = None
        # The optional GPU fast paths of the FP8 training linear (`fused_cublas_path`, `fp8_weight_grad_kernel`);
        # a model sets its own on every linear (`QuarlForCausalLM.set_fast_paths`).
        self.fast_paths = DEFAULT_FAST_PATHS

    # ------------------------------------------------------------------------------------------- configuration
    def configure(
        self,
        *,
        rollout_format: str | None = None,
        train_format: str | None = None,
        weight_only: bool = False,
        frozen_base: bool = False,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
        lora_dropout: float = 0.0,
        quantized_backward: bool = False,
        kernel_forward: bool = False,
        bf16_gemms: bool = False,
    ) -> None:
        """Set the precision behaviour (the keyword arguments of `PrecisionConfig.linear_settings()`).

        rollout_format / train_format: a key of `quarl.formats.FORMATS` or None (full precision).
        weight_only: do not quantize activations (W4A16 / W8A16). frozen_base: quantize the base once, drop the
        master weight (qlora); needs rollout_format, and train_format must be None or the same format.
        lora_rank r >= 0, lora_alpha (None -> r), lora_dropout in [0, 1). quantized_backward: with
        train_format="fp8-block" (W8A8, not frozen), the training GEMMs including both gradient GEMMs take FP8-block
        operands (`quarl.model.fp8_training`, Jet-RL). kernel_forward: with train_format set, activations
        quantized and a trainable base (the unified flow, W8A8), the training forward runs the rollout's 8-bit GEMM
        kernel on a GPU (`_kernel_training_forward`), so both multiply the codes exactly (the fp32 sums may run in
        another order for another batch size's plan). bf16_gemms: with a rollout format and a training format or a
        frozen base, without quantized_backward, rollout and training both multiply the dequantized cache
        (`weight_dequant` in the compute dtype, kept for it) with GEMMs in the compute dtype of the fake-quantized
        activations (the activations themselves when weight_only), at every batch size, never a quantized kernel
        (`rollout_avoids_kernel`); it takes precedence over kernel_forward.
        Quantizes the current master weight into the rollout copy (no separate refresh() needed). Calling it
        again replaces the previous configuration (LoRA adapters are re-initialised) — except after
        frozen_base dropped the master weight: then only the LoRA settings may change (the adapters are
        re-initialised on the same quantized base; the identical configuration is a no-op).
        """
        settings = dict(rollout_format=rollout_format, train_format=train_format, weight_only=bool(weight_only),
                        frozen_base=bool(frozen_base), lora_rank=lora_rank, lora_alpha=lora_alpha,
                        lora_dropout=lora_dropout, quantized_backward=bool(quantized_backward),
                        # only a unified (train = rollout format), trainable W8A8 base without quantized_backward
                        # trains on the kernel: off elsewhere, so that settings that differ in it alone are the
                        # same configuration
                        kernel_forward=bool(kernel_forward) and not bf16_gemms and train_format is not None
                        and train_format == rollout_format and not weight_only and not frozen_base
                        and not quantized_backward,
                        # a frozen base keeps it without a training format: a sharded run's rollout copy
                        bf16_gemms=bool(bf16_gemms) and rollout_format is not None and not quantized_backward
                        and (train_format is not None or bool(frozen_base)))
        self._validate(settings)
        if self.weight is None:
            if settings == self._settings:
                return
            if all(settings[k] == self._settings[k] for k in _BASE_SETTINGS):
                self._reset_lora()  # same frozen base, other adapters: only LoRA changes
                self._settings = settings
                self._init_lora(lora_rank, lora_alpha, lora_dropout)
                return
            raise ValueError(
                "this layer's master weight was dropped by configure(frozen_base=True) (qlora), so its base cannot "
                f"be reconfigured to {settings}; load the model again to change its precision"
            )
        self._reset()
        self._settings = settings
        self.rollout_format, self.train_format = rollout_format, train_format
        self.weight_only, self.frozen_base = bool(weight_only), bool(frozen_base)
        self.quantized_backward = bool(quantized_backward)
        self.kernel_forward = settings["kernel_forward"]
        self.bf16_gemms = settings["bf16_gemms"]
        self._base_dtype = self.weight.dtype
        if rollout_format is not None:
            self._allocate_rollout_copy()
        if frozen_base:
            self.weight = None  # the quantized copy is now the base; free the master weight
        self._init_lora(lora_rank, lora_alpha, lora_dropout)

    def _validate(self, s: dict) -> None:
        for key in ("rollout_format", "train_format"):
            if s[key] is not None:
                get_format(s[key])  # raises with the list of valid names
        if s["frozen_base"]:
            if s["rollout_format"] is None:
                raise ValueError("frozen_base=True (qlora) quantizes the base weight, so it needs a rollout_format "
                                 f"(one of {', '.join(FORMATS)})")
            if s["train_format"] not in (None, s["rollout_format"]):
                raise ValueError(
                    f"frozen_base=True keeps one quantized base for rollout and training, but rollout_format="
                    f"{s['rollout_format']!r} and train_format={s['train_format']!r} differ; use the same format"
                )
        if s["quantized_backward"] and (s["train_format"] != "fp8-block" or s["weight_only"] or s["frozen_base"]):
            raise ValueError(
                "quantized_backward=True runs the training GEMMs and both gradient GEMMs in FP8-block, so it needs "
                f"train_format='fp8-block' with activations quantized and a trainable base; got train_format="
                f"{s['train_format']!r}, weight_only={s['weight_only']}, frozen_base={s['frozen_base']} (use "
                "precision.flow=unified with precision.format=fp8-block)"
            )
        r = s["lora_rank"]
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"lora_rank must be an integer >= 0, got {r!r}")
        if r > 0 and s["lora_alpha"] is not None and not s["lora_alpha"] > 0:
            raise ValueError(f"lora_alpha must be > 0 (usually = lora_rank), got {s['lora_alpha']!r}")
        if not 0.0 <= float(s["lora_dropout"]) < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {s['lora_dropout']!r}")

    def _reset(self) -> None:
        """Forget a previous configuration: adapters, rollout buffers, LoRA freezing."""
        self._reset_lora()
        for name in ROLLOUT_BUFFERS:
            setattr(self, name, None)
        self._qdtypes = None
        self._rollout_source = None
        self._frozen_codes = self._frozen_codes_key = None

    def _reset_lora(self) -> None:
        """Drop the adapters and undo the freezing they caused."""
        self.lora_A = None
        self.lora_B = None
        self._rollout_adapter = None
        self.lora_rank, self.lora_alpha, self.scaling, self.lora_dropout = 0, 0.0, 0.0, 0.0
        if self._frozen_by_lora:
            for p in (self.weight, self.bias):
                if p is not None:
                    p.requires_grad_(True)
            self._frozen_by_lora = False

    @torch.no_grad()
    def _allocate_rollout_copy(self) -> None:
        qt = quantize(self.weight.detach().to(self.compute_dtype), self.rollout_format, "weight")
        self._qdtypes = (qt.data.dtype, qt.scale.dtype)
        self._rollout_source = self._weight_state()
        # The rollout copy is derived from the master weight (refresh() rebuilds it), so it is not saved in the
        # state dict — except with a frozen base, where it IS the weight.
        persistent = self.frozen_base
        self.register_buffer("qweight_data", _as_storage(qt.data), persistent=persistent)
        self.register_buffer("qweight_scale", _as_storage(qt.scale), persistent=persistent)
        gs = None if qt.global_scale is None else _as_storage(qt.global_scale)
        self.register_buffer("qweight_global_scale", gs, persistent=persistent)
        cache = self.cache_dequantized
        if cache is None:
            cache = self.weight.device.type == "cpu" or self.rollout_avoids_kernel()
        if cache:
            self._build_dequant_cache()

    @torch.no_grad()
    def _build_dequant_cache(self) -> None:
        """weight_dequant = deq(qweight) in the compute dtype; refresh() keeps it current in place."""
        self.register_buffer("weight_dequant", self.qweight.dequantize(self.compute_dtype), persistent=False)

    def _init_lora(self, rank: int, alpha: float | None, dropout: float) -> None:
        if rank == 0:
            return
        ref = self.qweight_data if self.weight is None else self.weight
        dtype = torch.promote_types(self.compute_dtype, torch.float32)  # fp32 adapters under a bf16 model
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=ref.device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=ref.device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as PEFT: B = 0 makes the adapter a no-op
        self.lora_rank = rank
        self.lora_alpha = float(alpha) if alpha is not None else float(rank)
        self.scaling = self.lora_alpha / rank
        self.lora_dropout = float(dropout)
        for p in (self.weight, self.bias):
            if p is not None and p.requires_grad:
                p.requires_grad_(False)
                self._frozen_by_lora = True

    @torch.no_grad()
    def start_lora_at(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Set the adapters so that the LoRA term adds b @ a (a [r, in], b [out, r], e.g. the base-error correction of
        `quarl.model.lora_init`): lora_A = a, lora_B = b / scaling, in the adapters' dtype and device."""
        if not self.lora_rank:
            raise RuntimeError("start_lora_at needs LoRA adapters (lora.rank > 0 for this linear)")
        if a.shape != self.lora_A.shape or b.shape != self.lora_B.shape:
            raise ValueError(f"start_lora_at: a {tuple(a.shape)} and b {tuple(b.shape)} must be "
                             f"{tuple(self.lora_A.shape)} and {tuple(self.lora_B.shape)}")
        self.lora_A.copy_(a)
        self.lora_B.copy_(b.to(torch.float64) / self.scaling)

    # ------------------------------------------------------------------------------------------- state
    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the base is rounded to before quantization and the dequantized base is kept in."""
        if self.weight is not None:
            return self.weight.dtype
        if self.weight_dequant is not None:
            return self.weight_dequant.dtype
        return self._base_dtype

    @property
    def qweight(self) -> QuantizedTensor | None:
        """The rollout copy [out, in] as a QuantizedTensor viewing this module's buffers (no copy), or None."""
        if self.qweight_data is None:
            return None
        data_dtype, scale_dtype = self._qdtypes
        gs = self.qweight_global_scale
        return QuantizedTensor(
            self.rollout_format, "weight", self.qweight_data.view(data_dtype), self.qweight_scale.view(scale_dtype),
            None if gs is None else gs.view(torch.float32), torch.Size((self.out_features, self.in_features)),
        )

    def set_rollout(self, on: bool) -> None:
        """Rollout forward (quantized rollout copy) when on, training forward when off. Turning it on also
        refreshes the rollout's copy of the LoRA adapter (`add_lora`)."""
        starting = bool(on) and not self.rollout  # the model's set_rollout and rollout_mode both call this
        self.rollout = bool(on)
        if starting and self.lora_rank:
            self._refresh_rollout_adapter()

    def _scaled_lora_B(self, dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
        """B * scaling [out, r] in dtype (the cached rollout copy and the training forward round it alike); copy:
        never the parameter itself, even where scaling is 1 and the dtypes agree."""
        if self.scaling == 1.0:  # alpha = rank, the default: no multiply in the forward or the backward
            return self.lora_B.to(dtype, copy=copy)
        return (self.lora_B * self.scaling).to(dtype)

    @torch.no_grad()
    def _refresh_rollout_adapter(self) -> None:
        """(A, B * scaling) in the compute dtype for the rollout: cast once per rollout instead of in every decode
        step (two to three small kernels per linear per token); rewritten in place, so CUDA graphs captured in an
        earlier rollout read the current adapter."""
        dtype = self.compute_dtype
        a = self.lora_A.detach().to(dtype, copy=True)  # a copy even when the dtypes agree: never the parameter
        b = self._scaled_lora_B(dtype, copy=True).detach()
        old = self._rollout_adapter
        if old is not None and all(o.shape == n.shape and o.dtype == n.dtype and o.device == n.device
                                   for o, n in zip(old, (a, b))):
            old[0].copy_(a)
            old[1].copy_(b)
        else:
            self._rollout_adapter = (a, b)

    @torch.no_grad()
    def refresh(self, only_if_changed: bool = False) -> None:
        """Re-quantize the master weight into the rollout copy in place (same buffers): the per-step sync.

        Quantizes the master values as rounded to the compute dtype (BRIEF §7: both sides must see the same
        bf16-rounded values). No-op without a rollout format and for a frozen (qlora) base. only_if_changed (the
        trainer's sync): also a no-op for a weight that gets no gradient (a base frozen under LoRA) and has not
        changed in place since its last quantization (torch's version counter); a trained weight is always
        re-quantized. A write through `.data` is invisible to the counter: call refresh() without the flag then.
        """
        w = self.weight
        if only_if_changed and w is not None and not w.requires_grad and self._rollout_copy_current():
            return
        self._frozen_codes_key = None  # a write through .data bypasses the version counter: refresh sees it
        if self.qweight_data is None or self.frozen_base:
            return
        self.requantize_rollout_copy()
        self.mark_rollout_copy_current()

    def _smoothed(self, w: torch.Tensor) -> torch.Tensor:
        """w [out, in] (compute dtype) times the smoothing factors per input channel (in float32 or wider, rounded
        once) when the rollout copy is smoothed, else w."""
        s = self.rollout_smoothing
        if s is None:
            return w
        # one kernel: the product is computed in the promoted dtype (float32 or wider) and rounded into w's dtype
        return torch.mul(w, s, out=torch.empty_like(w))

    @property
    def trained_rollout_copy(self) -> bool:
        """Whether this linear has a rollout copy of a weight being trained: what every sync re-quantizes."""
        w = self._parameters.get("weight")  # the dicts themselves: a sync asks every linear, every step
        return w is not None and w.requires_grad and not self.frozen_base and \
            self._buffers.get("qweight_data") is not None

    def requantize_rollout_copy(self) -> None:
        """The device work of `refresh`: quantize the master weight (rounded to the compute dtype; times the
        smoothing factors per input channel, rounded again, when smoothed) into the rollout copy and its
        dequantized cache, in place, without the bookkeeping. The GPU paths make no host synchronisation, so
        `quarl.model.rollout_sync.RolloutSync` can capture it in a CUDA graph."""
        qt = self._quantize_into_rollout_copy(self._smoothed(self.weight.detach().to(self.compute_dtype)))
        self._refresh_dequant_cache(qt)

    def _refresh_dequant_cache(self, qt: QuantizedTensor) -> None:
        """Write the dequantized rollout copy `qt` ([out, in]) into the dequantized cache (`weight_dequant` [out, in]
        in the compute dtype), when there is one: one GPU kernel straight into the cache where
        `kernels.try_dequantize` has one, else the reference and a copy."""
        cache = self.weight_dequant
        if cache is not None and kernels.try_dequantize(qt, cache.dtype, out=cache) is None:
            cache.copy_(qt.dequantize(cache.dtype))

    @property
    def smoothable(self) -> bool:
        """Whether activation smoothing applies (`set_rollout_smoothing`): a master weight (trained, or frozen under
        LoRA) with a rollout copy whose activations are quantized, which training does not quantize (the split
        flow)."""
        return (self.weight is not None and self.rollout_format is not None and not self.weight_only
                and not self.frozen_base and self.train_format is None)

    @torch.no_grad()
    def set_rollout_smoothing(self, factors: torch.Tensor | None) -> None:
        """Smooth the rollout copy with SmoothQuant factors s (float32 [in_features], > 0; None = stop): the copy
        becomes Q(W diag(s)), re-quantized now and at every sync, and the rollout forward quantizes x / s."""
        if factors is not None:
            if not self.smoothable:
                raise ValueError("activation smoothing needs a trainable weight with a W8A8 rollout copy that "
                                 "training leaves unquantized (precision.flow=split, activations quantized)")
            factors = factors.detach().to(device=self.weight.device, dtype=torch.float32).reshape(-1)
            if factors.numel() != self.in_features or not bool(torch.isfinite(factors).all()) or \
                    not bool((factors > 0).all()):
                raise ValueError(f"smoothing factors must be {self.in_features} finite values > 0")
        self.rollout_smoothing = factors
        if self.qweight_data is not None:
            self.refresh()

    def smooth_input(self, x: torch.Tensor) -> torch.Tensor:
        """x / s (`divided`) when the rollout copy is smoothed, else x."""
        return divided(x, self.rollout_smoothing)

    def mark_rollout_copy_current(self) -> None:
        """Record that the rollout copy now holds the master weight as it is (after `requantize_rollout_copy`)."""
        # straight into the instance dict: nn.Module.__setattr__ checks parameters, buffers and submodules first,
        # which a per-step sync of hundreds of linears pays in host time (both are plain attributes)
        w = self._parameters["weight"]
        self.__dict__["_frozen_codes_key"] = None
        self.__dict__["_rollout_source"] = (weakref.ref(w), w._version)

    def _quantize_into_rollout_copy(self, w: torch.Tensor) -> QuantizedTensor:
        """Quantize w [out, in] into the rollout copy's buffers (in place) and return the copy. One Triton pass on
        a GPU where `kernels.try_quantize_weight` has one (the same codes as the reference), else the reference
        without its NaN/Inf scan: the scan costs a device synchronisation per linear, hundreds per sync, and a
        non-finite master weight is the optimizer's failure, not the quantizer's."""
        out = self.qweight
        if out.global_scale is None and kernels.try_quantize_weight(w, self.rollout_format,
                                                                     out=(out.data, out.scale)) is not None:
            return out  # quantized straight into the copy's buffers
        fresh = _quantize_weight(w, self.rollout_format)
        if fresh.data.dtype != out.data.dtype or fresh.scale.numel() != out.scale.numel():
            raise RuntimeError(f"{self.rollout_format} weight quantizer returned codes {fresh.data.dtype} and "
                               f"{fresh.scale.numel()} scales; the rollout copy holds {out.data.dtype} and "
                               f"{out.scale.numel()}")
        _copy_quantized(out, fresh)
        return out

    @torch.no_grad()
    def load_frozen_base(self, w: torch.Tensor) -> None:
        """Quantize w [out, in] (any float dtype, rounded to the compute dtype first; times the smoothing factors
        when smoothed) into a frozen base, in place: how a rollout-only copy whose master weight lives elsewhere (a
        sharded trainer) takes each update."""
        if not self.frozen_base:
            raise RuntimeError("load_frozen_base needs a frozen base (configure(frozen_base=True))")
        qt = self._quantize_into_rollout_copy(self._smoothed(w.to(self.compute_dtype)))
        self._refresh_dequant_cache(qt)

    @torch.no_grad()
    def load_frozen_base_codes(self, qt: QuantizedTensor) -> None:
        """Make the frozen base exactly `qt` (a weight QuantizedTensor [out, in] in the base's format and layout,
        e.g. from `quarl.model.gptq`): its codes and scales are copied into the base's buffers, and the
        dequantized cache follows."""
        if not self.frozen_base:
            raise RuntimeError("load_frozen_base_codes needs a frozen base (configure(frozen_base=True))")
        out = self.qweight
        if qt.fmt != out.fmt or qt.role != "weight" or tuple(qt.shape) != tuple(out.shape) or \
                any((a is None) != (b is None) or (a is not None and (a.shape != b.shape or a.dtype != b.dtype))
                    for a, b in ((qt.data, out.data), (qt.scale, out.scale), (qt.global_scale, out.global_scale))):
            raise ValueError(f"codes for this frozen base must be a {out.fmt} weight {tuple(out.shape)} in its layout "
                             f"(data {tuple(out.data.shape)} {out.data.dtype}), got {qt.fmt} {qt.role} "
                             f"{tuple(qt.shape)} (data {tuple(qt.data.shape)} {qt.data.dtype})")
        _copy_quantized(out, qt)
        self._frozen_codes_key = None
        self._refresh_dequant_cache(out)

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The base weight [out, in] the training forward uses, detached: the master weight, or for a frozen
        base the dequantized quantized base. dtype: default the compute dtype."""
        dtype = dtype or self.compute_dtype
        if self.weight is not None:
            return self.weight.detach().to(dtype)
        return self._dequantized_base(dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """Full-precision weight [out, in] (compute dtype) of an equivalent plain linear: base + scaling * B @ A.

        The base is the master weight, or the dequantized base when frozen_base dropped it (qlora).
        """
        w = self.base_weight(torch.float32)
        if self.lora_rank:
            w = w + self.scaling * (self.lora_B.float() @ self.lora_A.float())
        return w.to(self.compute_dtype)

    def _dequantized_base(self, dtype: torch.dtype) -> torch.Tensor:
        """deq(qweight) [out, in] in dtype, from the cache when there is one."""
        if self.weight_dequant is not None:
            w = self.weight_dequant
            return w if w.dtype == dtype else w.to(dtype)
        return kernels.dequantize(self.qweight, dtype)

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] in x.dtype (see the module docstring for the modes)."""
        y = self.base_forward(x)
        if self.lora_rank:
            y = self.add_lora(y, x)
        return y

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` without the LoRA term: x [..., in_features] -> [..., out_features] in x.dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear expects inputs [..., {self.in_features}], got shape {tuple(x.shape)}")
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        if self.rollout and self.rollout_format is not None:
            return self._rollout_forward(x, bias)
        if self.train_format is not None:
            return self._quantized_training_forward(x, bias)
        if self.frozen_base:
            return self._frozen_base_linear(x, bias)
        return _linear(x, self.weight, bias, self.batch_invariant)

    def _rollout_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Q_act(x) @ deq(qweight)^T + b: a GPU kernel when one applies, else the reference (dequant + matmul).

        No gradient reaches the master weight here (the rollout copy is a buffer); the kernels have no
        backward, so they are skipped when autograd needs the input's gradient.
        """
        x2d = self.smooth_input(x.reshape(-1, self.in_features))
        y = None
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
        if not needs_grad and not self.rollout_avoids_kernel():
            # A frozen base has no bf16 weight to fall back on (the fallback would dequantize the whole weight
            # every call), so it takes the quantized kernel even where the tuning table prefers a bf16 GEMM; so does
            # a unified linear whose training forward runs the kernel (`kernel_forward`): the bf16 fallback rounds
            # each dequantized operand to bf16, which the kernel never does, and rollout and training must multiply
            # the same values at every batch size.
            matmul = kernels.quantized_matmul if self.rollout_needs_kernel() else kernels.try_quantized_matmul
            y = matmul(x2d, self.qweight, self.weight_only, bias)
        if y is None:
            xq = x2d if self.weight_only else _straight_through(fake_quantized_input(x2d, self.rollout_format), x2d)
            if self.weight_dequant is None and self.cache_dequantized is None and not self.frozen_base:
                self._build_dequant_cache()  # no kernel serves this layer: keep the fallback at matmul speed
            y = _linear(xq, self._dequantized_base(x.dtype), bias, self.batch_invariant)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _quantized_training_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Unified / qlora training forward: the rollout values, straight-through gradients (Jet-RL)."""
        fmt = self.train_format
        if self.quantized_backward:
            return fp8_block_linear(x, self.weight, bias, self._frozen_fp8_codes(x.dtype), self.fast_paths)
        if self.kernel_forward:
            y = self._kernel_training_forward(x, bias)
            if y is not None:
                return y
        if self.frozen_base:
            if not self.weight_only:
                x = _straight_through(fake_quantized_input(x.detach(), fmt), x)
            return self._frozen_base_linear(x, bias)
        return _FakeQuantLinear.apply(x, self.weight, bias, self._fake_quantized_weight(x.dtype),
                                      None if self.weight_only else fmt, self.batch_invariant)

    def _fake_quantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """Q(W) [out, in] in dtype, the unified training forward's weight operand without gradient: the rollout
        copy's dequantized cache itself where it holds the master weight as it is now in this dtype and device
        (re-quantized in place first when an optimizer step made it stale, once per step rather than in every
        micro-batch), so that training multiplies exactly what the rollout multiplies; else Q(W) made now. A
        stacked rollout copy (the fast engine's q/k/v and gate/up share one buffer) must instead be refreshed whole
        after an optimizer step (`refresh_rollout_weights`, as the trainer does): re-quantizing one part here
        changes the version of the parts' operands saved for backward."""
        cache = self.weight_dequant
        if cache is not None and cache.dtype == dtype and cache.device == self.weight.device and \
                self.train_format == self.rollout_format:
            if not self._rollout_copy_current():
                with torch.no_grad():
                    self.refresh()
            return cache
        return kernels.fake_quantize_weight(self.weight.detach(), self.train_format).to(dtype)

    def rollout_needs_kernel(self) -> bool:
        """Whether the rollout forward takes the quantized kernel even where the tuning table prefers a bf16 GEMM of
        the dequantized weight: a frozen (qlora) base without `bf16_gemms`, and a unified linear that trains on the
        kernel (`kernel_forward`)."""
        return (self.frozen_base or self.kernel_forward) and not self.bf16_gemms

    def rollout_avoids_kernel(self) -> bool:
        """Whether the rollout forward never takes the quantized kernel (`bf16_gemms`): a unified linear or a frozen
        base whose training forward multiplies bf16 GEMMs of the fake-quantized values takes those in the rollout
        too, at every batch size, from its dequantized cache, so that both forwards multiply the same operands."""
        return self.bf16_gemms

    def _current_rollout_copy(self, fmt: str) -> QuantizedTensor | None:
        """The rollout copy when it holds the master weight as it is now, in `fmt`, on the weight's device (the
        step's sync made it and no optimizer step followed); else None."""
        if self.qweight_data is None or self.rollout_format != fmt or not self._rollout_copy_current() or \
                self.qweight_data.device != self.weight.device:
            return None
        return self.qweight

    def _kernel_training_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The unified W8A8 training forward on the rollout's kernel: Q(x) @ Q(W)^T (+ b) [..., out] in x.dtype by
        `kernels.quantized_matmul`, with the straight-through gradients of the fake-quantized path
        (`_KernelLinear`); None where no kernel applies (CPU, no Triton, float32 compute, FP8 before compute
        capability 8.9): the caller then takes bf16 GEMMs of the fake-quantized operands, as the rollout forward
        does there. Q(W) is the rollout copy, re-quantized in place first when an optimizer step made it stale;
        without a rollout copy on this device, the weight quantized now."""
        x2d = x.reshape(-1, self.in_features)
        # checked before quantizing the weight, which would be wasted work without a kernel
        needs_fp8 = get_format(self.train_format).needs_fp8_hardware
        available = kernels.fp8_kernels_available if needs_fp8 else kernels.kernels_available
        if x2d.dtype != self.compute_dtype or x2d.dtype not in (torch.bfloat16, torch.float16) or \
                not available(x2d.device):
            if x2d.is_cuda:
                report_fallback("unified kernel forward", f"no {self.train_format} kernel for {x2d.dtype} on this "
                                "GPU; rollout and training forwards both take bf16 GEMMs of the fake-quantized "
                                "values")
            return None
        # configure() set kernel_forward only for a trainable base whose rollout copy has the training format
        if self.qweight_data is not None and self.qweight_data.device == self.weight.device == x2d.device:
            if not self._rollout_copy_current():
                # an optimizer step since the sync (several mini-batches per batch): re-quantize into the rollout
                # copy, once per optimizer step rather than in every micro-batch, and no second copy for backward
                with torch.no_grad():
                    self.refresh()
            qweight = self.qweight
        else:  # no rollout copy here (many ranks: the rollout copy is a separate model)
            qweight = _quantize_weight(self.weight.detach().to(self.compute_dtype), self.train_format)
        with torch.no_grad():
            y = kernels.quantized_matmul(x2d.detach(), qweight, False,
                                         None if bias is None else bias.detach())
        if y is None:
            report_fallback("unified kernel forward", f"no {self.train_format} kernel plan for a [{x2d.shape[0]}, "
                            f"{self.in_features}] x [{self.out_features}, {self.in_features}] GEMM; rollout and "
                            "training forwards both take bf16 GEMMs of the fake-quantized values there")
            return None
        y = _KernelLinear.apply(y, x2d, self.weight, bias, qweight)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _frozen_fp8_codes(self, dtype: torch.dtype) -> FrozenWeightCodes | None:
        """For quantized_backward with a weight that gets no gradient (frozen under LoRA): its FP8-block codes,
        Q(W) [N, K] and Q(W^T) [K, N] from the weight rounded to dtype, quantized once instead of in every forward
        and backward; None when the weight trains or dtype is not the compute dtype. Q(W) is the rollout copy
        itself while that is current (same codes, no second copy); Q(W^T) is kept on the module (N*K bytes, not
        in the state dict, dropped when the module moves or converts). Both are rebuilt when the weight is replaced,
        changes in place (torch's version counter) or moves, and after `refresh()` (which also covers writes
        through `.data`, invisible to the version counter)."""
        w = self.weight
        if w.requires_grad or dtype != self.compute_dtype:
            self._frozen_codes = self._frozen_codes_key = None  # e.g. unfrozen since: free the N*K bytes
            return None
        if not self._same_state(self._frozen_codes_key, w.data_ptr(), dtype):
            forward = self._current_rollout_copy(fp8_training.FORMAT)
            if forward is None:
                forward = fp8_training.quantized_weight(w, dtype)
            self._frozen_codes = FrozenWeightCodes(forward, fp8_training.quantized_weight(w, dtype, transpose=True))
            self._frozen_codes_key = self._weight_state(w.data_ptr(), dtype)
        return self._frozen_codes

    def _weight_state(self, *extra) -> tuple:
        """(weak reference to the master weight tensor, its version, *extra); compare with `_same_state`.
        (Versions alone are per tensor: a replacement weight, e.g. load_state_dict(assign=True), starts at the
        version the old one may have had.)"""
        return (weakref.ref(self.weight), self.weight._version, *extra)

    def _same_state(self, saved: tuple | None, *extra) -> bool:
        """Whether `saved` (from `_weight_state(*extra)`) describes the master weight as it is now: the same
        tensor object (compared by identity: == on tensors is elementwise), unchanged in place, same extras."""
        now = self._weight_state(*extra)
        return saved is not None and saved[0]() is self.weight and saved[1:] == now[1:]

    def _rollout_copy_current(self) -> bool:
        """Whether the rollout copy was quantized from the master weight as it is now."""
        return self.weight is not None and self._same_state(self._rollout_source)

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() / .half(): drop the frozen-weight FP8 codes (a plain attribute, not a buffer, so they
        # would stay behind on the old device); the next training forward rebuilds them.
        self._frozen_codes = self._frozen_codes_key = None
        smoothing = self.rollout_smoothing
        out = super()._apply(fn, recurse)
        if smoothing is not None and self.rollout_smoothing.dtype != torch.float32:  # s stays float32 (the copy's)
            self.rollout_smoothing = smoothing.to(self.rollout_smoothing.device, torch.float32)
        return out

    def _frozen_base_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ deq(base)^T + b; under autograd without keeping deq(base) alive until backward."""
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
        if not needs_grad or self.weight_dequant is not None:  # a cached dequantized base costs nothing to keep
            return _linear(x, self._dequantized_base(x.dtype), bias, self.batch_invariant)
        return _FrozenBaseLinear.apply(x, bias, self)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """y + dropout(x) @ A^T @ B^T * scaling for y [..., out_features] and x [..., in_features] (x.dtype);
        in_place (y 2-D, e.g. a column slice of a stacked output; meant for the rollout, though autograd records
        it too): accumulated into y itself.

        The adapter's output is accumulated into y by the second GEMM's epilogue (addmm, beta = 1), with the
        scaling folded into B ([out, r] values, not [M, out]): no elementwise pass over the [M, out] output in the
        forward or the backward, where `y + lora(x) * scaling` takes two forward and one backward. Dropout only
        in training (never in rollout: the behaviour policy must be the deterministic adapter)."""
        cached = self._rollout_adapter if self.rollout else None
        # The rollout's copies hold the same values as the casts below, made when the rollout began.
        use_cached = cached is not None and cached[0].dtype == x.dtype and cached[0].device == x.device and \
            not torch.is_grad_enabled()
        b = cached[1] if use_cached else self._scaled_lora_B(x.dtype)  # [out, r]
        a = cached[0] if use_cached else self.lora_A.to(x.dtype)  # [r, in]
        p = self.lora_dropout_p()
        h = F.dropout(x, p, training=True) if p > 0 else x
        if self.batch_invariant:  # the same two roundings as addmm's: xa, then y + xa @ b^T
            from quarl.kernels import batch_invariant

            xa = batch_invariant.linear(h.reshape(-1, self.in_features), a)
            out = batch_invariant.linear(xa, b, add=y.reshape(-1, self.out_features))
            return y.copy_(out) if in_place else out.reshape(y.shape)
        xa = F.linear(h.reshape(-1, self.in_features), a)  # [M, r]
        if in_place:
            return y.addmm_(xa, b.t())
        return torch.addmm(y.reshape(-1, self.out_features), xa, b.t()).reshape(y.shape)

    def lora_dropout_p(self) -> float:
        """The adapter's dropout probability now: lora_dropout in training, 0 in eval and in rollout (the behaviour
        policy must be the deterministic adapter)."""
        return self.lora_dropout if (self.training and not self.rollout) else 0.0

    def extra_repr(self) -> str:
        parts = [f"in_features={self.in_features}", f"out_features={self.out_features}",
                 f"bias={self.bias is not None}", f"rollout={self.rollout_format or 'full'}",
                 f"train={self.train_format or 'full'}"]
        if self.weight_only:
            parts.append("weight_only=True")
        if self.frozen_base:
            parts.append("frozen_base=True")
        if self.lora_rank:
            parts.append(f"lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha:g}")
        return ", ".join(parts)
