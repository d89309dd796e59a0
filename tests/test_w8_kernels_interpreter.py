"""The 8-bit GEMV kernel (`quarl.kernels.gemv.w8_gemv`, M = 1) and the split-K W8A8 GEMM
(`quarl.kernels.w8a8_gemm.w8a8_matmul`, also its transposed product) in Triton's CPU interpreter,
against the float64 reference dequant(Q(x)) @ dequant(W)^T (+ bias) from the same codes.

Tolerance 2e-3 relative (Frobenius): the codes and scales are reproduced exactly and multiplied with float32
accumulation, so what remains is the final rounding to fp16 (2^-11 per element) and the summation order. The
same checks run compiled on a GPU, in bf16,
in tests/test_kernels_gpu.py (test_gemv_matches_reference, test_w8a8_gemm_matches_reference).
"""

import textwrap
from types import SimpleNamespace

import pytest

from interpreter import INTERPRETER_PATCH, run_in_interpreter

_HELPERS = textwrap.dedent("""
    import dataclasses
    from quarl.formats import quantize

    FMT = FMT_ARG
    torch.manual_seed(SEED_ARG)
    print("seed", SEED_ARG)  # shown with the traceback when a check fails

    def nan_padded(t):
        \"\"\"t [R, C] as a view into a NaN-filled [R, C + 8] buffer: a kernel reading a scale past a row's end
        (or into the next row) gets NaN, which poisons its output.\"\"\"
        if t.dim() != 2:
            return t
        big = torch.full((t.shape[0], t.shape[1] + 8), float("nan"), dtype=t.dtype)
        big[:, :t.shape[1]] = t
        return big[:, :t.shape[1]]

    def operands(m, n, k, bias=True):
        \"\"\"(x fp16 [m, k] with rows of different magnitude, bias or None, weight and activation
        QuantizedTensors whose scales are NaN-padded views, float64 reference of the W8A8 and W8A16 products)\"\"\"
        w = torch.randn(n, k) * 0.05
        x = (torch.randn(m, k) * torch.exp(torch.randn(m, 1))).half()
        b = (torch.randn(n) * 0.1).half() if bias else None
        qw = quantize(w, FMT)
        qw = dataclasses.replace(qw, scale=nan_padded(qw.scale))
        xq = quantize(x, FMT, "activation")
        xq = dataclasses.replace(xq, scale=nan_padded(xq.scale))
        wd = qw.dequantize(torch.float64).T
        bias = 0 if b is None else b.double()
        return x, b, qw, xq, xq.dequantize(torch.float64) @ wd + bias, x.double() @ wd + bias

    def rel_err(y, ref):
        return float((y.double() - ref).norm() / ref.norm())
""")

_GEMV_CHECK = INTERPRETER_PATCH + _HELPERS + textwrap.dedent("""
    from quarl.kernels import dispatch
    from quarl.kernels.gemv import w8_gemv
    from quarl.kernels.tuning import Cfg, Plan

    # N not a multiple of BN, and over several 128-row weight tiles; K not a multiple of BK (fp8-block: nor of
    # 128), BK of several 128-groups, K over the amax pass's 4096-column loads, K a multiple of BK (EVEN_K)
    m = 1
    for n, k, bn, bk, bias in [(40, 1000, 16, 256, True), (24, 512, 8, 512, False), (20, 384, 8, 512, True),
                               (12, 200, 4, 128, False), (9, 700, 8, 1024, True), (200, 4500, 16, 512, True),
                               (136, 4096, 8, 512, False)]:
        x, b, qw, xq, ref, ref_raw = operands(m, n, k, bias)
        ys = {}
        for mode in (0, 1, 2):
            if FMT == "fp8-tensor" and mode == 1:
                continue  # a per-tensor activation scale needs the whole tensor first: always prequant
            ys[mode] = y = w8_gemv(x, qw, b, bn, bk, 4, 1, mode, (xq.data, xq.scale) if mode == 2 else None)
            err = rel_err(y, ref_raw if mode == 0 else ref)
            assert y.shape == (m, n) and y.dtype == torch.float16
            assert err < 2e-3, (FMT, mode, m, n, k, bn, bk, err)
        if 1 in ys:  # the codes quantized inside equal the prequantized ones, summed in the same order
            assert torch.equal(ys[1], ys[2]), (FMT, m, n, k)
        plan = Plan("gemv", Cfg(1, bn, bk, warps=4, stages=1), "prequant")  # handed-over codes, the same kernel
        assert torch.equal(dispatch.codes_matmul(plan, xq.data, xq.scale, qw, b, torch.float16), ys[2])
    print("ok")
""")


