"""The fast engine's decode step on fused projections and fused kernels: what each decoder layer's own forward
calls in a decode step whose cache carries a `FusedDecoder` (`DecoderLayer.forward` -> `FusedDecoder.layer`; the
model's layer loop, embeddings, rotary tables, final norm and head are the same as in training and the reference
engine). The same math with fewer, larger kernels (on a CPU the same values; on a GPU the stacked GEMMs may take
another cuBLAS algorithm than the per-projection ones, which rounds bf16 outputs differently, and the norm's mean
square sums in another order):
  - q/k/v and gate/up each run as one GEMM over their concatenated rollout weights (`FusedProjection`);
  - residual add + RMSNorm (+ the next linear's 8-bit activation quantization), rotary embedding of q and k, and
    SiLU·mul (+ quantization) are one kernel each (`quarl.kernels.decode_fused`); a layer's MLP output is added
    by the next layer's first norm kernel (the last layer's before the model's final norm).
Where the next linear's 8-bit GEMM takes codes (`kernels.codes_handoff`: cuBLAS FP8 rowwise, or fp8-block with K
a multiple of 512, or an int8 / fp8 W8A8 Triton GEMM or GEMV on prequantized codes), the norm or SiLU·mul kernel
hands it the activation codes and scales (per token, or per 1x128 group) directly, so no separate quantization
pass reads the activations again. The codes are those `quarl.formats` makes from the kernel's bf16 output (divided
by the linear's SmoothQuant factors when it is smoothed, as the linear divides its input), so the GEMM computes
what it would have computed from the bf16 activations.

On a CPU, or where a kernel does not apply, every piece has a PyTorch definition with the modules' exact math;
the fast engine takes the fused decoder when `fused_decode_supported(model)`, and tests hold the decode step with
it equal to the one without (`both_decode_logits`).

Two optional paths come from a `quarl.fast_paths.FastPaths` (the engine's, handed over by `FusedDecoder.prepare`):
`lora_codes_handoff`: with LoRA adapters, the fused norm / SiLU·mul kernels still hand 8-bit codes to the base GEMM
and also write the bf16 activations for the adapters (off: linears with adapters take the bf16 activations);
`stack_rollout_lora`: q/k/v's and gate/up's rollout adapters run as one stacked pair of GEMMs (`FusedProjection`;
off: one GEMM pair per linear). A captured CUDA graph keeps the paths it was captured with, which is why the engine
keys its graphs by them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quarl import kernels
from quarl.fast_paths import DEFAULT as DEFAULT_FAST_PATHS, FastPaths
from quarl.model.layers import apply_rope
from quarl.model.qlinear import QuantLinear, divided

_QBUFFERS = ("qweight_data", "qweight_scale", "weight_dequant")


def _refuse_inside_capture(what: str) -> None:
    """Raise if a CUDA graph is being captured: `what` moves or allocates buffers, which a graph must not see."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what} must run before CUDA-graph capture, not inside it")


