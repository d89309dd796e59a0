"""Runs a `tuning.Plan` on the GPU kernels. Imported lazily by `quarl.kernels` (it imports Triton)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from quarl.formats.fp8 import pad_block_groups
from quarl.kernels.act_quant import quantize_activation
from quarl.kernels.common import GemmConfig
from quarl.kernels.dequant import dequantize_fp4_weight
from quarl.kernels.fp4_decode import fp4_decode_matmul
from quarl.kernels.fp4_gemm import fp4_matmul
from quarl.kernels.gemv import fp4_gemv, w8_gemv
from quarl.kernels.tuning import Cfg, Plan
from quarl.kernels.w8a8_gemm import X_FUSED, X_PREQUANT, X_RAW, w8a8_matmul

_X_MODES = {"raw": X_RAW, "fused": X_FUSED, "prequant": X_PREQUANT}


def _gemm_config(cfg: Cfg, fmt: str) -> GemmConfig:
    # fp8-block steps one 128-deep scale group at a time, whatever depth the shared table names.
    bk = 128 if fmt == "fp8-block" else cfg.bk
    return replace(cfg, bk=bk)


def _scaled_mm(x: torch.Tensor, qweight, bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 W8A8 through cuBLAS: activation codes from `act_quant`, scales applied by torch._scaled_mm.

    fp8 (rowwise): scale_a [M, 1], scale_b [1, N]; fp8-tensor: 0-dim scales; fp8-block: scale_a [M, Kp/128]
    column-major, scale_b the [ceil(N/128), Kp/128] tile scales transposed (the layouts cuBLAS's blockwise
    scaling reads). Rowwise and blockwise scaling produce bf16 only: fp16 callers get one extra rounding.
    """
    fmt = qweight.fmt
    m = x.shape[0]
    if fmt == "fp8-block":
        if m % 16:
            # cuBLAS blockwise FP8 is used with M a multiple of 16 only: pad rows (zero codes, scale 1), drop them
            # after.
            x = F.pad(x, (0, 0, 0, 16 - m % 16))
        qweight = pad_block_groups(qweight, 4)
    codes, sx = quantize_activation(x, fmt, qweight.data.shape[1], scales_column_major=fmt == "fp8-block")
    return scaled_mm_codes(codes, sx, qweight, bias, x.dtype)[:m]


def scaled_mm_codes(codes: torch.Tensor, sx: torch.Tensor, qweight, bias: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm on activation codes [M, Kp] and scales from `quantize_activation` (layouts as in
    `_scaled_mm`) times an fp8 / fp8-tensor / fp8-block weight -> [M, N] in out_dtype."""
    fmt, n = qweight.fmt, qweight.shape[0]
    if fmt == "fp8-block":
        if n % 128 or (qweight.data.shape[1] // 128) % 4:
            raise ValueError(
                f"blockwise cuBLAS FP8 is used only with N a multiple of 128 and Kp/128 a multiple of 4, got "
                f"N={n}, Kp={qweight.data.shape[1]}; pad the weight with quarl.formats.fp8.pad_block_groups(qweight, "
                f"4) (and the activation codes to the same Kp), or use a Triton plan (Plan('w8a8', ...))"
            )
        sw = qweight.scale.t()
    elif qweight.scale.dim():
        sw = qweight.scale.reshape(1, n)
    else:
        sw = qweight.scale
    mm_dtype = out_dtype if fmt == "fp8-tensor" else torch.bfloat16
    fused_bias = None if (bias is None or fmt == "fp8-block") else bias.to(mm_dtype)  # blockwise: no bias
    # b must be column-major: the [N, Kp] row-major codes transposed are exactly that, without a copy.
    y = torch._scaled_mm(codes, qweight.data.t(), scale_a=sx, scale_b=sw, bias=fused_bias, out_dtype=mm_dtype)
    y = y.to(out_dtype)
    if bias is not None and fused_bias is None:
        y = y + bias.to(out_dtype)
    return y


def codes_matmul(plan: Plan, codes: torch.Tensor, sx: torch.Tensor, qweight, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """A plan that starts from activation codes (prequant "w8a8" / "gemv", or "scaled_mm" with rowwise or
    per-tensor scales) on codes [M, Kp] and scales from `quantize_activation` (or a fused kernel that makes the
    same) -> [M, N] in out_dtype: what `run_plan` computes after quantizing x itself."""
    if plan.kind == "scaled_mm":
        return scaled_mm_codes(codes, sx, qweight, bias, out_dtype)
    m, k = codes.shape[0], qweight.shape[1]
    # the kernels read codes with unit stride along K, and the bias as contiguous
    codes = codes if codes.stride(1) == 1 else codes.contiguous()
    bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()
    # in prequant mode the kernels read only the shape, dtype and device of x: a zero-stride stand-in
    x_like = torch.empty((1, 1), dtype=out_dtype, device=codes.device).expand(m, k)
    c = plan.cfg
    if plan.kind == "gemv":
        return w8_gemv(x_like, qweight, bias, c.bn, c.bk, c.warps, c.stages, X_PREQUANT, (codes, sx))
    return w8a8_matmul(x_like, qweight, bias, _gemm_config(c, qweight.fmt), X_PREQUANT, (codes, sx))


def run_plan(plan: Plan, x: torch.Tensor, qweight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16/fp16 (rows contiguous), qweight [N, K] on x's device -> [M, N] in x.dtype."""
    if plan.kind == "fp4":
        return fp4_matmul(x, qweight, bias, _gemm_config(plan.cfg, qweight.fmt))
    if plan.kind == "fp4_decode":
        return fp4_decode_matmul(x, qweight, bias, plan.cfg)
    if plan.kind == "deq_mm":
        return F.linear(x, dequantize_fp4_weight(qweight, x.dtype), bias)
    if plan.kind == "w8a8":
        mode = _X_MODES[plan.x_mode]
        xq = quantize_activation(x, qweight.fmt, qweight.data.shape[1]) if mode == X_PREQUANT else None
        return w8a8_matmul(x, qweight, bias, _gemm_config(plan.cfg, qweight.fmt), mode, xq)
    if plan.kind == "scaled_mm":
        return _scaled_mm(x, qweight, bias)
    if plan.kind == "gemv":
        c = plan.cfg
        if qweight.fmt in ("nvfp4", "mxfp4"):
            return fp4_gemv(x, qweight, bias, c.bn, c.bk, c.warps, c.stages)
        mode = _X_MODES[plan.x_mode]
        xq = quantize_activation(x, qweight.fmt, qweight.data.shape[1]) if mode == X_PREQUANT else None
        return w8_gemv(x, qweight, bias, c.bn, c.bk, c.warps, c.stages, mode, xq)
    raise ValueError(f"unknown kernel plan kind {plan.kind!r}")