def _run_check(script: str, fmt: str) -> None:
    """Run a check script for one format with a fresh seed (printed by the script)."""
    import torch

    seed = int(torch.randint(0, 2**31, (1,)))
    run_in_interpreter(script.replace("FMT_ARG", repr(fmt)).replace("SEED_ARG", str(seed)))


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "fp8-tensor"])
def test_w8_gemv_matches_reference_in_the_interpreter(fmt):
    _run_check(_GEMV_CHECK, fmt)


_SPLITK_CHECK = INTERPRETER_PATCH + _HELPERS + textwrap.dedent("""
    from quarl.kernels import w8a8_gemm
    from quarl.kernels.tuning import Cfg

    # M, N not multiples of the tile; K not a multiple of the split's K range (uneven splits, a padded K step,
    # a last split whose range reaches past Kp); the transposed product (swap_ab) with and without native codes
    for m, n, k, cfg in [(5, 40, 1000, Cfg(16, 16, 128, split_k=3)), (20, 24, 384, Cfg(16, 16, 128, split_k=2)),
                         (3, 70, 600, Cfg(64, 32, 128, split_k=4, native=True)),
                         (5, 200, 1000, Cfg(16, 64, 128, split_k=3, native=True, swap_ab=True)),
                         (20, 40, 384, Cfg(16, 32, 128, split_k=2, swap_ab=True))]:
        x, b, qw, xq, ref, ref_raw = operands(m, n, k, bias=m % 2 == 1)
        if cfg.swap_ab and not cfg.native:  # weight-only (W8A16) through the transposed product too
            y = w8a8_gemm.w8a8_matmul(x, qw, b, cfg, 0)
            assert rel_err(y, ref_raw) < 2e-3, (FMT, 0, m, n, k, cfg, rel_err(y, ref_raw))
        for mode in (1, 2):
            y = w8a8_gemm.w8a8_matmul(x, qw, b, cfg, mode, (xq.data, xq.scale) if mode == 2 else None)
            assert y.shape == (m, n) and rel_err(y, ref) < 2e-3, (FMT, mode, m, n, k, cfg, rel_err(y, ref))
    print("ok")
""")


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
def test_split_k_w8a8_matches_reference_in_the_interpreter(fmt):
    _run_check(_SPLITK_CHECK, fmt)


