"""The FP8-block weight-gradient GEMM of FP8 training (`quarl.model.fp8_training`), on cuBLAS where it applies.

dW [N, K] = Q(g^T) @ Q(x^T)^T for g [M, N] (output gradients) and x [M, K] (layer inputs), M tokens: both operands
are rounded in 1x128 groups along M (the reduction), which is `torch._scaled_mm`'s 1x128 x 1x128 blockwise recipe
(cuBLAS >= 12.9 on Hopper). Each operand is quantized straight into the transposed codes the GEMM reads by one
Triton pass (`act_quant.quantize_columns_transposed`), so no transposed bf16 copy is made. Where cuBLAS does
not take the shapes (N or K not a multiple of 16, or no Hopper) the Triton W8A8 kernel multiplies the same codes.
"""

from __future__ import annotations

import torch

from quarl.kernels.act_quant import quantize_activation, quantize_columns_transposed


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
    # a = g^T codes row-major with scales [N, MP/128] outer-dim-major (the .t() view); b = x codes column-major
    # ([MP, K] as the transposed view of [K, MP]) with scales [MP/128, K] row-major: the 1x128 x 1x128 recipe.
    dw = torch._scaled_mm(g_codes, x_codes.t(), scale_a=g_scales.t(), scale_b=x_scales, out_dtype=torch.bfloat16)
    return dw.to(g.dtype)


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
