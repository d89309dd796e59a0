"""The 8-bit GEMV kernels (`quarl.kernels.gemv.w8_gemv`, M <= 4) and the split-K W8A8 GEMM
(`quarl.kernels.w8a8_gemm.w8a8_matmul`) in Triton's CPU interpreter,
against the float64 reference dequant(Q(x)) @ dequant(W)^T (+ bias) from the same codes.

Tolerance 2e-3 relative (Frobenius): the codes and scales are reproduced exactly and multiplied with float32
accumulation, so what remains is the final rounding to fp16 (2^-11 per element) and the summation order. fp16
inputs: the interpreter truncates float32 -> bf16 instead of rounding it. The same checks run compiled on a GPU
in tests/test_kernels_gpu.py (test_gemv_matches_reference, test_w8a8_gemm_matches_reference).
"""

import textwrap

import pytest

from interpreter import INTERPRETER_PATCH, run_in_interpreter

_GEMV_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    from quarl.formats import quantize
    from quarl.kernels.gemv import w8_gemv

    FMT = FMT_ARG
    torch.manual_seed(SEED_ARG)
    # M = 1..4; N not a multiple of BN; K not a multiple of BK (fp8-block: nor of 128); BK of several 128-groups
    for m, n, k, bn, bk in [(1, 40, 1000, 16, 256), (2, 24, 512, 8, 512), (3, 20, 384, 8, 512),
                            (4, 12, 200, 4, 128), (1, 9, 700, 8, 1024)]:
        w = torch.randn(n, k) * 0.05
        x = (torch.randn(m, k) * torch.exp(torch.randn(m, 1))).half()  # rows of different magnitude
        b = (torch.randn(n) * 0.1).half() if m % 2 else None
        qw = quantize(w, FMT)
        for mode in (0, 1, 2):
            xq = quantize(x, FMT, "activation") if mode == 2 else None
            xq = None if xq is None else (xq.data, xq.scale)
            y = w8_gemv(x, qw, b, bn, bk, 4, 1, mode, xq)
            xr = x.double() if mode == 0 else quantize(x, FMT, "activation").dequantize(torch.float64)
            ref = xr @ qw.dequantize(torch.float64).T + (0 if b is None else b.double())
            assert y.shape == (m, n) and y.dtype == torch.float16
            err = float((y.double() - ref).norm() / ref.norm())
            assert err < 2e-3, (FMT, mode, m, n, k, bn, bk, err)
    print("ok")
""")


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
def test_w8_gemv_matches_reference_in_the_interpreter(fmt):
    import torch

    seed = int(torch.randint(0, 2**31, (1,)))
    run_in_interpreter(_GEMV_CHECK.replace("FMT_ARG", repr(fmt)).replace("SEED_ARG", str(seed)))


_SPLITK_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    from quarl.formats import quantize
    from quarl.kernels import w8a8_gemm
    from quarl.kernels.tuning import Cfg

    FMT = FMT_ARG
    torch.manual_seed(SEED_ARG)
    # M, N not multiples of the tile; K not a multiple of the split's K range (uneven splits, a padded K step)
    for m, n, k, cfg in [(5, 40, 1000, Cfg(16, 16, 128, split_k=3)), (20, 24, 384, Cfg(16, 16, 128, split_k=2)),
                         (3, 70, 600, Cfg(64, 32, 128, split_k=4, native=True))]:
        w = torch.randn(n, k) * 0.05
        x = (torch.randn(m, k) * torch.exp(torch.randn(m, 1))).half()
        b = (torch.randn(n) * 0.1).half() if m % 2 else None
        qw = quantize(w, FMT)
        for mode in (1, 2):
            xr = quantize(x, FMT, "activation")
            ref = xr.dequantize(torch.float64) @ qw.dequantize(torch.float64).T + (0 if b is None else b.double())
            y = w8a8_gemm.w8a8_matmul(x, qw, b, cfg, mode, (xr.data, xr.scale) if mode == 2 else None)
            err = float((y.double() - ref).norm() / ref.norm())
            assert y.shape == (m, n) and err < 2e-3, (FMT, mode, m, n, k, cfg, err)
    print("ok")
""")


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
def test_split_k_w8a8_matches_reference_in_the_interpreter(fmt):
    import torch

    seed = int(torch.randint(0, 2**31, (1,)))
    run_in_interpreter(_SPLITK_CHECK.replace("FMT_ARG", repr(fmt)).replace("SEED_ARG", str(seed)))
