"""Fake quantization, dequantize(quantize(t, fmt, role)), and weight quantization in one Triton pass on a GPU: bit
for bit the reference values of `quarl.formats`, which serve everywhere else (CPU tensors, other formats, no Triton)."""

from __future__ import annotations

import torch

from quarl.formats.registry import FORMATS
from quarl.kernels import availability


def fake_quantize_activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """dequantize(quantize(x, fmt, "activation")) in x's shape and dtype, with no input checks (a hot path).

    x: [..., K] floating. On a GPU, for the 8-bit formats and bf16/fp16/fp32 x, one Triton pass
    (`quarl.kernels.act_quant.fake_quantize_activation`, bit for bit the same values); elsewhere the reference
    `quarl.formats.registry.fake_quantize_unchecked` (a dozen elementwise kernels). No gradient flows through
    either: wrap it in a straight-through estimator. NaN inputs, FP8 formats: the NaN element stays NaN in both
    (the reference then scales its whole group by 1, the kernel by the other values' amax); int8 has no NaN code,
    and both lose it.
    """
    # the one-pass kernel covers the 8-bit formats (fp4 activations would be W4A4: no kernel)
    spec = FORMATS.get(fmt)
    if (x.is_cuda and spec is not None and spec.is_8bit and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.dim() >= 1 and x.shape[-1] > 0 and availability.format_kernels_available(fmt, x.device)):
        from quarl.kernels.act_quant import fake_quantize_activation as kernel

        x2d = x.detach().reshape(-1, x.shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        return kernel(x2d, fmt).reshape(x.shape)
    from quarl.formats.registry import fake_quantize_unchecked

    return fake_quantize_unchecked(x, fmt, "activation")


def fake_quantize_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """dequantize(quantize(w, fmt, "weight")) [N, K] in w's dtype, with no input checks (the unified flow's
    training forward, every micro-batch). int8 / fp8 / fp8-tensor weights are scaled per row (or per tensor)
    exactly as activations are, so they take `fake_quantize_activation`'s one pass; fp8-block takes the one-pass
    tile quantizer, then the reference dequantization; other formats and CPU tensors the reference."""
    if fmt in ("int8", "fp8", "fp8-tensor"):
        return fake_quantize_activation(w, fmt)
    if fmt == "fp8-block":
        q = try_quantize_fp8_block_weight(w)
        if q is not None:
            return q.dequantize(w.dtype)
    from quarl.formats.registry import fake_quantize_unchecked

    return fake_quantize_unchecked(w, fmt, "weight")


def fake_quantize_columns(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] with every column rounded in 1x128 groups along M (FP8-block), in x's dtype and layout: the
    values of `fake_quantize(x.t(), "fp8-block", "activation").t()`, the weight-gradient operands of FP8
    training (`quarl.model.fp8_training`). One Triton pass and no transposed copy on a GPU; elsewhere the
    reference on the transposed copy."""
    if x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and \
            availability.fp8_kernels_available(x.device):
        from quarl.kernels.act_quant import fake_quantize_columns as kernel

        return kernel(x if x.stride(1) == 1 else x.contiguous())
    from quarl.formats.registry import fake_quantize_unchecked

    return fake_quantize_unchecked(x.t().contiguous(), "fp8-block", "activation").t().contiguous()


def try_quantize_fp8_block_weight(w: torch.Tensor, transpose: bool = False, out=None):
    """The fp8-block weight QuantizedTensor of w [N, K] (or of w^T [K, N] with transpose) by one Triton pass on a
    GPU: the codes and scales of `quantize(w, "fp8-block", "weight")` bit for bit (see
    `quarl.kernels.weight_quant`; out: the (codes, scales) to write into). None off the GPU or for other
    dtypes/shapes: use the reference then."""
    if not (w.is_cuda and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return None
    if w.stride(1) != 1 or not availability.fp8_kernels_available(w.device):
        return None
    from quarl.kernels.weight_quant import quantize_fp8_block_weight

    return quantize_fp8_block_weight(w, transpose, out)


def try_quantize_weight(w: torch.Tensor, fmt: str, out=None):
    """The weight QuantizedTensor of w [N, K] in one Triton pass on a GPU, bit for bit `quantize(w, fmt, "weight")`:
    "fp8-block" by its tile quantizer, "int8" and "fp8" by the per-row activation quantizer (per-channel weight
    scales are per-row scales). None for other formats, off the GPU, or where the kernels cannot run: use the
    reference then. Used by the per-step sync, which re-quantizes every linear, with out = the rollout copy's
    (codes, scales) to write into (their layouts as the reference makes them) instead of new tensors."""
    if fmt == "fp8-block":
        return try_quantize_fp8_block_weight(w, out=out)
    if fmt not in ("int8", "fp8") or not (w.is_cuda and w.dim() == 2 and w.stride(1) == 1):
        return None
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.shape[0] == 0:
        return None
    if not availability.format_kernels_available(fmt, w.device):
        return None
    from quarl.formats import QuantizedTensor
    from quarl.kernels.act_quant import quantize_activation

    codes, scales = quantize_activation(w, fmt, w.shape[1], out=out)
    return QuantizedTensor(fmt, "weight", codes, scales, None, w.shape)