_TMA_CHECK = INTERPRETER_PATCH + _HELPERS + textwrap.dedent("""
    from quarl.kernels import dispatch, w8a8_gemm
    from quarl.kernels.tuning import Cfg, Plan

    launches = []
    tma = w8a8_gemm._w8a8_tma
    w8a8_gemm._w8a8_tma = lambda *a: launches.append(a[-2]) or tma(*a)
    # Several tiles per program (the persistent walk), M and N not multiples of the tile, K over several steps and
    # not a multiple of BK (the descriptor's zero fill past KP), with and without bias; K = 200 has rows of 200
    # bytes, which TMA cannot address (not a multiple of 16): the regular kernel must take over.
    for m, n, k, cfg, by_tma in [(70, 40, 384, Cfg(64, 32, 128, native=True, tma=True), True),
                                 (130, 72, 400, Cfg(64, 64, 128, group_m=2, native=True, tma=True), True),
                                 (9, 24, 200, Cfg(64, 32, 128, native=True, tma=True), False)]:
        x, b, qw, xq, ref, _ = operands(m, n, k, bias=m % 2 == 0)
        before = len(launches)
        y = w8a8_gemm.w8a8_matmul(x, qw, b, cfg, 2, (xq.data, xq.scale))
        assert (len(launches) > before) == by_tma, (m, n, k, launches)
        assert y.shape == (m, n) and rel_err(y, ref) < 2e-3, (FMT, m, n, k, cfg, rel_err(y, ref))
        if FMT != "fp8-tensor":  # handed-over codes (dispatch.codes_matmul), also laid out column-major
            codes = xq.data.t().contiguous().t()
            y2 = dispatch.codes_matmul(Plan("w8a8", cfg, "prequant"), codes, xq.scale, qw, b, torch.float16)
            assert torch.equal(y2, y), (FMT, m, n, k)
    # The transposed decode kernel (swap_ab): all M rows in one tile of bm rows, N not a multiple of bn, K not a
    # multiple of BK, split-K (partials reduced by splitk_reduce) or not; K = 200 again falls back.
    swap_launches = []
    swap = w8a8_gemm._w8a8_tma_swap
    w8a8_gemm._w8a8_tma_swap = lambda *a: swap_launches.append(a[-2]) or swap(*a)
    for m, n, k, cfg, by_tma in [(5, 200, 1008, Cfg(16, 64, 128, split_k=3, native=True, swap_ab=True, tma=True), True),
                                 (1, 72, 400, Cfg(16, 64, 128, native=True, swap_ab=True, tma=True), True),
                                 (40, 100, 384, Cfg(64, 64, 128, split_k=2, native=True, swap_ab=True, tma=True),
                                  True),
                                 (9, 24, 200, Cfg(16, 64, 128, split_k=2, native=True, swap_ab=True, tma=True),
                                  False)]:
        x, b, qw, xq, ref, _ = operands(m, n, k, bias=m % 2 == 1)
        before = len(swap_launches)
        y = w8a8_gemm.w8a8_matmul(x, qw, b, cfg, 2, (xq.data, xq.scale))
        assert (len(swap_launches) > before) == by_tma, (m, n, k, swap_launches)
        assert y.shape == (m, n) and rel_err(y, ref) < 2e-3, (FMT, m, n, k, cfg, rel_err(y, ref))
    # no rows: an empty result, not a TMA descriptor of shape 0
    x, b, qw, xq, ref, _ = operands(1, 40, 384)
    sx = xq.scale if xq.scale.dim() == 0 else xq.scale[:0]  # (fp8-tensor: one scale for the whole tensor)
    y = w8a8_gemm.w8a8_matmul(x[:0], qw, b, Cfg(64, 32, 128, native=True, tma=True), 2, (xq.data[:0], sx))
    assert y.shape == (0, 40)
    print("ok")
""")


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-tensor"])
def test_tma_w8a8_matches_reference_in_the_interpreter(fmt):
    _run_check(_TMA_CHECK, fmt)


def test_tma_w8a8_refuses_what_it_cannot_run():
    pytest.importorskip("triton")
    import torch

    from quarl.formats import quantize
    from quarl.kernels.tuning import Cfg
    from quarl.kernels.w8a8_gemm import X_FUSED, X_PREQUANT, w8a8_matmul

    x = torch.randn(4, 128).half()
    tma = Cfg(64, 64, 128, native=True, tma=True)
    for fmt, mode, cfg in [("fp8", X_FUSED, tma), ("fp8-block", X_PREQUANT, tma),
                           ("int8", X_PREQUANT, Cfg(64, 64, 128, split_k=2, native=True, tma=True))]:
        xq = quantize(x, fmt, "activation")
        with pytest.raises(ValueError, match="TMA W8A8 kernels take prequantized"):
            w8a8_matmul(x, quantize(torch.randn(8, 128), fmt), None, cfg, mode, (xq.data, xq.scale))
    xq = quantize(x, "int8", "activation")
    with pytest.raises(ValueError, match="covers all M rows in one tile"):  # 4 rows, a 2-row tile
        w8a8_matmul(x, quantize(torch.randn(8, 128), "int8"), None,
                    Cfg(2, 64, 128, native=True, swap_ab=True, tma=True), X_PREQUANT, (xq.data, xq.scale))
    with pytest.raises(ValueError, match="at most 256 rows and 256 columns"):
        w8a8_matmul(x, quantize(torch.randn(8, 128), "int8"), None, Cfg(64, 64, 512, native=True, tma=True),
                    X_PREQUANT, (xq.data, xq.scale))