class FusedProjection:
    """Linears that read one input ([M, K]) computed as one GEMM: y = [p(x) for p in parts] concatenated.

    When the parts' rollout weights can be stacked along the output dimension (same format, no per-tensor scale,
    whole fp8-block tiles), their buffers are moved into one concatenated buffer and each part's buffers become
    row views of it: no second copy, and `QuantLinear.refresh` (the per-step sync) updates the fused weight in
    place. Otherwise (full-precision parts, nvfp4's per-tensor global scale) the parts run one after another.
    Stacking happens at construction and in `prepare()` (after a reconfiguration replaced the parts' buffers),
    never inside a forward, so a captured CUDA graph never contains it.

    With `fast_paths.stack_rollout_lora`, LoRA adapters in rollout are stacked the same way by `prepare()`:
    A = [A_1; A_2; ...] [R, K] and a block-diagonal B [sum N, R] (zeros off each part's block; R = the summed
    ranks), whose blocks become the parts' rollout adapter copies. `QuantLinear.set_rollout` rewrites those copies
    in place at each rollout start, so the stacked pair is current without re-stacking, and the adapters of the
    whole group cost two GEMMs (x @ A^T, then y += (x A^T) @ B^T) instead of two per part: fewer, larger launches.

    fast_paths: a `FastPaths` (`stack_rollout_lora`, `lora_codes_handoff`); its `FusedDecoder` sets it.
    """

    def __init__(self, parts: list[QuantLinear], fast_paths: FastPaths = DEFAULT_FAST_PATHS):
        self.parts = parts
        self.fast_paths = fast_paths
        self.sizes = [p.out_features for p in parts]
        self.column_starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]  # of each part in the output
        self._fused: dict[str, torch.Tensor] | None = None
        self._adapter: tuple[torch.Tensor, torch.Tensor] | None = None  # stacked (A [R, K], block-diagonal B)
        self._fuse()

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    # -------------------------------------------------------------------------------------- building
    def _stackable(self) -> bool:
        first = self.parts[0]
        fmt = first.rollout_format
        if fmt is None or any(
                p.rollout_format != fmt or p.weight_only != first.weight_only or p.in_features != first.in_features
                or p.qweight_data is None or p.qweight_global_scale is not None or p.qweight_scale.dim() != 2
                or not _same_smoothing(p, first)  # one input: one x / s for all parts
                for p in self.parts):
            return False
        if fmt == "fp8-block":
            return all(p.out_features % 128 == 0 for p in self.parts)
        # one scale row per output row (int8 / fp8 rowwise) or per output row with K-groups (mxfp4)
        return all(p.qweight_scale.shape[0] == p.out_features for p in self.parts)

    def _views_current(self) -> bool:
        """Whether every part's buffers are still the row views made by `_fuse` (a reconfigure replaces them)."""
        if self._fused is None:
            return False
        for p, start in zip(self.parts, self._starts):
            for name in _QBUFFERS:
                buf, fused = getattr(p, name), self._fused.get(name)
                if (buf is None) != (fused is None):
                    return False
                if buf is not None and buf.data_ptr() != fused[start[name]:].data_ptr():
                    return False
        return True

    @torch.no_grad()
    def _fuse(self) -> None:
        self._fused = None
        if not self._stackable():
            return
        fused, self._starts = {}, [dict() for _ in self.parts]
        caches = [p.weight_dequant for p in self.parts if p.weight_dequant is not None]
        for name in _QBUFFERS:
            bufs = [getattr(p, name) for p in self.parts]
            if name == "weight_dequant" and len(caches) != len(self.parts):
                continue  # only some parts built their fallback cache: one stacked cache for all, below
            fused[name] = torch.cat(bufs, dim=0)
            row = 0
            for p, start, buf in zip(self.parts, self._starts, bufs):
                start[name] = row
                persistent = name not in p._non_persistent_buffers_set  # keep each buffer's state-dict role
                p.register_buffer(name, fused[name][row:row + buf.shape[0]], persistent=persistent)
                row += buf.shape[0]
        self._fused = fused
        if caches and "weight_dequant" not in fused:
            self._build_dequant_cache(caches[0].dtype)

    @torch.no_grad()
    def _build_dequant_cache(self, dtype: torch.dtype) -> None:
        """A stacked deq(weight) cache in dtype whose row views become the parts' `weight_dequant` (which
        `QuantLinear.refresh` keeps current), like the cache each part would build for its own fallback."""
        qw = self._stacked_qweight()
        self._fused["weight_dequant"] = kernels.dequantize(qw, dtype)
        row = 0
        for p, start, n in zip(self.parts, self._starts, self.sizes):
            start["weight_dequant"] = row
            p.register_buffer("weight_dequant", self._fused["weight_dequant"][row:row + n], persistent=False)
            row += n

    # -------------------------------------------------------------------------------------- forward
    def prepare(self) -> bool:
        """Re-stack the parts if a reconfiguration (or a part's own fallback cache) replaced their buffers since,
        dropping the old stacked buffers first, and stack the rollout adapters unless current (`_stack_adapters`).
        Not during CUDA-graph capture. Returns whether anything moved: the parts' weight buffers, or their rollout
        adapter copies (parts whose weights cannot be stacked keep their own buffers, which moves nothing).
        Run it after the parts entered rollout mode (their adapter copies exist only then)."""
        moved = self._stack_adapters()
        if self._views_current() or (self._fused is None and not self._stackable()):
            return moved
        _refuse_inside_capture("FusedProjection.prepare()")
        was_stacked = self._fused is not None
        self._fused = None
        self._fuse()
        return moved or was_stacked or self._fused is not None

    @property
    def fused_qweight(self):
        """The concatenated rollout weight as a QuantizedTensor [sum N, K]; None when the parts run apart (not
        stackable, not in rollout mode, their buffers changed since the last `prepare()`, or their smoothing factors
        no longer shared)."""
        if not self._views_current() or not all(p.rollout and _same_smoothing(p, self.parts[0]) for p in self.parts):
            return None
        return self._stacked_qweight()

    def _stacked_qweight(self):
        from quarl.formats import QuantizedTensor

        p = self.parts[0]
        data_dtype, scale_dtype = p._qdtypes
        return QuantizedTensor(p.rollout_format, "weight", self._fused["qweight_data"].view(data_dtype),
                               self._fused["qweight_scale"].view(scale_dtype), None,
                               torch.Size((sum(self.sizes), p.in_features)))

    @property
    def has_bias(self) -> bool:
        return any(p.bias is not None for p in self.parts)

    def _bias(self, dtype: torch.dtype, device) -> torch.Tensor | None:
        if not self.has_bias:
            return None
        return torch.cat([p.bias.to(dtype) if p.bias is not None else torch.zeros(n, dtype=dtype, device=device)
                          for p, n in zip(self.parts, self.sizes)])

    def codes_handoff(self, m: int) -> str | None:
        """"int8" / "fp8" (per-token codes) or "fp8-block" (1x128 groups) when the fused GEMM at m rows can take
        activation codes directly (see `kernels.codes_handoff`), else None (it wants the bf16 activations)."""
        qw = self.fused_qweight
        if qw is None or (self.has_lora and not self.fast_paths.lora_codes_handoff):
            return None
        return qw.fmt if _handoff(qw, self.parts[0], m) else None

    @property
    def smoothing(self) -> torch.Tensor | None:
        """The parts' shared SmoothQuant factors (float32 [K]; `fused_qweight` is None unless they share them), or
        None: the handed codes must be those of x / s."""
        return self.parts[0].rollout_smoothing

    @property
    def has_lora(self) -> bool:
        """Whether any part has a LoRA adapter (which reads the bf16 activations, not the codes)."""
        return any(p.lora_rank for p in self.parts)

    def __call__(self, x: torch.Tensor | None, codes: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """x [M, K] (compute dtype; may be None when codes are given), codes (int8 / float8 [M, K], float32 scales
        [M, 1] or, fp8-block, [M, K/128]) from a fused norm when `codes_handoff(M)` said so -> [M, sum N] in the
        compute dtype."""
        qw = self.fused_qweight
        if qw is None:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        ref = x if x is not None else codes[0]
        dtype = x.dtype if x is not None else self.parts[0].compute_dtype
        bias = self._bias(dtype, ref.device)
        if codes is not None:
            y = kernels.matmul_from_codes(codes[0], codes[1], qw, bias, dtype)
            if self.has_lora:
                if x is None:
                    raise ValueError("FusedProjection with LoRA adapters needs the activations x along with the codes")
                y = self._add_lora(y, x)
            return y
        p0 = self.parts[0]
        x_in, x = x, p0.smooth_input(x)  # the adapters read the activations themselves
        # as QuantLinear._rollout_forward: a frozen (qlora) base, and a unified linear training on the kernel, take
        # the quantized kernel even where bf16 won; a linear on bf16 GEMMs (unified or qlora, `bf16_gemms`) never
        matmul = kernels.quantized_matmul if p0.rollout_needs_kernel() else kernels.try_quantized_matmul
        y = matmul(x, qw, p0.weight_only, bias) if x.is_cuda and not p0.rollout_avoids_kernel() else None
        if y is None:
            if "weight_dequant" not in self._fused:
                if p0.rollout_needs_kernel() or (torch.cuda.is_available() and
                                                 torch.cuda.is_current_stream_capturing()):
                    return torch.cat([p(x_in) for p in self.parts], dim=-1)  # each part smooths its own input
                self._build_dequant_cache(dtype)  # no kernel serves the stacked shape: keep bf16 GEMM speed
            xq = x if p0.weight_only else kernels.fake_quantize_activation(x, p0.rollout_format)
            y = F.linear(xq, self._fused["weight_dequant"].to(dtype), bias)
        if self.has_lora:
            y = self._add_lora(y, x_in)
        return y

    def _add_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [M, sum N] with each part's adapter term (of x [M, K]) added to its columns."""
        if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
            return torch.cat([p.add_lora(y[:, start:start + n], x) if p.lora_rank else y[:, start:start + n]
                              for p, start, n in zip(self.parts, self.column_starts, self.sizes)], dim=-1)
        if self.fast_paths.stack_rollout_lora and not torch.is_grad_enabled() and self._adapters_current() and \
                self._adapter[0].dtype == x.dtype and self._adapter[0].device == x.device:  # as add_lora's cache
            a, b = self._adapter  # every part's adapter in two GEMMs, B's zero blocks adding nothing
            return y.addmm_(F.linear(x, a), b.t())
        for p, start, n in zip(self.parts, self.column_starts, self.sizes):  # rollout: into its columns, in place
            if p.lora_rank:
                p.add_lora(y[:, start:start + n], x, in_place=True)
        return y

    def _adapter_blocks(self):
        """[(part, row offset in A, column start in y)] of the parts with an adapter."""
        blocks, row = [], 0
        for p, start in zip(self.parts, self.column_starts):
            if p.lora_rank:
                blocks.append((p, row, start))
                row += p.lora_rank
        return blocks

    def _adapters_current(self) -> bool:
        """Whether the stacked adapter pair is current: built, and every part in rollout mode with its rollout
        adapter copy still the block view `_stack_adapters` gave it (a new adapter or rank replaces it)."""
        blocks = self._adapter_blocks()
        if self._adapter is None or not blocks:
            return False
        a, b = self._adapter
        if a.shape[0] != sum(p.lora_rank for p, _, _ in blocks):
            return False
        for p, row, start in blocks:
            own = p._rollout_adapter
            if not p.rollout or own is None or own[0].data_ptr() != a[row:].data_ptr() or \
                    own[1].data_ptr() != b[start:, row:].data_ptr():
                return False
        return True

    @torch.no_grad()
    def _stack_adapters(self) -> bool:
        """Stack the parts' rollout adapter copies (see the class docstring) unless current; returns whether it
        re-stacked (moved the parts' adapter copies). Needs every part with an adapter in rollout mode (its copy
        made); otherwise the parts keep their own copies and add one by one."""
        blocks = self._adapter_blocks()
        if not blocks:
            self._adapter = None  # no adapter left (removed): free the stack
            return False
        copies = [p._rollout_adapter for p, _, _ in blocks]
        if not self.fast_paths.stack_rollout_lora or self._adapters_current() or \
                any(not p.rollout for p, _, _ in blocks) or any(c is None for c in copies) or \
                len({(t.dtype, t.device) for c in copies for t in c}) != 1:  # one stack needs one dtype, device
            return False
        _refuse_inside_capture("FusedProjection.prepare()")
        a0 = copies[0][0]
        rank = sum(p.lora_rank for p, _, _ in blocks)
        a = a0.new_empty((rank, self.in_features))
        b = a0.new_zeros((sum(self.sizes), rank))
        for p, row, start in blocks:
            own_a, own_b = p._rollout_adapter
            a[row:row + p.lora_rank].copy_(own_a)
            b[start:start + p.out_features, row:row + p.lora_rank].copy_(own_b)
            p._rollout_adapter = (a[row:row + p.lora_rank], b[start:start + p.out_features, row:row + p.lora_rank])
        self._adapter = (a, b)
        return True


def _same_smoothing(a: QuantLinear, b: QuantLinear) -> bool:
    """Whether two linears divide their input by the same smoothing factors (the same memory, or neither)."""
    sa, sb = a.rollout_smoothing, b.rollout_smoothing
    return sa is sb or (sa is not None and sb is not None and sa.data_ptr() == sb.data_ptr())


def linear_from(linear: QuantLinear, x: torch.Tensor | None, codes) -> torch.Tensor:
    """One linear on x [M, K], or on 8-bit activation codes when `linear_codes_handoff` allowed them."""
    if codes is None:
        return linear(x)
    bias = None if linear.bias is None else linear.bias.to(linear.compute_dtype)
    y = kernels.matmul_from_codes(codes[0], codes[1], linear.qweight, bias, linear.compute_dtype)
    if linear.lora_rank:  # the adapter reads the activations the codes came from (`lora_codes_handoff`)
        if x is None:
            raise ValueError("a linear with a LoRA adapter needs the activations x along with the codes")
        y = linear.add_lora(y, x)
    return y


def unit_scale_matmul(codes: torch.Tensor, qweight, unit: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes [M, K] @ the codes of an "fp8" (rowwise) weight [N, K]^T on cuBLAS FP8 with unit per-tensor
    scales (unit: a float32 0-dim 1) -> [M, N] in out_dtype: the product before its per-token and per-channel
    scales, which the consuming kernel applies. At rollout batch sizes cuBLAS runs these shapes faster with
    per-tensor than with rowwise scales (bench/results/gemm.md); the unscaled product is rounded once more."""
    return torch._scaled_mm(codes, qweight.data.t(), scale_a=unit, scale_b=unit, out_dtype=out_dtype)


def _activation_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 codes and scales of x [M, K] (the Triton kernel on a GPU, `quarl.formats` elsewhere)."""
    if x.is_cuda and kernels.fp8_kernels_available(x.device):
        from quarl.kernels.act_quant import quantize_activation

        return quantize_activation(x, "fp8", x.shape[1])
    return reference_codes(x, "fp8")


def linear_codes_handoff(linear: QuantLinear, m: int, fast_paths: FastPaths) -> str | None:
    """As `FusedProjection.codes_handoff` for a single linear in rollout mode (fast_paths: the decoder's)."""
    if not linear.rollout or linear.rollout_format not in ("int8", "fp8", "fp8-block") or \
            (linear.lora_rank and not fast_paths.lora_codes_handoff) or linear.qweight_data is None:
        return None
    return linear.rollout_format if _handoff(linear.qweight, linear, m) else None


def _handoff(qweight, linear: QuantLinear, m: int) -> bool:
    """Codes go from a fused kernel straight to the 8-bit GEMM only when both run: the fused kernels for this
    dtype (else the activations take the torch pieces, which hand over bf16), with their smoothed codes when the
    linear is smoothed, and a GEMM that takes codes at m rows."""
    device = qweight.data.device
    return (qweight.data.is_cuda and not linear.rollout_avoids_kernel()
            and kernels.decode_fused_ok(device, linear.compute_dtype)
            and (linear.rollout_smoothing is None or kernels.decode_fused_smooth_ok(device))
            and kernels.codes_handoff(qweight, linear.weight_only, m))


# ------------------------------------------------------------------------------------------ elementwise pieces
def add_norm(norm, x: torch.Tensor, delta: torch.Tensor | None, quant: str | None, delta_scales=None,
             keep_h: bool = False, smooth: torch.Tensor | None = None):
    """(x + delta, norm(x + delta), codes) for an RMSNorm module in rollout mode; codes = (int8 / FP8 codes [M, H],
    scales [M, 1]) of the normed values when quant == "int8" / "fp8", (codes, 1x128-group scales [M, H/128]
    column-major) when quant == "fp8-block" (then the normed values themselves are None).
    delta_scales: (per-token [M, 1], per-channel [H]) float32 when delta is a unit-scale FP8 product
    (`unit_scale_matmul`): delta * scales, rounded to x's dtype, is added. smooth: the next linear's smoothing
    factors (float32 [H]; with quant only): the codes are those of h / s, as `QuantLinear.smooth_input` divides."""
    # AQN: the float32 noise, added to the weight in float32 by the kernel, passed once AQN is enabled on the norm
    # (as RMSNorm.forward decides) even while zero: a CUDA graph captured at σ = 0 reads the noise of later syncs.
    noise = norm.rollout_noise if norm.rollout and getattr(norm, "aqn_enabled", False) else None
    if x.is_cuda and kernels.decode_fused_ok(x.device, x.dtype):
        from quarl.kernels.decode_fused import rms_norm_rows

        r, h, c, s = rms_norm_rows(x, delta, norm.weight, noise, norm.eps, quant, write_h=quant is None or keep_h,
                                   delta_scales=delta_scales, smooth=smooth)
        return r, h, (None if quant is None else (c, s))
    if delta_scales is not None:
        delta = _apply_scales(delta, *delta_scales, x.dtype)
    r = x if delta is None else x + delta
    h = norm(r)
    return r, h, reference_codes(divided(h, smooth), quant)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, quant: str | None, in_scales=None, keep_h: bool = False,
             smooth: torch.Tensor | None = None):
    """(silu(gate) * up, codes) as `add_norm` (the product is None when codes are returned, unless keep_h; codes of
    product / smooth when smooth is given). in_scales: (per-token [M, 1], per-channel [2N] for gate then up) float32
    when gate and up are halves of a unit-scale FP8 product: each is scaled and rounded to up's dtype first."""
    if up.is_cuda and kernels.decode_fused_ok(up.device, up.dtype):
        from quarl.kernels.decode_fused import silu_mul_rows

        h, c, s = silu_mul_rows(gate, up, quant, write_h=quant is None or keep_h, in_scales=in_scales,
                                smooth=smooth)
        return h, (None if quant is None else (c, s))
    if in_scales is not None:
        rows, cols = in_scales
        n = gate.shape[1]
        gate, up = _apply_scales(gate, rows, cols[:n], up.dtype), _apply_scales(up, rows, cols[n:], up.dtype)
    h = F.silu(gate) * up
    return h, reference_codes(divided(h, smooth), quant)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int):
    """q [M, Hq, D] and k [M, Hkv, D] rotated, from the q/k/v projection output [M, (Hq + 2 Hkv) D]."""
    if qkv.is_cuda and kernels.decode_fused_ok(qkv.device, qkv.dtype) and not d & (d - 1) \
            and cos.dtype == qkv.dtype:
        from quarl.kernels.decode_fused import rope_rows

        return rope_rows(qkv, cos, sin, hq, hkv, d)
    m = qkv.shape[0]
    q = qkv[:, :hq * d].reshape(m, hq, 1, d)
    k = qkv[:, hq * d:(hq + hkv) * d].reshape(m, hkv, 1, d)
    c, s = cos[:, None, None], sin[:, None, None]
    return apply_rope(q, c, s)[:, :, 0], apply_rope(k, c, s)[:, :, 0]


