"""The GEMMs of FP8-block training (`quarl.model.fp8_training`) on cuBLAS blockwise FP8.

Weight gradient: dW [N, K] = Q(g^T) @ Q(x^T)^T for g [M, N] (output gradients) and x [M, K] (layer inputs), M
tokens: both operands rounded in 1x128 groups along M (the reduction), `torch._scaled_mm`'s 1x128 x 1x128
blockwise recipe (cuBLAS >= 12.9 on Hopper), from codes written already transposed by a Triton pass
(`act_quant.quantize_columns_transposed`). Where cuBLAS does not take the shapes the Triton W8A8 kernel
multiplies codes quantized the same way (from transposed copies).

Whole linear (`linear_forward` / `linear_backward`, where `fused_linear_ok`): x -> its activation codes
(forward) and its transposed codes (weight gradient) in one pass, and the backward keeps those codes instead of
x; g likewise (input and weight gradient); Q(W) in the forward and Q(W^T) in the backward, one pass each. Four
quantizing launches and three cuBLAS GEMMs per forward + backward.
"""

from __future__ import annotations

import torch

from quarl.kernels.act_quant import quantize_activation, quantize_columns_transposed, quantize_rows_and_columns


def cublas_weight_grad_ok(n: int, k: int, device: torch.device) -> bool:
    """Whether `torch._scaled_mm` takes the 1x128 x 1x128 weight-gradient GEMM for dW [n, k] on device: Hopper
    (the blockwise recipes are sm_90 cuBLAS kernels) and n, k multiples of 16 (its operand alignment rule)."""
    return torch.cuda.get_device_capability(device)[0] == 9 and n % 16 == 0 and k % 16 == 0


def fp8_block_weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = Q(g^T) @ Q(x^T)^T: g [M, N], x [M, K] bf16/fp16 on one CUDA device, rows contiguous -> [N, K] in
    g's dtype. Both operands rounded in 1x128 groups along M as `kernels.fake_quantize_columns` rounds them; the
    GEMM scales every 128-token partial product by its two groups' scales and accumulates in float32. A partial
    last group is padded with zero codes (they add nothing)."""
    if g.dim() != 2 or x.dim() != 2 or g.shape[0] != x.shape[0]:
        raise ValueError(f"fp8_block_weight_grad needs g [M, N] and x [M, K] with the same M, got "
                         f"{tuple(g.shape)} and {tuple(x.shape)}")
    (m, n), k = g.shape, x.shape[1]
    if m == 0:
        return torch.zeros((n, k), dtype=g.dtype, device=g.device)
    if not cublas_weight_grad_ok(n, k, g.device):
        return _triton_weight_grad(g, x)
    g_codes, g_scales = quantize_columns_transposed(g)  # [N, MP], [MP/128, N]
    x_codes, x_scales = quantize_columns_transposed(x)  # [K, MP], [MP/128, K]
    return weight_grad_from_codes(g_codes, g_scales, x_codes, x_scales, g.dtype)


def weight_grad_from_codes(g_codes: torch.Tensor, g_scales: torch.Tensor, x_codes: torch.Tensor,
                           x_scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dW [N, K] in out_dtype from the transposed codes of `quantize_columns_transposed`: g_codes [N, MP],
    g_scales [MP/128, N], x_codes [K, MP], x_scales [MP/128, K] (cuBLAS 1x128 x 1x128; N, K multiples of 16)."""
    # a = g^T codes row-major with scales [N, MP/128] outer-dim-major (the .t() view); b = x codes column-major
    # ([MP, K] as the transposed view of [K, MP]) with scales [MP/128, K] row-major: the 1x128 x 1x128 recipe.
    dw = torch._scaled_mm(g_codes, x_codes.t(), scale_a=g_scales.t(), scale_b=x_scales, out_dtype=torch.bfloat16)
    return dw.to(out_dtype)


