"""`quarl.kernels.fp4_decode` (W4A16 decode GEMMs, M <= 64) against the float64 reference.

Reference: x.double() @ dequantize(W).double().T (+ bias). Error: max over rows of max_n |y - ref| / max_n |ref|.
The kernels multiply exact operands (x's own values, code * block scale exact in bf16/fp16) with fp32
accumulation and round once to x.dtype, so the tolerance is that rounding: 2^-8 (bf16) / 2^-11 (fp16) relative
to the row's magnitude, plus 2^-14 for fp32 summation order.
The config checks at the end need neither a GPU nor Triton; the input checks need Triton (skipped without it).
The same kernels are checked in Triton's CPU interpreter by `TRITON_INTERPRET=1 python tests/fp4_decode_interpret.py`.
"""

from __future__ import annotations

import pytest
import torch

from quarl.formats import quantize
from quarl.kernels.tuning import Cfg, Plan, check_fp4_decode_cfg

gpu = pytest.mark.gpu
TOL = {torch.bfloat16: 2.0**-8 + 2.0**-14, torch.float16: 2.0**-11 + 2.0**-14}

# (M, N, K): M = 1, M not a power of two (5, 37), N not a multiple of any bn, K not a multiple of 16 (padded
# weight) or of bk, and the Qwen2.5-7B o shape.
SHAPES = [(1, 256, 512), (5, 300, 1000), (37, 96, 272), (8, 4608 // 9, 3584), (64, 200, 200), (16, 3584, 3584)]
FMA_CFGS = [Cfg(1, 8, 512), Cfg(1, 16, 256, warps=2), Cfg(1, 4, 1024, split_k=3), Cfg(1, 32, 64, split_k=2, warps=8)]
MMA_CFGS = [Cfg(16, 64, 256), Cfg(16, 128, 128, split_k=4, stages=4), Cfg(16, 64, 128, split_k=3, stages=2),
            Cfg(16, 256, 128, split_k=2, warps=8), Cfg(16, 128, 256, warps=8), Cfg(16, 64, 128, split_k=2, native=True),
            Cfg(16, 64, 256, native=True)]


def _reference(x, qw, bias):
    ref = x.double() @ qw.dequantize(torch.float64).T
    return ref if bias is None else ref + bias.double()


def _row_err(y, ref) -> float:
    assert torch.isfinite(y).all(), "output has NaN/Inf (unwritten or overflowed elements)"
    return float(((y.double() - ref).abs().amax(1) / ref.abs().amax(1)).max())


def _case(m, n, k, fmt, dtype, with_bias, device="cuda"):
    w = torch.randn(n, k, device=device) * 0.05
    x = (torch.randn(m, k, device=device) * 2).to(dtype)
    b = (torch.randn(n, device=device) * 0.1).to(dtype) if with_bias else None
    return x, quantize(w, fmt), b


def _check(cfg, fmt, dtype, with_bias, shapes):
    from quarl.kernels.fp4_decode import fp4_decode_matmul

    for m, n, k in shapes:
        x, qw, b = _case(m, n, k, fmt, dtype, with_bias)
        # NaN in freed memory: an output element or partial the kernel never writes shows up as NaN.
        torch.full((m * n * 8 + 1024,), float("nan"), device="cuda")
        y = fp4_decode_matmul(x, qw, b, cfg)
        assert y.shape == (m, n) and y.dtype == dtype
        err = _row_err(y, _reference(x, qw, b))
        assert err <= TOL[dtype], f"{cfg.name()} {fmt} {dtype} bias={with_bias} M={m} N={n} K={k}: err {err:.2e}"


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("cfg", FMA_CFGS, ids=lambda c: c.name())
def test_fma_path_matches_reference(cfg, dtype, with_bias):
    _check(cfg, "nvfp4", dtype, with_bias, [s for s in SHAPES if s[0] <= 8])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("cfg", MMA_CFGS, ids=lambda c: c.name())
def test_mma_path_matches_reference(cfg, dtype, with_bias):
    _check(cfg, "nvfp4", dtype, with_bias, SHAPES)


@gpu
@pytest.mark.parametrize("cfg", [FMA_CFGS[0], FMA_CFGS[2], MMA_CFGS[0], MMA_CFGS[1]], ids=lambda c: c.name())
def test_mxfp4_matches_reference(cfg):
    shapes = [s for s in SHAPES if cfg.bm == 16 or s[0] <= 8]
    _check(cfg, "mxfp4", torch.bfloat16, True, shapes)


@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_extreme_block_scales_are_exact(fmt):
    """Rows whose block scales are tiny (E4M3 subnormals for nvfp4, low E8M0 exponents for mxfp4) or large, and
    all-zero blocks: the tensor-core path folds powers of two into the scales (bf16 patterns; NVFP4 x 2^118,
    MXFP4 2^(e-25)) and must stay exact over the range it documents (MXFP4 exponents 26..152)."""
    from quarl.kernels.fp4_decode import fp4_decode_matmul

    n, k = 192, 1024
    w = torch.randn(n, k, device="cuda") * 0.05
    row_scale = torch.ones(n, 1, device="cuda")
    # nvfp4: block scales below 2^-6 (E4M3 subnormals); mxfp4: exponents near both ends of 26..152
    row_scale[0::3] = 1e-5 if fmt == "nvfp4" else 2.0**-94
    row_scale[1::3] = 1.0 if fmt == "nvfp4" else 2.0**29
    w = w * row_scale
    w.view(n, k // 32, 32)[2::5, 3::4] = 0.0  # zero blocks (nvfp4: scale 0, codes 0)
    qw = quantize(w, fmt)
    if fmt == "nvfp4":
        s = qw.scale.float()
        assert ((s > 0) & (s < 2.0**-6)).any(), "the test needs subnormal E4M3 block scales"
    else:
        e = qw.scale.view(torch.uint8).int()
        assert 26 <= e.min() <= 32 and 145 <= e.max() <= 152, (e.min(), e.max())
    for m, cfg in [(16, Cfg(16, 64, 128, split_k=2)), (3, Cfg(16, 128, 256, warps=8))]:
        x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
        y = fp4_decode_matmul(x, qw, None, cfg)
        err = _row_err(y, _reference(x, qw, None))
        assert err <= TOL[torch.bfloat16], f"{fmt} {cfg.name()} M={m}: err {err:.2e}"


@gpu
def test_row_strided_x():
    """x may be a column slice of a wider tensor (row stride > K), on both paths and with x permuted."""
    from quarl.kernels.fp4_decode import fp4_decode_matmul

    w = quantize(torch.randn(200, 512, device="cuda") * 0.05, "nvfp4")
    wide = (torch.randn(16, 600, device="cuda") * 2).to(torch.bfloat16)
    for m, cfg in [(16, Cfg(16, 64, 128, split_k=2)), (16, Cfg(16, 64, 128, native=True)), (3, Cfg(1, 8, 128))]:
        x = wide[:m, :512]
        assert not x.is_contiguous()
        err = _row_err(fp4_decode_matmul(x, w, None, cfg), _reference(x, w, None))
        assert err <= TOL[torch.bfloat16], f"{cfg.name()} M={m}: err {err:.2e}"


@gpu
def test_split_k_is_deterministic_and_reusable():
    """The last program of a tile sums the partials in split order: repeated calls (tickets reset themselves)
    give bit-identical results, also between calls with different tile counts."""
    from quarl.kernels.fp4_decode import fp4_decode_matmul

    cfg = Cfg(16, 64, 256, split_k=5)
    x, qw, b = _case(16, 1000, 3000, "nvfp4", torch.bfloat16, True)
    y0 = fp4_decode_matmul(x, qw, b, cfg)
    x2, qw2, _ = _case(3, 4000, 512, "nvfp4", torch.bfloat16, False)
    for _ in range(3):
        fp4_decode_matmul(x2, qw2, None, Cfg(1, 8, 128, split_k=4))
        assert torch.equal(fp4_decode_matmul(x, qw, b, cfg), y0)
    assert _row_err(y0, _reference(x, qw, b)) <= TOL[torch.bfloat16]


@gpu
def test_cuda_graph_replay():
    from quarl.kernels.fp4_decode import fp4_decode_matmul

    cfg = Cfg(16, 64, 256, split_k=4)
    x, qw, _ = _case(16, 512, 2048, "nvfp4", torch.bfloat16, False)
    fp4_decode_matmul(x, qw, None, cfg)  # compile and allocate the tickets outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fp4_decode_matmul(x, qw, None, cfg)
    for _ in range(3):
        x.copy_((torch.randn_like(x, dtype=torch.float32) * 2).to(x.dtype))
        g.replay()
        torch.cuda.synchronize()
        assert _row_err(y, _reference(x, qw, None)) <= TOL[torch.bfloat16]


@gpu
def test_run_plan_kind_fp4_decode():
    from quarl.kernels.dispatch import run_plan

    x, qw, b = _case(5, 300, 1000, "nvfp4", torch.bfloat16, True)
    y = run_plan(Plan("fp4_decode", Cfg(1, 8, 512)), x, qw, b)
    assert _row_err(y, _reference(x, qw, b)) <= TOL[torch.bfloat16]


@gpu
def test_empty_m():
    from quarl.kernels.fp4_decode import fp4_decode_matmul

    x, qw, _ = _case(0, 64, 128, "nvfp4", torch.bfloat16, False)
    assert fp4_decode_matmul(x, qw, None, Cfg(1, 8, 64)).shape == (0, 64)


# ------------------------------------------------------------------ input checks (need Triton, not a GPU)


def _cpu_inputs(m=4, n=32, k=64, fmt="nvfp4", dtype=torch.bfloat16):
    return _case(m, n, k, fmt, dtype, False, device="cpu")


@pytest.mark.parametrize("change, match", [
    (dict(m=65), "M <= 64"),
    (dict(m=9, cfg=Cfg(1, 8, 64)), "cfg.bm=16"),
    (dict(fmt="int8"), "nvfp4 / mxfp4"),
    (dict(dtype=torch.float32), "bfloat16 or float16"),
    (dict(fmt="mxfp4", dtype=torch.float16), "bfloat16 x"),
    (dict(noncontig=True), "contiguous along K"),
    (dict(k_mismatch=True), "input features"),
    (dict(bias=torch.zeros(31)), "bias must be"),
    (dict(cfg=Cfg(32, 64, 128)), "selects no path"),
])
def test_input_errors(change, match):
    pytest.importorskip("triton")
    from quarl.kernels.fp4_decode import fp4_decode_matmul

    x, qw, _ = _cpu_inputs(change.get("m", 4), fmt=change.get("fmt", "nvfp4"),
                           dtype=change.get("dtype", torch.bfloat16))
    if change.get("noncontig"):
        x = torch.zeros(64, 4, dtype=x.dtype).T
    if change.get("k_mismatch"):
        x = x[:, :48].contiguous()
    with pytest.raises(ValueError, match=match):
        fp4_decode_matmul(x, qw, change.get("bias"), change.get("cfg", Cfg(16, 64, 128)))


# ------------------------------------------------------------------ config checks (no Triton, no GPU)


@pytest.mark.parametrize("cfg, match", [
    (Cfg(8, 64, 128), "selects no path"),
    (Cfg(16, 8, 128), "cfg.bn=8"),
    (Cfg(1, 12, 128), "cfg.bn=12"),
    (Cfg(16, 64, 64), "cfg.bk=64"),
    (Cfg(1, 8, 32), "cfg.bk=32"),
    (Cfg(1, 8, 96), "cfg.bk=96"),
    (Cfg(16, 64, 128, split_k=0), "split_k"),
    (Cfg(16, 64, 128, warps=3), "warps"),
    (Cfg(16, 64, 128, warps=2), "warps=2 must be 4 or 8"),
    (Cfg(16, 64, 128, warps=8), "cfg.bn=64 must be 64, 128 or 256 and >= 16 \\* warps"),
    (Cfg(16, 512, 128), "cfg.bn=512"),
    (Cfg(16, 64, 512), "cfg.bk=512"),
    (Cfg(1, 8, 128, warps=32), "warps"),
    (Cfg(16, 64, 128, stages=0), "stages"),
])
def test_config_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        check_fp4_decode_cfg(cfg)


def test_config_accepts_the_documented_range():
    for cfg in FMA_CFGS + MMA_CFGS + [Cfg(1, 1, 64), Cfg(1, 512, 4096, split_k=64, warps=16), Cfg(16, 64, 128),
                                      Cfg(16, 256, 256, split_k=64, warps=8, stages=1)]:
        check_fp4_decode_cfg(cfg)
    with pytest.raises(ValueError, match="Cfg"):
        check_fp4_decode_cfg((16, 64, 128))