def test_plans_drop_tma_and_native_codes_before_hopper(monkeypatch):
    """Before Hopper (no wgmma, no TMA) a measured TMA plan runs the same tile on the fp16 tensor cores, with its
    pipeline stages capped to fit the smaller shared memory."""
    pytest.importorskip("triton")
    import torch

    from quarl import kernels
    from quarl.kernels import tuning
    from quarl.kernels.tuning import choose_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "NVIDIA A100-SXM4-80GB")  # no device to ask for its name
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    for fmt in ("int8", "fp8"):
        plan = kernels.plan_for(fmt, False, 4096, 37888, 3584)
        assert plan.kind == "w8a8" and not plan.cfg.tma and not plan.cfg.native, plan
        assert choose_plan(fmt, False, 4096, 37888, 3584).cfg.tma  # the measured plan was TMA
    # Every W8A8 tile keeps its pipelined 8-bit operands within PRE_HOPPER_STAGE_BYTES of shared memory there
    # (the H200-tuned stages would ask for up to ~192 KB; an sm_89 block gets 99 KB).
    capped = 0
    for fmt in ("int8", "fp8", "fp8-block"):
        for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)):
            for m in (1, 16, 64, 256, 512, 1024, 4096):
                plan = kernels.plan_for(fmt, False, m, n, k, prefer_kernel=True)
                if plan.kind != "w8a8":
                    continue
                c, measured = plan.cfg, choose_plan(fmt, False, m, n, k, prefer_kernel=True).cfg
                assert not c.native and not c.tma, plan
                assert c.stages * (c.bm + c.bn) * c.bk <= kernels.PRE_HOPPER_STAGE_BYTES or c.stages == 1, plan
                if measured is None:  # a cuBLAS FP8 plan, which needs Hopper: a W8A8 tile instead
                    continue
                assert (c.bm, c.bn, c.bk, c.split_k) == (measured.bm, measured.bn, measured.bk, measured.split_k)
                capped += c.stages < measured.stages
    assert capped > 0


def test_nvfp4_has_no_kernel_before_ada(monkeypatch):
    """nvfp4's E4M3 block scales need FP8 in Triton (compute capability >= 8.9): on Ampere the dispatch runs bf16
    (the caller's dequantize path) instead of a kernel that cannot compile; mxfp4 (E8M0 scales) keeps its kernels."""
    pytest.importorskip("triton")
    import torch

    from quarl import kernels
    from quarl.kernels import availability, tuning

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "NVIDIA A100-SXM4-80GB")  # no device to ask for its name
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for m in (1, 16, 64, 1024):
        assert kernels.plan_for("nvfp4", True, m, 37888, 3584, prefer_kernel=True).kind == "bf16"
        assert kernels.plan_for("mxfp4", True, m, 37888, 3584, prefer_kernel=True).kind != "bf16"
    # the dense-weight kernel (E4M3 scales too) is skipped the same way: the caller dequantizes in torch
    monkeypatch.setattr(availability, "kernels_available", lambda device=None: True)
    on_gpu = SimpleNamespace(fmt="nvfp4", role="weight", shape=(64, 64),
                             data=SimpleNamespace(is_cuda=True, device="cuda:0"))
    assert kernels.try_dequantize(on_gpu, torch.bfloat16) is None


def test_w8_gemv_takes_one_row():
    pytest.importorskip("triton")
    import torch

    from quarl.formats import quantize
    from quarl.kernels.gemv import w8_gemv

    qw = quantize(torch.randn(8, 128), "fp8")
    with pytest.raises(ValueError, match="one row, got M=2"):
        w8_gemv(torch.randn(2, 128).half(), qw, None, 8, 128, 4, 1, 1)


_DEQUANT_CHECK = INTERPRETER_PATCH + _HELPERS + textwrap.dedent("""
    from quarl.kernels.dequant import dequantize_8bit_weight

    # SmolLM2's shapes (K = 576: a padded last fp8-block tile) and ones off every block size; a NaN-padded scale
    # view catches a kernel that reads past a row's scales
    for n, k in [(576, 1536), (200, 576), (129, 257), (1, 100)]:
        w = torch.randn(n, k) * torch.exp(torch.randn(n, 1))
        qw = quantize(w, FMT, "weight")
        qw = dataclasses.replace(qw, scale=nan_padded(qw.scale))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = dequantize_8bit_weight(qw, dtype)
            assert got.shape == (n, k) and got.dtype == dtype, (FMT, n, k, dtype)
            assert torch.equal(got, qw.dequantize(dtype)), (FMT, n, k, dtype)  # code * scale, rounded once
    print("ok")
""")


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-tensor", "fp8-block"])
def test_8bit_weight_dequant_equals_the_reference_in_the_interpreter(fmt):
    _run_check(_DEQUANT_CHECK, fmt)