def fused_linear_ok(x: torch.Tensor, n: int) -> bool:
    """Whether `linear_forward` applies to x [M, K] and a weight [n, K]: a Hopper GPU, bf16/fp16 x with
    contiguous rows, N and K multiples of 128 (whole weight tiles both ways), M a multiple of 16 (cuBLAS
    blockwise), and M large enough that the rollout forward's plan for this shape is cuBLAS blockwise. (For K
    not a multiple of 512 the rollout dispatch runs the same codes on the Triton kernel instead, to avoid padding
    a persistent weight every call: the two then agree to float32 summation order.) The caller has checked
    `kernels.fp8_kernels_available` (`fp8_training.training_gemm_ok` does, before importing this module)."""
    from quarl.kernels.tuning import choose_plan

    if not (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1):
        return False
    m, k = x.shape
    if m == 0 or m % 16 or n % 128 or k % 128:
        return False
    return cublas_weight_grad_ok(n, k, x.device) and choose_plan("fp8-block", False, m, n, k).kind == "scaled_mm"


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, keep_x_codes: bool,
                   qweight=None, share: dict | None = None):
    """y = Q(x) @ Q(W)^T (+ bias) for x [M, K] and the master weight [N, K] (any float dtype; rounded to x.dtype
    first, as the rollout copy) where `fused_linear_ok` -> (y [M, N] in x.dtype, x_codes): the rollout
    forward's codes on cuBLAS blockwise. qweight: Q(W) already quantized (fp8-block [N, K], e.g. a frozen
    weight's), else W is quantized here. keep_x_codes (the weight needs a gradient): x is quantized both ways in
    one pass and x_codes = (x's transposed codes [K, MP], scales [MP/128, K]) for `linear_backward`, which then
    needs no x; else x_codes is None. share: a dict of x's quantizations by (x's address, layout and version, kp,
    keep_x_codes), read and filled here (`fp8_training.shared_input_codes`), so sibling linears quantize one
    input once. Each entry keeps x itself, so its address cannot be reused for another tensor while the dict
    lives: that makes the key safe."""
    from quarl.formats.fp8 import pad_block_groups
    from quarl.kernels.dispatch import scaled_mm_codes
    from quarl.kernels.weight_quant import quantize_fp8_block_weight

    if qweight is None:
        qweight = quantize_fp8_block_weight(weight.detach().to(x.dtype))
    qw = pad_block_groups(qweight, 4)
    kp = qw.data.shape[1]
    key = (x.data_ptr(), x.device, x.dtype, tuple(x.shape), x.stride(), x._version, kp, keep_x_codes)
    entry = None if share is None else share.get(key)
    if entry is None:
        entry = (x, _quantize_input(x, kp, keep_x_codes))
        if share is not None:
            share[key] = entry
    quantized = entry[1]
    x_rows, x_row_scales, x_codes = quantized
    return scaled_mm_codes(x_rows, x_row_scales, qw, bias, x.dtype), x_codes


def _quantize_input(x: torch.Tensor, kp: int, keep_x_codes: bool):
    """x [M, K] -> (codes [M, kp], scales column-major [M, kp/128], x_codes: the transposed codes and scales
    when keep_x_codes, else None); see `linear_forward`."""
    if keep_x_codes:
        x_rows, x_row_scales, x_cols, x_col_scales = quantize_rows_and_columns(x, kp)
        return x_rows, x_row_scales, (x_cols, x_col_scales)
    return *_quantize_rows(x, kp), None


def _quantize_rows(t: torch.Tensor, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, K] -> fp8-block codes [M, kp] and column-major scales, as torch._scaled_mm takes them. Two warps per
    program (a program per row from 1024 rows on): at training row counts two warps stream closer to copy
    bandwidth than four (bench/results/gemm.md)."""
    return quantize_activation(t, "fp8-block", kp, scales_column_major=True, num_warps=2)


def linear_backward(g: torch.Tensor, weight: torch.Tensor, x_codes, need_input_grad: bool, need_weight_grad: bool,
                    qweight_t=None):
    """(dx [M, K] in g's dtype or None, dW [N, K] in bf16 or None) from g [M, N] (the output gradient, rows
    contiguous), the master weight and `linear_forward`'s x_codes: dx = Q(g) @ Q(W^T)^T (g in 1x128 groups along
    N, W^T in 128x128 tiles: qweight_t when given (a frozen weight's, kept), else quantized here from W, since
    keeping Q(W^T) from the forward would hold N*K bytes per trained linear until the backward),
    dW = Q(g^T) @ Q(x^T)^T (both in 1x128 groups along M). g is read once for both."""
    from quarl.formats.fp8 import pad_block_groups
    from quarl.kernels.dispatch import scaled_mm_codes
    from quarl.kernels.weight_quant import quantize_fp8_block_weight

    dx = dw = g_cols = None
    if need_input_grad:
        if qweight_t is None:
            qweight_t = quantize_fp8_block_weight(weight.detach().to(g.dtype), transpose=True)
        qwt = pad_block_groups(qweight_t, 4)
        np_ = qwt.data.shape[1]
        if need_weight_grad:
            g_rows, g_row_scales, g_cols, g_col_scales = quantize_rows_and_columns(g, np_)
        else:
            g_rows, g_row_scales = _quantize_rows(g, np_)
        dx = scaled_mm_codes(g_rows, g_row_scales, qwt, None, g.dtype)
    if need_weight_grad:
        if g_cols is None:
            g_cols, g_col_scales = quantize_columns_transposed(g)
        dw = weight_grad_from_codes(g_cols, g_col_scales, *x_codes, torch.bfloat16)
    return dx, dw


def _triton_weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The same product on the Triton W8A8 kernel (transposed copies quantized row by row)."""
    from quarl.formats import QuantizedTensor
    from quarl.kernels.w8a8_gemm import WGRAD_CFG, X_PREQUANT, w8a8_matmul

    m, k = x.shape
    mp = -(-m // 128) * 128
    gq = quantize_activation(g.t().contiguous(), "fp8-block", mp)
    xc, xs = quantize_activation(x.t().contiguous(), "fp8-block", mp)
    xq = QuantizedTensor("fp8-block", "activation", xc, xs, None, torch.Size((k, m)))
    return w8a8_matmul(g.t(), xq, None, WGRAD_CFG, X_PREQUANT, xq=gq)
