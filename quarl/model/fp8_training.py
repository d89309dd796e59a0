"""FP8-block training GEMMs for the unified flow (Jet-RL; BRIEF §2, §3): `precision.quantized_backward=true`.

A linear y = x @ W^T + b has three GEMMs per training step. Here all three take FP8-block operands:

| GEMM                   | shapes                 | first operand             | second operand            |
|------------------------|------------------------|---------------------------|---------------------------|
| forward  y  = x W^T    | [M,K] x [N,K] -> [M,N] | x, 1x128 groups along K   | W, 128x128 tiles          |
| input grad dx = g W    | [M,N] x [K,N] -> [M,K] | g, 1x128 groups along N   | W^T, 128x128 tiles        |
| weight grad dW = g^T x | [N,M] x [K,M] -> [N,K] | g^T, 1x128 groups along M | x^T, 1x128 groups along M |

(g = dL/dy; the weight-gradient's second operand in 1x128 groups of x^T is "128x1 groups" of x.) The master
weight stays in full precision and gradients between operators are in the compute dtype. The forward computes
Q(x) @ Q(W)^T on the same path as the rollout forward (the FP8 kernel where the rollout uses one, otherwise the
dequantized operands), so rollout and training still compute the same function; on a CPU it is bit for bit the
straight-through unified forward. What changes is the backward: it sees quantized gradients, as Jet-RL trains.

On a Hopper GPU, where the rollout forward's plan is cuBLAS blockwise FP8 for the shape (M large; N, K multiples
of 128), all three GEMMs run on cuBLAS, x and the output gradient each quantized both ways by one Triton pass
(`quarl.kernels.training_gemm`; `FastPaths.fused_cublas_path`), and the backward keeps x's FP8 codes instead of
x. (For K not a multiple of 512 the rollout runs the same codes on the Triton kernel: equal up to float32
summation order.)
Elsewhere on a GPU the input-gradient GEMM runs on an FP8 kernel (`quarl.kernels.quantized_matmul`) and the weight
gradient multiplies the dequantized operands, or with `FastPaths.fp8_weight_grad_kernel` (off by default) runs on
the FP8 tensor cores. On a CPU all three GEMMs multiply dequantized operands (the reference).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quarl import kernels
from quarl.fast_paths import DEFAULT as DEFAULT_FAST_PATHS, FastPaths
from quarl.formats import QuantizedTensor
from quarl.formats.registry import quantize_unchecked

FORMAT = "fp8-block"

_local = threading.local()  # .shared: this thread's open `shared_input_codes` dict (autograd threads have their own)


def shared_input() -> dict | None:
    """The calling thread's open `shared_input_codes` dict, or None outside a block."""
    return getattr(_local, "shared", None)


@contextlib.contextmanager
def shared_input_codes(enabled: bool = True):
    """Inside this block, FP8-block training linears on the all-cuBLAS path (`FastPaths.fused_cublas_path`)
    quantize a given input (the same tensor: storage, shape, strides and version) once and reuse its codes. Each
    entry holds its input, so no other tensor can take that memory while the block is open; all are dropped when
    the block ends. Same codes, same results: only fewer quantizing passes (q/k/v and gate/up: three of a layer's
    seven forward quantizations). Per thread; a nested block opens its own dict. enabled False
    (`FastPaths.share_input_codes` off): the block shares nothing, each linear quantizes its input itself."""
    outer = shared_input()
    _local.shared = {} if enabled else None
    try:
        yield
    finally:
        _local.shared = outer


def training_gemm_ok(x: torch.Tensor, n: int) -> bool:
    """Whether the all-cuBLAS path (`FastPaths.fused_cublas_path`) applies to x [M, K] and a weight with n rows (see
    `kernels.training_gemm.fused_linear_ok`); False without CUDA, so CPU callers never import Triton."""
    if not x.is_cuda or not kernels.fp8_kernels_available(x.device):
        return False
    from quarl.kernels.training_gemm import fused_linear_ok

    return fused_linear_ok(x, n)