def rope_qkv_scaled(y: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor,
                    bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int):
    """(q, k rotated, v) [M, heads, D] from a unit-scale FP8 q/k/v product y [M, (Hq + 2 Hkv) D]: every value is
    first bf16(y * row scale * column scale + bias), as the scaled GEMM would have written it."""
    if y.is_cuda and kernels.decode_fused_ok(y.device, y.dtype) and not d & (d - 1) and cos.dtype == y.dtype:
        from quarl.kernels.decode_fused import rope_rows_scaled

        return rope_rows_scaled(y, row_scales, col_scales, bias, cos, sin, hq, hkv, d)
    x = (y.float() * row_scales * col_scales + (bias.float() if bias is not None else 0.0)).to(y.dtype)
    q, k = rope_qk(x, cos, sin, hq, hkv, d)
    return q, k, x[:, (hq + hkv) * d:].reshape(-1, hkv, d)


def _apply_scales(y: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (y.float() * rows * cols).to(dtype)


def reference_codes(h: torch.Tensor, quant: str | None):
    """(codes, scales) of h [M, K] as the fused kernels hand them over, from `quarl.formats` (None for quant None):
    per token for "fp8" / "int8", and for "fp8-block" K columns with scales [M, groups] column-major."""
    if quant is None:
        return None
    from quarl.formats import quantize

    qt = quantize(h, quant, "activation")
    if quant == "fp8-block":
        return qt.data[:, :h.shape[1]], qt.scale.t().contiguous().t()
    return qt.data, qt.scale


# ------------------------------------------------------------------------------------------ the forward
DEFERRABLE = ("qkv", "o", "gate_up", "down")  # the decoder's FP8 GEMMs whose scales may be deferred
DEFAULT_DEFERRED = ("qkv", "o", "down")  # see FusedDecoder.__init__


def fused_decode_supported(model) -> bool:
    """Whether `FusedDecoder` covers this model: dense SiLU-gated MLPs (no MoE blocks), no per-head q/k norms
    (Qwen3 and Qwen3-MoE keep the module path)."""
    return all(layer.self_attn.q_norm is None and hasattr(layer.mlp, "gate_proj") for layer in model.model.layers)


class FusedDecoder:
    """The fused projections of every layer (see the module docstring). One per model (`for_model`): two would
    keep re-stacking the same modules' buffers away from each other."""

    @classmethod
    def for_model(cls, model, fast_paths: FastPaths | None = None) -> "FusedDecoder":
        """The model's decoder, built on first use and kept on the model; with fast_paths, set to use them."""
        decoder = model.__dict__.get("_quarl_fused_decoder")
        if decoder is None:
            decoder = cls(model)
            model.__dict__["_quarl_fused_decoder"] = decoder  # a plain attribute: not a submodule, not saved
        if fast_paths is not None:
            decoder.fast_paths = fast_paths
        return decoder

    def __init__(self, model, fast_paths: FastPaths = DEFAULT_FAST_PATHS):
        self.model = model
        self.qkv = [FusedProjection([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj])
                    for l in model.model.layers]
        self.gate_up = [FusedProjection([l.mlp.gate_proj, l.mlp.up_proj]) for l in model.model.layers]
        self.fast_paths = fast_paths
        # The q/k/v, o and down GEMMs, when they receive FP8 activation codes and `kernels.unit_scales_ok` (cuBLAS or
        # persistent TMA plans: rollout batches), run with unit per-tensor scales, and the kernel consuming each product
        # (rotary; residual add + norm) applies its per-token and per-channel scales (`unit_scale_matmul`): cuBLAS runs
        # these shapes faster with per-tensor scales. gate/up keeps its scales: SiLU·mul on scaled inputs would cost
        # more than the GEMM saves (bench/results/decode_elementwise.md). Each deferred product is rounded to bf16 once
        # more before its scales, a perturbation of one bf16 rounding (tests/test_fused_decode_gpu.py checks exactly
        # that).
        self.deferred_scales = DEFAULT_DEFERRED
        self._unit: torch.Tensor | None = None

    @property
    def deferred_scales(self) -> frozenset:
        """The linears ("qkv", "o", "gate_up", "down") whose FP8 GEMMs run with unit scales, the next kernel
        applying them; empty = every GEMM applies its own. Set True (all), False (none) or a collection of names."""
        return self._deferred

    @deferred_scales.setter
    def deferred_scales(self, value) -> None:
        if isinstance(value, str):
            value = (value,)
        names = DEFERRABLE if value is True else () if value is False or value is None else tuple(value)
        unknown = set(names) - set(DEFERRABLE)
        if unknown:
            raise ValueError(f"deferred_scales takes True, False or names among {DEFERRABLE}; got {sorted(unknown)}")
        self._deferred = frozenset(names)

    @property
    def fast_paths(self) -> FastPaths:
        """The optional paths this decoder takes (`lora_codes_handoff`, `stack_rollout_lora`); setting it sets
        every fused projection's too."""
        return self._fast_paths

    @fast_paths.setter
    def fast_paths(self, value: FastPaths) -> None:
        if not isinstance(value, FastPaths):
            raise TypeError(f"fast_paths takes a quarl.fast_paths.FastPaths, got {type(value).__name__}")
        self._fast_paths = value
        for proj in self.qkv + self.gate_up:
            proj.fast_paths = value

    def prepare(self, fast_paths: FastPaths | None = None) -> bool:
        """Make every fused weight and stacked adapter current (re-stacks after a reconfiguration or a new
        adapter; no work otherwise). Returns whether any buffer or adapter copy moved (CUDA graphs captured
        before then read the old ones). fast_paths: use these from now on (each engine passes its own, since
        engines on one model share its decoder); None keeps the current ones."""
        if fast_paths is not None:
            self.fast_paths = fast_paths
        self._unit_scale()  # made outside any CUDA-graph capture
        return any([proj.prepare() for proj in self.qkv + self.gate_up])  # a list: prepare every one

    def _unit_scale(self) -> torch.Tensor:
        """The float32 0-dim 1 of `unit_scale_matmul`, on the model's device (one tensor, no fill per GEMM)."""
        device = self.model.model.embed_tokens.weight.device
        if self._unit is None or self._unit.device != device:
            _refuse_inside_capture("FusedDecoder.prepare()")
            self._unit = torch.ones((), dtype=torch.float32, device=device)
        return self._unit

    def step_scales(self) -> tuple[frozenset, torch.Tensor | None]:
        """(the linears whose FP8 GEMMs defer their scales in a decode step, the float32 unit scale or None):
        `deferred_scales`, less all of them where the scaled fused kernels failed their self-check. Asked once
        per step (`SlotDecode`)."""
        deferred = self.deferred_scales
        weight = self.model.model.embed_tokens.weight
        if deferred and weight.is_cuda and kernels.decode_fused_ok(weight.device, weight.dtype) \
                and not kernels.decode_fused_scaled_ok(weight.device, weight.dtype):
            deferred = frozenset()  # the scaled kernels failed their check: keep the GEMMs that apply the scales
        return deferred, (self._unit_scale() if deferred else None)

    def layer(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step) -> torch.Tensor:
        """One `DecoderLayer` of a fast-engine decode step on the fused projections and kernels: what the layer's
        forward calls when its step cache carries this decoder (`quarl.rollout.fast_step.SlotDecode`).

        x: [B, 1, hidden], the residual stream less the previous layer's MLP output, which waits in `step.carry`
        (delta, its deferred scales or None) so that this layer's first norm kernel adds it; cos, sin: the
        model's rotary tables for the step's positions ([B, 1, 1, D] or [B, 1, D]). Returns the residual stream
        [B, 1, hidden] the same way, and the last layer's whole (its MLP output added), for the model's final
        norm.
        """
        B = x.shape[0]
        x = x.reshape(B, -1)
        cos, sin = cos.reshape(B, -1), sin.reshape(B, -1)
        deferred, unit = step.scales
        delta, pending = step.carry
        idx = layer.self_attn.layer_idx
        attn, mlp, qkv_proj, gate_up = layer.self_attn, layer.mlp, self.qkv[idx], self.gate_up[idx]
        Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        handoff = qkv_proj.codes_handoff(B)
        x, h, codes = add_norm(layer.input_layernorm, x, delta, handoff, pending, keep_h=qkv_proj.has_lora,
                               smooth=qkv_proj.smoothing if handoff else None)
        if "qkv" in deferred and handoff == "fp8" and not qkv_proj.has_lora \
                and kernels.unit_scales_ok(qkv_proj.fused_qweight, B):  # unit scales: codes only
            y, (rows, cols) = _unit_product(codes, qkv_proj.fused_qweight, unit, x.dtype)
            q, k, v = rope_qkv_scaled(y, rows, cols, qkv_proj._bias(x.dtype, x.device), cos, sin, Hq, Hkv, D)
        else:
            qkv = qkv_proj(h, codes)  # [B, (Hq + 2 Hkv) D]
            q, k = rope_qk(qkv, cos, sin, Hq, Hkv, D)
            v = qkv[:, (Hq + Hkv) * D:].view(B, Hkv, D)
        out = step.attend_rows(idx, q, k, v).reshape(B, -1)
        o, o_scales = _linear(attn.o_proj, out, None, unit if "o" in deferred else None, B, self.fast_paths)
        handoff = gate_up.codes_handoff(B)
        x, h, codes = add_norm(layer.post_attention_layernorm, x, o, handoff, o_scales, keep_h=gate_up.has_lora,
                               smooth=gate_up.smoothing if handoff else None)
        if "gate_up" in deferred and handoff == "fp8" and not gate_up.has_bias and not gate_up.has_lora \
                and kernels.unit_scales_ok(gate_up.fused_qweight, B):
            gu, gu_scales = _unit_product(codes, gate_up.fused_qweight, unit, x.dtype)
        else:
            gu, gu_scales = gate_up(h, codes), None
        inter = mlp.down_proj.in_features
        quant = linear_codes_handoff(mlp.down_proj, B, self.fast_paths)
        a, codes = silu_mul(gu[:, :inter], gu[:, inter:], quant, gu_scales, keep_h=bool(mlp.down_proj.lora_rank),
                            smooth=mlp.down_proj.rollout_smoothing if quant else None)
        delta, pending = _linear(mlp.down_proj, a, codes, unit if "down" in deferred else None, B, self.fast_paths)
        if idx == len(self.qkv) - 1:  # the last layer: the model's final norm takes the whole residual stream
            step.carry = (None, None)
            return add_delta(self.model.model.norm, x, delta, pending)[:, None]
        step.carry = (delta, pending)
        return x[:, None]


def add_delta(norm, x: torch.Tensor, delta: torch.Tensor, scales=None) -> torch.Tensor:
    """The residual stream x + delta [M, H] in x's dtype exactly as `add_norm(norm, x, delta, None, scales)` adds
    it, without the norm's output (on a GPU the same kernel, writing the sum only); scales: (per-token [M, 1],
    per-channel [H]) float32 when delta is a unit-scale FP8 product, which is first scaled and rounded to x's
    dtype."""
    if x.is_cuda and kernels.decode_fused_ok(x.device, x.dtype):
        from quarl.kernels.decode_fused import rms_norm_rows

        return rms_norm_rows(x, delta, norm.weight, None, norm.eps, None, write_h=False, delta_scales=scales)[0]
    if scales is not None:
        delta = _apply_scales(delta, *scales, x.dtype)
    return x + delta


def _unit_product(codes, qweight, unit: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(unit-scale product [M, N], its (per-token [M, 1], per-channel [N]) scales) of handed-over FP8 codes and an
    "fp8" rowwise weight: what a scaled GEMM would return, less the scaling the consuming piece does."""
    return unit_scale_matmul(codes[0], qweight, unit, dtype), (codes[1], qweight.scale.reshape(-1))


def _linear(linear: QuantLinear, x: torch.Tensor | None, codes, unit: torch.Tensor | None, batch: int,
            fast_paths: FastPaths) -> tuple:
    """(output, None) of one linear on x or on handed-over codes; with deferred scales (unit given), where the
    linear takes rowwise FP8 codes without a bias or adapter and its plan allows (`kernels.unit_scales_ok`),
    (unit-scale cuBLAS product, its scales) instead. Handed codes already mean the 8-bit GEMM runs; without them
    the handoff test decides, and x is quantized here."""
    if unit is None or linear.bias is not None or linear.rollout_format != "fp8" or linear.lora_rank or \
            (codes is None and linear_codes_handoff(linear, batch, fast_paths) is None) or \
            not kernels.unit_scales_ok(linear.qweight, batch):
        return linear_from(linear, x, codes), None
    return _unit_product(codes if codes is not None else _activation_codes(linear.smooth_input(x)), linear.qweight,
                         unit, linear.compute_dtype)


def both_decode_logits(model, engine, tokens: torch.Tensor, positions: torch.Tensor) -> tuple:
    """(module-path logits, fused logits) [B, vocab] of one decode step of `engine`'s cache, in rollout mode: the
    model's decode forward without and with the fused decoder (for tests and benchmarks comparing the two)."""
    from quarl.rollout.fast_step import decode_logits

    cache, attention = engine.cache, engine._attention
    model.set_rollout(True)
    try:
        with torch.no_grad():
            want = decode_logits(model, cache, tokens, positions, attention, cache.capacity)
            decoder = FusedDecoder.for_model(model, engine.fast_paths)
            got = decode_logits(model, cache, tokens, positions, attention, cache.capacity, decoder=decoder)
    finally:
        model.set_rollout(False)
    return want, got