_INTO_VIEWS_CHECK = INTERPRETER_PATCH + _HELPERS + textwrap.dedent("""
    from quarl.kernels.act_quant import quantize_activation
    from quarl.kernels.dequant import dequantize_8bit_weight
    from quarl.kernels.weight_quant import quantize_fp8_block_weight

    # the sync's writes: each weight quantized straight into its rows of a stacked buffer (the fused decoder's
    # q/k/v), and dequantized straight into a cache; the neighbouring rows must stay as they were
    k = 576  # SmolLM2's hidden size
    block = FMT == "fp8-block"
    # SmolLM2's q/k/v; fp8-block stacks whole 128-row tiles only
    parts = [torch.randn(n, k).bfloat16() * 0.05 for n in ((384, 128, 128) if block else (576, 192, 192))]
    kp = -(-k // 128) * 128 if block else k
    total = sum(p.shape[0] for p in parts)
    codes = torch.full((total, kp), 7, dtype=torch.int8 if FMT == "int8" else torch.uint8)
    scales = torch.full((-(-total // 128), kp // 128) if block else (total, 1), -1.0)
    row = 0
    for w in parts:
        n = w.shape[0]
        before_c, before_s = codes.clone(), scales.clone()
        if block:
            srows = slice(row // 128, (row + n) // 128)
            qt = quantize_fp8_block_weight(w, out=(codes[row:row + n], scales[srows]))
            fresh = quantize_fp8_block_weight(w)
        else:
            srows = slice(row, row + n)
            c, s = quantize_activation(w, FMT, k, out=(codes[row:row + n], scales[srows]))
            qt = quantize(w, FMT, "weight")
            qt = dataclasses.replace(qt, data=c, scale=s)
            fc, fs = quantize_activation(w, FMT, k)
            fresh = dataclasses.replace(qt, data=fc, scale=fs)
        assert torch.equal(codes[row:row + n].view(torch.uint8), fresh.data.view(torch.uint8))
        assert torch.equal(scales[srows].reshape(-1), fresh.scale.reshape(-1))
        assert qt.data.data_ptr() == codes[row:row + n].data_ptr()  # written in place, not copied
        rest = torch.ones(total, dtype=torch.bool)
        rest[row:row + n] = False
        assert torch.equal(codes[rest], before_c[rest])  # nothing written outside the part's rows
        srest = torch.ones(scales.shape[0], dtype=torch.bool)
        srest[srows] = False
        assert torch.equal(scales[srest], before_s[srest])
        cache = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
        assert dequantize_8bit_weight(qt, torch.bfloat16, out=cache) is cache
        assert torch.equal(cache, fresh.dequantize(torch.bfloat16))
        row += n
    print("ok")
""")


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
def test_weights_quantize_and_dequantize_straight_into_given_buffers_in_the_interpreter(fmt):
    """The weight sync's in-place writes (`out=`): int8 / fp8 codes and scales from the per-row quantizer and
    fp8-block tiles from the tile quantizer, written into row views of one stacked buffer, equal those of a fresh
    quantization bit for bit and leave every other row untouched; the dequantized cache written in place equals
    the reference dequantization."""
    _run_check(_INTO_VIEWS_CHECK, fmt)


def test_given_buffers_of_the_wrong_layout_are_refused():
    pytest.importorskip("triton")
    import torch

    from quarl.kernels.act_quant import quantize_activation
    from quarl.kernels.dequant import dequantize_8bit_weight
    from quarl.formats import quantize

    w = torch.randn(8, 128)
    with pytest.raises(ValueError, match=r"int8 codes out must be \[8, 128\]"):
        quantize_activation(w, "int8", 128, out=(torch.empty(8, 64, dtype=torch.int8), torch.empty(8)))
    with pytest.raises(ValueError, match="scales out must be 8 float32"):
        quantize_activation(w, "int8", 128, out=(torch.empty(8, 128, dtype=torch.int8), torch.empty(4)))
    with pytest.raises(ValueError, match="per-row formats only"):
        quantize_activation(w, "fp8-block", 128, out=(torch.empty(8, 128, dtype=torch.uint8), torch.empty(8)))
    with pytest.raises(ValueError, match="dequantize out must be"):
        dequantize_8bit_weight(quantize(w, "int8", "weight"), torch.bfloat16, out=torch.empty(8, 128))