def _rows_fp8(t: torch.Tensor) -> torch.Tensor:
    """t [R, C] with every row rounded in 1x128 groups along C (FP8-block activation rounding), same dtype."""
    return kernels.fake_quantize_activation(t, FORMAT)


def quantized_weight(w: torch.Tensor, dtype: torch.dtype, transpose: bool = False) -> QuantizedTensor:
    """The FP8-block weight operand: Q(w) in 128x128 tiles, or Q(w^T) with transpose, from w [N, K] rounded to
    dtype (the compute dtype, as the rollout copy). On a GPU one Triton pass over w, no transposed copy
    (`quarl.kernels.try_quantize_fp8_block_weight`); elsewhere the reference quantizer. Same codes either way."""
    w = w.detach().to(dtype)
    q = kernels.try_quantize_fp8_block_weight(w, transpose)
    if q is None:
        q = quantize_unchecked((w.t() if transpose else w).contiguous(), FORMAT, "weight")
    return q


def block_matmul(a: torch.Tensor, qb: QuantizedTensor, bias: torch.Tensor | None = None,
                 prefer_kernel: bool = True) -> torch.Tensor:
    """Q(a) @ deq(qb)^T (+ bias) for a [R, C] (1x128 groups along C) and an FP8-block weight qb [S, C] (see
    `quantized_weight`) -> [R, S] in a.dtype; bias [S] or None.

    On a GPU an FP8 kernel (it quantizes `a` itself, exactly as `quantize` does): always with prefer_kernel,
    otherwise only where the kernel measured at least `tuning.MIN_SPEEDUP` x the fallback below
    (`tuning.choose_plan`), which is the rollout forward's own choice (`kernels.try_quantized_matmul`). Elsewhere
    the dequantized operands multiplied in a.dtype, which is the rollout fallback and, bit for bit, the unified
    flow's straight-through forward.
    """
    bias = None if bias is None else bias.to(a.dtype)
    matmul = kernels.quantized_matmul if prefer_kernel else kernels.try_quantized_matmul
    y = matmul(a.contiguous(), qb, False, bias)
    if y is None:
        y = F.linear(_rows_fp8(a), qb.dequantize(a.dtype), bias)
    return y


@dataclass
class FrozenWeightCodes:
    """The two FP8-block operands of a weight W [N, K] that gets no gradient (a base frozen under LoRA), quantized
    once and reused by every forward and backward: forward = Q(W) (`quantized_weight(w, dtype)`), transposed =
    Q(W^T) (`quantized_weight(w, dtype, transpose=True)`)."""

    forward: QuantizedTensor
    transposed: QuantizedTensor
    _padded: dict = field(default_factory=dict, repr=False)

    def padded(self, name: str) -> QuantizedTensor:
        """`forward` or `transposed` with its 128-wide groups padded to a multiple of 4, as cuBLAS blockwise takes
        them (`quarl.formats.fp8.pad_block_groups`): padded once (a copy only where the count is not a multiple
        of 4), not in every call."""
        if name not in self._padded:
            from quarl.formats.fp8 import pad_block_groups

            self._padded[name] = pad_block_groups(getattr(self, name), 4)
        return self._padded[name]


