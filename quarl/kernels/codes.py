"""Handing 8-bit activation codes from a fused norm / SiLU·mul kernel to the next GEMM (`codes_handoff`,
`matmul_from_codes`), so that the GEMM skips its own quantization pass; `unit_scales_ok` for the fused decoder's
unit-scale FP8 products."""

from __future__ import annotations

import torch

from quarl.kernels import availability, capabilities, plans
from quarl.kernels.tuning import Plan


def _takes_codes(fmt: str, plan: Plan) -> bool:
    """Whether `plan` starts from activation codes made beforehand, so that a fused norm / SiLU·mul kernel's codes
    can replace its quantization pass: cuBLAS FP8 ("fp8", "fp8-block"), or for "int8" / "fp8" a W8A8 GEMM or
    GEMV in prequant mode. (The Triton fp8-block kernel reads row-major group scales, the fused kernels write
    them column-major for cuBLAS; the plans quantizing inside the GEMM ("fused") have no pass to save.)"""
    if plan.kind == "scaled_mm":
        return fmt in ("fp8", "fp8-block")
    return fmt in ("int8", "fp8") and plan.kind in ("w8a8", "gemv") and plan.x_mode == "prequant"


def _codes_plan(fmt: str, m: int, n: int, k: int, device) -> Plan | None:
    """The 8-bit GEMM plan at m rows when it can take activation codes (`codes_handoff`), else None. The same
    plan the quantizing matmul (`try_quantized_matmul`) would run, so that handing codes over never changes which
    linears run quantized, nor their values: the handed codes only skip the GEMM's own quantization pass."""
    plan = plans.plan_for(fmt, False, m, n, k, device)
    return plan if _takes_codes(fmt, plan) else None


def codes_handoff(qweight, weight_only: bool, m: int) -> bool:
    """Whether a GEMM of m activation rows with this weight takes 8-bit activation codes, so that a fused norm /
    SiLU·mul kernel can hand them over (`matmul_from_codes`) instead of the bf16 activations the GEMM would
    quantize itself (one pass over the activations less per linear): the plan at m rows is cuBLAS FP8
    (`torch._scaled_mm`), rowwise ("fp8") or blockwise ("fp8-block"), or for "int8" / "fp8" a W8A8 Triton GEMM /
    GEMV on prequantized codes. fp8-block also needs K a multiple of 512 (whole groups, and the group count cuBLAS
    takes unpadded), m a multiple of 16 (the rows cuBLAS blockwise was seen correct with; `dispatch._scaled_mm`
    pads others, codes are not padded) and the fused kernels' group codes to have passed their check
    (`decode_fused_group_ok`)."""
    fmt = getattr(qweight, "fmt", None)
    if fmt not in ("int8", "fp8", "fp8-block") or weight_only or not qweight.data.is_cuda:
        return False
    device = qweight.data.device
    if not availability.format_kernels_available(fmt, device):
        return False
    n, k = qweight.shape
    if fmt == "fp8-block" and (k % 512 or m % 16 or not capabilities.decode_fused_group_ok(device)):
        return False
    return _codes_plan(fmt, m, n, k, device) is not None


def unit_scales_ok(qweight, m: int) -> bool:
    """Whether the fused decoder may run this "fp8" (rowwise) GEMM at m rows as its unit-scale cuBLAS product,
    the next kernel applying the scales (`fused_decode.unit_scale_matmul`): where the plan is cuBLAS FP8 or the
    persistent TMA kernel on codes (rollout batches, where cuBLAS with per-tensor scales measured faster). The
    small-M Triton plans take the handed codes with their own scales, so that small batches compute exactly the
    module path's values (the unit-scale product rounds once more)."""
    if getattr(qweight, "fmt", None) != "fp8" or not qweight.data.is_cuda:
        return False
    n, k = qweight.shape
    plan = _codes_plan("fp8", m, n, k, qweight.data.device)
    if plan is None:
        return False
    return plan.kind == "scaled_mm" or (plan.cfg is not None and plan.cfg.tma and not plan.cfg.swap_ab)


def matmul_from_codes(codes: torch.Tensor, scales: torch.Tensor, qweight, bias: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """Q(x) @ deq(W)^T (+ bias) from 8-bit activation codes [M, K] and float32 scales -> [M, N] in out_dtype:
    int8 codes for an "int8" weight QuantizedTensor [N, K], float8_e4m3fn codes for an "fp8" (rowwise) one, both
    with per-token scales [M, 1], or float8_e4m3fn codes for an "fp8-block" weight with 1x128-group scales
    [M, K/128] laid out column-major (stride 1 along M). Where `codes_handoff` holds, the same values as
    `try_quantized_matmul(x, qweight, False, bias)` when (codes, scales) = quantize(x, fmt, "activation");
    elsewhere FP8 runs on cuBLAS and int8 on the dequantized operands in float32 (a reference, not a fast path)."""
    fmt = qweight.fmt
    if fmt not in ("int8", "fp8", "fp8-block"):
        raise ValueError(f"matmul_from_codes takes 'int8', 'fp8' (rowwise) or 'fp8-block' weights, got {fmt!r}: "
                         "other formats (per-tensor scales, fp4) take no handed activation codes; call "
                         "try_quantized_matmul with the activations instead")
    want = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    if codes.dtype != want or codes.dim() != 2 \
            or codes.shape[1] != qweight.data.shape[1]:
        raise ValueError(f"matmul_from_codes needs int8 codes [M, {qweight.data.shape[1]}] for an 'int8' weight, "
                         "float8_e4m3fn codes for an 'fp8' or 'fp8-block' one; got codes "
                         f"{codes.dtype} {tuple(codes.shape)}, weight {fmt!r}")
    groups = qweight.data.shape[1] // 128 if fmt == "fp8-block" else 1
    if scales.dtype != torch.float32 or tuple(scales.shape) != (codes.shape[0], groups) or \
            (groups > 1 and scales.stride(0) != 1):
        raise ValueError(f"matmul_from_codes needs float32 scales [{codes.shape[0]}, {groups}]"
                         f"{' column-major' if groups > 1 else ''}, got {scales.dtype} {tuple(scales.shape)} "
                         f"strides {scales.stride()}")
    # (torch._scaled_mm also takes CPU tensors; the kernels do not)
    if fmt != "fp8-block" and codes.is_cuda and availability.kernels_available(codes.device):
        n, k = qweight.shape
        plan = _codes_plan(fmt, codes.shape[0], n, k, codes.device)
        if plan is not None:
            from quarl.kernels.dispatch import codes_matmul

            return codes_matmul(plan, codes, scales, qweight, bias, out_dtype)
    if fmt == "int8":  # (no Triton needed)
        y = (codes.float() * scales) @ qweight.dequantize(torch.float32).T
        return (y if bias is None else y + bias.float()).to(out_dtype)
    from quarl.kernels.dispatch import scaled_mm_codes

    return scaled_mm_codes(codes, scales, qweight, bias, out_dtype)
