"""The quantized matmul y = Q(x) @ dequant(W)^T on the GPU kernels (`try_quantized_matmul`, `quantized_matmul`),
and the one-kernel dequantization of fp4 weights (`try_dequantize`). Each returns None where no kernel applies, and
imports the Triton kernels only on a call that can use them."""

from __future__ import annotations

import torch

from quarl.formats.registry import FORMATS
from quarl.kernels import availability, plans


def try_dequantize(qweight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Dense weight [N, K] in dtype (bf16/fp16/fp32) from a weight QuantizedTensor on a GPU, by one Triton kernel:
    the same values as `qweight.dequantize(dtype)` (code * scales in fp32, rounded once), without the reference's
    lookups, fp32 temporaries and expanded scales. nvfp4 / mxfp4 (`dequant.dequantize_fp4_weight`), int8 / fp8 /
    fp8-tensor / fp8-block (`dequant.dequantize_8bit_weight`). None where it does not apply (other formats or
    roles, CPU tensors, no Triton, FP8 codes before compute capability 8.9): the caller then uses
    `qweight.dequantize`. out: an [N, K] tensor of dtype to write into (8-bit formats only; fp4 -> None)."""
    spec = FORMATS.get(getattr(qweight, "fmt", None))
    if spec is None or qweight.role != "weight" or len(qweight.shape) != 2:
        return None
    if dtype not in (torch.bfloat16, torch.float16, torch.float32) or not qweight.data.is_cuda:
        return None
    if not availability.format_kernels_available(qweight.fmt, qweight.data.device):
        return None
    from quarl.kernels import dequant

    if spec.bits == 4:
        return None if out is not None else dequant.dequantize_fp4_weight(qweight, dtype)
    return dequant.dequantize_8bit_weight(qweight, dtype, out)


def dequantize(qweight, dtype: torch.dtype) -> torch.Tensor:
    """`qweight.dequantize(dtype)` [N, K], by one GPU kernel where `try_dequantize` has one (the same values)."""
    dense = try_dequantize(qweight, dtype)
    return dense if dense is not None else qweight.dequantize(dtype)


def try_quantized_matmul(x: torch.Tensor, qweight, weight_only: bool, bias: torch.Tensor | None = None):
    """See `_quantized_matmul`; None also where the caller's bf16 path (for W8A8: fake-quantized activations times
    the dequantized weight) measured faster than every quantized kernel (`tuning.choose_plan`)."""
    return _quantized_matmul(x, qweight, weight_only, bias, prefer_kernel=False)


def quantized_matmul(x: torch.Tensor, qweight, weight_only: bool, bias: torch.Tensor | None = None):
    """As `try_quantized_matmul`, but runs the fastest quantized kernel even where it measured below
    `tuning.MIN_SPEEDUP` x the caller's bf16 path (for a caller that holds only the quantized weight). None only
    where no kernel applies (CPU, no Triton, W4A4)."""
    return _quantized_matmul(x, qweight, weight_only, bias, prefer_kernel=True)


def _quantized_matmul(x: torch.Tensor, qweight, weight_only: bool, bias: torch.Tensor | None, prefer_kernel: bool):
    """y = Q(x) @ dequant(qweight)^T (+ bias) on a fast kernel, or None when none applies (CPU, unsupported).

    x: [M, K] activations in the compute dtype (bf16 or fp16; other dtypes -> None); qweight: a
    `quarl.formats.QuantizedTensor` with role "weight" and shape [N, K]; weight_only: True = W4A16/W8A16
    (x is not quantized), False = x quantized dynamically like `quantize(x, fmt, "activation")` (per token for
    int8/fp8, 1x128 groups for fp8-block, one scale for fp8-tensor; fp4 formats have no W4A4 kernel -> None).
    bias: [N] or None. Returns [M, N] in x.dtype, or None (CPU tensors, no Triton, a format or shape without a
    kernel, or a shape where the caller's measured bf16 path is faster).
    Raises ValueError when x and qweight do not fit together (K mismatch, different devices, not a weight).
    """
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        return None
    fmt = getattr(qweight, "fmt", None)
    if fmt not in FORMATS or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2:
        return None
    if qweight.role != "weight" or len(qweight.shape) != 2:
        raise ValueError(
            f"try_quantized_matmul needs a 2-D weight QuantizedTensor [N, K], got role={qweight.role!r} "
            f"shape={tuple(qweight.shape)}; quantize the weight with quantize(w, fmt, role='weight')"
        )
    m, k = x.shape
    n = qweight.shape[0]
    if k != qweight.shape[1]:
        raise ValueError(
            f"x has {k} input features but the weight expects {qweight.shape[1]} (weight shape "
            f"{tuple(qweight.shape)}); x must be [M, in_features]"
        )
    if qweight.data.device != x.device:
        raise ValueError(f"x is on {x.device} but the quantized weight is on {qweight.data.device}; move one of them")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] on {x.device}, got shape {tuple(bias.shape)} on {bias.device}")
    if fmt == "mxfp4" and x.dtype == torch.float16:
        return None  # E8M0 scales can leave fp16's range; the bf16 path is exact
    if not availability.kernels_available(x.device):
        return None
    plan = plans.plan_for(fmt, weight_only, m, n, k, x.device, prefer_kernel)
    if plan.kind == "bf16":
        return None
    if m == 0:
        return torch.zeros((0, n), dtype=x.dtype, device=x.device) + (0 if bias is None else bias.to(x.dtype))
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    from quarl.kernels.dispatch import run_plan

    return run_plan(plan, x, qweight, bias)