class FP8BlockLinear(torch.autograd.Function):
    """y = Q(x) @ Q(W)^T + b with FP8-block input- and weight-gradient GEMMs (see the module docstring).

    forward(x [M, K] in the compute dtype, weight [N, K] (the master weight, any float dtype), bias [N] or None,
    frozen: the weight's `FrozenWeightCodes` when it gets no gradient, or None to quantize it here, fast_paths:
    a `FastPaths` (`fused_cublas_path`, `fp8_weight_grad_kernel`)) -> y [M, N] in x.dtype. Gradients:
    dx [M, K] in x.dtype, dW [N, K] and db [N] in their parameters' dtypes.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                frozen: FrozenWeightCodes | None = None, fast_paths: FastPaths = DEFAULT_FAST_PATHS) -> torch.Tensor:
        # The forward takes the rollout forward's path, so rollout and training compute the same function.
        if frozen is not None and ctx.needs_input_grad[1]:
            raise ValueError("FP8BlockLinear got FrozenWeightCodes for a weight that requires a gradient; pass "
                             "frozen=None for a trained weight (its codes change every optimizer step)")
        ctx.has_bias = bias is not None
        ctx.weight_dtype = weight.dtype
        ctx.frozen = frozen
        ctx.wgrad_kernel = fast_paths.fp8_weight_grad_kernel
        bias = None if bias is None else bias.detach().to(x.dtype)
        if fast_paths.fused_cublas_path and training_gemm_ok(x, weight.shape[0]):
            from quarl.kernels.training_gemm import linear_forward

            keep = ctx.needs_input_grad[1]
            y, x_codes = linear_forward(x, weight, bias, keep_x_codes=keep,
                                        qweight=None if frozen is None else frozen.padded("forward"),
                                        share=shared_input())
            # x's transposed codes (the weight gradient's operand) and the master weight (Q(W^T) for the input
            # gradient is quantized in the backward, or taken from `frozen`): the backward needs no x.
            ctx.fused = True
            ctx.save_for_backward(weight, *(x_codes if keep else ()))
            return y
        ctx.fused = False
        qw = quantized_weight(weight, x.dtype) if frozen is None else frozen.forward
        y = block_matmul(x, qw, bias, prefer_kernel=False)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = grad_w = grad_b = None
        if ctx.fused:
            from quarl.kernels.training_gemm import linear_backward

            weight, *x_codes = ctx.saved_tensors
            g = grad_out.contiguous()
            grad_x, grad_w = linear_backward(g, weight, x_codes, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                             qweight_t=None if ctx.frozen is None else ctx.frozen.padded("transposed"))
            if grad_w is not None:
                grad_w = grad_w.to(ctx.weight_dtype)  # from the GEMM's bf16 output, rounded once more at most
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g.sum(0)
            return grad_x, grad_w, grad_b, None, None
        x, weight = ctx.saved_tensors
        g = grad_out.to(x.dtype)
        if ctx.needs_input_grad[0]:
            qwt = quantized_weight(weight, x.dtype, transpose=True) if ctx.frozen is None else ctx.frozen.transposed
            grad_x = block_matmul(g, qwt)  # W^T [K, N] in its tiles
        if ctx.needs_input_grad[1]:
            # Both operands grouped along M (the reduction): rows of g^T and rows of x^T, i.e. columns of g and x.
            grad_w = _weight_grad(g, x, ctx.wgrad_kernel).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None


def _weight_grad(g: torch.Tensor, x: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """Q(g^T) @ Q(x^T)^T [N, K] for g [M, N], x [M, K] (one dtype), both rounded in 1x128 groups along M: on the
    FP8 tensor cores (`kernels.training_gemm.fp8_block_weight_grad`, cuBLAS 1x128 x 1x128 on Hopper) where `kernel`
    (`FastPaths.fp8_weight_grad_kernel`) asks for it and it runs, else the rounded operands multiplied in g's
    dtype. Same operands either way; the FP8 path's output is bf16 (then the weight's dtype)."""
    if kernel and g.is_cuda and g.dtype in (torch.bfloat16, torch.float16) and \
            kernels.fp8_kernels_available(g.device):
        from quarl.kernels.training_gemm import fp8_block_weight_grad

        return fp8_block_weight_grad(g.contiguous(), x.contiguous())
    return kernels.fake_quantize_columns(g).t() @ kernels.fake_quantize_columns(x)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     frozen: FrozenWeightCodes | None = None,
                     fast_paths: FastPaths = DEFAULT_FAST_PATHS) -> torch.Tensor:
    """x [..., K] -> [..., N] through `FP8BlockLinear` (leading dimensions flattened into M); frozen: the
    weight's `FrozenWeightCodes` when it gets no gradient, fast_paths: the linear's (see `FP8BlockLinear`)."""
    y = FP8BlockLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias, frozen, fast_paths)
    return y.reshape(*x.shape[:-1], y.shape[-1])
