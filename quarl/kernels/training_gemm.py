"""The GEMMs of FP8-block training (`quarl.model.fp8_training`) on cuBLAS, with one quantizing pass per operand.

Weight gradient: dW [N, K] = Q(g^T) @ Q(x^T)^T for g [M, N] (output gradients) and x [M, K] (layer inputs), M
tokens: both operands rounded in 1x128 groups along M (the reduction), `torch._scaled_mm`'s 1x128 x 1x128
blockwise recipe (cuBLAS >= 12.9 on Hopper), from codes written already transposed by a Triton pass
(`act_quant.quantize_columns_transposed`). Where cuBLAS does not take the shapes the Triton W8A8 kernel
multiplies the same codes.

Whole linear (`linear_forward` / `linear_backward`, where `fused_linear_ok`): every operand is read once.
W -> Q(W) and Q(W^T) in one pass; x -> its activation codes (forward) and its transposed codes (weight gradient)
in one pass, and the backward keeps those codes instead of x; g likewise (input and weight gradient). Three
quantizing launches and three cuBLAS GEMMs per forward + backward, where the unfused path reads x, g and W twice.
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
    """Whether `linear_forward` applies to x [M, K] and a weight [n, K]: a Hopper GPU, bf16/fp16 x, N and K
    multiples of 128 (whole weight tiles both ways), M a multiple of 16 (cuBLAS blockwise), and M large enough
    that the rollout forward itself runs cuBLAS blockwise for this shape (so both compute the same function)."""
    from quarl import kernels

    if not (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    m, k = x.shape
    if m == 0 or m % 16 or n % 128 or k % 128 or not kernels.fp8_kernels_available(x.device):
        return False
    return cublas_weight_grad_ok(n, k, x.device) and \
        kernels.plan_for("fp8-block", False, m, n, k, x.device).kind == "scaled_mm"


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """y = Q(x) @ Q(W)^T (+ bias) for x [M, K] and the master weight [N, K] (any float dtype; rounded to x.dtype
    first, as the rollout copy) where `fused_linear_ok` -> (y [M, N] in x.dtype, saved): the rollout forward's
    own cuBLAS call on the same codes; `saved` holds what `linear_backward` needs (x's transposed codes and
    Q(W^T)), not x."""
    from quarl.formats.fp8 import pad_block_groups
    from quarl.kernels.dispatch import scaled_mm_codes
    from quarl.kernels.weight_quant import quantize_fp8_block_weight_pair

    qw, qwt = quantize_fp8_block_weight_pair(weight.detach().to(x.dtype))
    qw = pad_block_groups(qw, 4)
    x_rows, x_row_scales, x_cols, x_col_scales = quantize_rows_and_columns(x, qw.data.shape[1])
    y = scaled_mm_codes(x_rows, x_row_scales, qw, bias, x.dtype)
    return y, (x_cols, x_col_scales, qwt)


def linear_backward(g: torch.Tensor, saved, need_input_grad: bool, need_weight_grad: bool):
    """(dx [M, K] or None, dW [N, K] or None) in g's dtype from g [M, N] (the output gradient, rows contiguous)
    and `linear_forward`'s saved codes: dx = Q(g) @ Q(W^T)^T (g in 1x128 groups along N, W^T in 128x128 tiles),
    dW = Q(g^T) @ Q(x^T)^T (both in 1x128 groups along M)."""
    from quarl.formats.fp8 import pad_block_groups
    from quarl.kernels.dispatch import scaled_mm_codes

    x_cols, x_col_scales, qwt = saved
    qwt = pad_block_groups(qwt, 4)
    g_rows, g_row_scales, g_cols, g_col_scales = quantize_rows_and_columns(g, qwt.data.shape[1])
    dx = scaled_mm_codes(g_rows, g_row_scales, qwt, None, g.dtype) if need_input_grad else None
    dw = weight_grad_from_codes(g_cols, g_col_scales, x_cols, x_col_scales, g.dtype) if need_weight_grad else None
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
