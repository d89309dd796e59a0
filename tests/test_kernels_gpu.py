"""GPU kernels of `quarl.kernels` against the float64 reference `dequant(Q(x)) @ dequant(W)^T`.

Tolerances (relative Frobenius error vs the float64 reference computed from the same quantized codes):
  5e-3 for kernels whose operands are exact (codes and scales are reproduced bit for bit and multiplied with
  fp32 accumulation; what remains is the final rounding to bf16, ~2^-9 per element, and fp32 summation);
  1.5e-2 for the dequantize-then-cuBLAS path (the weight itself is rounded to bf16 once).
Activation quantization must match `quarl.formats.quantize(x, fmt, "activation")` exactly.
The tuning-table checks at the end run on any machine.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from quarl.formats import quantize
from quarl.kernels import plan_for, quantized_matmul, try_quantized_matmul
from quarl.kernels.tuning import (FP4_DECODE_FMA_MAX_M, FP4_DECODE_MAX_M, M_BUCKETS, MIN_SPEEDUP, TABLE_FAMILIES,
                                  W8A16_PLANS, Cfg, Plan, TuningTables, check_fp4_decode_cfg, choose_plan,
                                  current_tables, write_tuning_file)

EXACT_TOL = 5e-3
DEQ_TOL = 1.5e-2
gpu = pytest.mark.gpu


def _poison_allocator(nbytes: int) -> None:
    """Fill freed allocator memory with NaN so that an output element the kernel never writes shows up."""
    t = torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")
    del t


def _reference(x: torch.Tensor, qw, weight_only: bool, bias=None) -> torch.Tensor:
    xr = x.double() if weight_only else quantize(x, qw.fmt, "activation").dequantize(torch.float64)
    ref = xr @ qw.dequantize(torch.float64).T
    return ref if bias is None else ref + bias.double()


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "kernel output has NaN/Inf (unwritten or overflowed elements)"
    return float((y.double() - ref).norm() / ref.norm())


def _inputs(m, n, k, dtype=torch.bfloat16, bias=False):
    w = torch.randn(n, k, device="cuda") * 0.05
    x = (torch.randn(m, k, device="cuda") * 2).to(dtype)
    b = (torch.randn(n, device="cuda") * 0.1).to(dtype) if bias else None
    return w, x, b


# Shapes with M = 1, M not a multiple of any tile, N not a multiple of the tile, K not a multiple of the block.
SHAPES = [(1, 256, 512), (7, 300, 1000), (33, 96, 272), (130, 512, 768), (67, 160, 200)]


@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("cfg", [Cfg(16, 64, 256, stages=4), Cfg(16, 32, 64, split_k=3), Cfg(64, 64, 128),
                                 Cfg(128, 128, 64, warps=8)])
def test_fp4_gemm_matches_reference(fmt, cfg):
    from quarl.kernels.dispatch import run_plan

    for m, n, k in SHAPES:
        w, x, b = _inputs(m, n, k, bias=(m % 2 == 1))
        qw = quantize(w, fmt)
        _poison_allocator(m * n * 4 * 4)
        y = run_plan(Plan("fp4", cfg), x, qw, b)
        assert y.shape == (m, n) and y.dtype == x.dtype
        err = _rel_err(y, _reference(x, qw, True, b))
        assert err < EXACT_TOL, f"{fmt} {cfg} M={m} N={n} K={k}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_dequant_then_matmul(fmt):
    from quarl.kernels.dequant import dequantize_fp4_weight
    from quarl.kernels.dispatch import run_plan

    for m, n, k in SHAPES:
        w, x, b = _inputs(m, n, k, bias=True)
        qw = quantize(w, fmt)
        dense = dequantize_fp4_weight(qw, torch.float32)  # fp32: must be exact
        assert torch.equal(dense, qw.dequantize(torch.float32)), f"{fmt} dequant differs at N={n} K={k}"
        err = _rel_err(run_plan(Plan("deq_mm"), x, qw, b), _reference(x, qw, True, b))
        assert err < DEQ_TOL, f"{fmt} deq_mm M={m} N={n} K={k}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-tensor", "fp8-block"])
def test_8bit_weight_dequant_is_the_reference_bit_for_bit(fmt):
    """`kernels.try_dequantize` of an 8-bit weight (the unified backward's Q(W)): the reference's values exactly."""
    from quarl.kernels import try_dequantize

    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    for n, k in [(576, 1536), (1536, 576), (200, 300), (129, 257), (4096, 4096)]:
        qw = quantize(torch.randn(n, k, device="cuda") * torch.exp(torch.randn(n, 1, device="cuda")), fmt)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = try_dequantize(qw, dtype)
            assert got is not None and torch.equal(got, qw.dequantize(dtype)), f"{fmt} N={n} K={k} {dtype}"


def _divide_by_row_scales(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`quant_utils.div_by_scale` row by row: v float32 [R, C], s float32 [R] -> v / s [R, C]."""
    import triton
    import triton.language as tl

    from quarl.kernels.quant_utils import div_by_scale

    @triton.jit
    def kernel(v_ptr, s_ptr, o_ptr, C, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < C
        x = tl.load(v_ptr + row * C + offs, mask=ok)
        tl.store(o_ptr + row * C + offs, div_by_scale(x, tl.load(s_ptr + row)), mask=ok)

    out = torch.empty_like(v)
    kernel[(v.shape[0],)](v, s, out, v.shape[1], BLOCK=triton.next_power_of_2(v.shape[1]))
    return out


@gpu
def test_division_by_a_shared_scale_is_correctly_rounded():
    """`div_by_scale` (one reciprocal per scale, a Markstein correction per value) must equal the IEEE division
    bit for bit for every quotient of at least 2^-24 (and zeros, infs, NaNs), and within a few ulps below that:
    over random significands and exponents, scales whose significand is all ones or that are powers of two,
    scales below 2^-60 (the rescaled path, subnormals included), quotients from underflow up to 2^20, signed
    zeros, inf and NaN values, and inf / NaN scales."""
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,))))
    rows, cols = 4096, 1024
    s = ((1.0 + torch.rand(rows, device="cuda", generator=gen))
         * torch.exp2(torch.randint(-149, 100, (rows,), device="cuda", generator=gen).float())).float()
    powers = torch.exp2(torch.arange(-60, 4, device="cuda").float())
    s[:64] = powers
    s[64:128] = torch.nextafter(powers, torch.zeros_like(powers))  # significand all ones
    s[128:192] = torch.exp2(torch.arange(-149, -85, device="cuda").float()) * 1.75
    # values 2^-180 .. 2^20 times their row's scale: the quantizers' quotients are at most 448 (never near
    # float32's overflow), and everything below a code's resolution
    mant = 1.0 + torch.rand(rows, cols, device="cuda", generator=gen)
    expo = torch.randint(-180, 20, (rows, cols), device="cuda", generator=gen).float()
    sign = torch.where(torch.rand(rows, cols, device="cuda", generator=gen) < 0.5, -1.0, 1.0)
    v = sign * mant * torch.exp2(expo) * s[:, None]
    s[192], s[193] = float("inf"), float("nan")
    v[:, :8] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-45, -3e-39, 448.0, -1.0], device="cuda")
    got, want = _divide_by_row_scales(v, s), v / s[:, None]
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    tiny = (want.abs() < 2.0**-24) & (want != 0)
    assert bool(((got[tiny] - want[tiny]).abs() <= want[tiny].abs() * 2.0**-21 + 2.0**-147).all())
    same |= tiny
    bad = ~same
    assert bool(same.all()), (f"{int(bad.sum())} quotients differ, e.g. v={v[bad][:4].tolist()} "
                              f"s={s[:, None].expand_as(v)[bad][:4].tolist()} got={got[bad][:4].tolist()} "
                              f"want={want[bad][:4].tolist()}")


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "fp8-tensor"])
def test_activation_quantization_is_exact(fmt):
    from quarl.kernels.act_quant import quantize_activation

    # one pass (K <= 4096); a few long rows, each block's program walking the whole row for the amax (3 x 18944);
    # one program per row walking it twice, unrolled (64 x 18944) or counted (40000: over 8 blocks, also at 5
    # rows); 1x128 groups / a given scale: rows split over programs (M < 1024) or walked by one program each (1100)
    for m, k in [(1, 512), (5, 1000), (64, 200), (300, 3584), (3, 18944), (64, 18944), (5, 40000), (1100, 3584),
                 (1100, 5000)]:
        x = (torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 10).to(torch.bfloat16)
        x[0, : k // 2] = 0  # a zero 1x128 group / half row
        if m > 1:
            x[1] = 0  # an all-zero row: scale 1
        ref = quantize(x, fmt, "activation")
        for warps in (None, 2):  # default; 2: the training linear's launch (`training_gemm._quantize_rows`)
            codes, scales = quantize_activation(x, fmt, ref.data.shape[-1], num_warps=warps)
            assert codes.dtype == ref.data.dtype and codes.shape == ref.data.shape
            assert torch.equal(scales.reshape(ref.scale.shape), ref.scale), f"{fmt} scales differ (M={m} K={k})"
            assert torch.equal(codes.view(torch.uint8), ref.data.view(torch.uint8)), \
                f"{fmt} codes differ (M={m} K={k}, {warps} warps)"


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "fp8-tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fake_quantize_activation_is_exact(fmt, dtype):
    """The one-pass W8A8 activation rounding equals the reference quantize -> dequantize bit for bit."""
    from quarl.formats.registry import fake_quantize_unchecked
    from quarl.kernels import fake_quantize_activation

    for shape in [(1, 512), (5, 1000), (64, 200), (2, 150, 3584), (3, 18944), (1100, 5000)]:
        x = (torch.randn(*shape, device="cuda") * torch.rand(*shape[:-1], 1, device="cuda") * 10).to(dtype)
        x.view(-1, shape[-1])[0, : shape[-1] // 2] = 0  # a zero 1x128 group / half row
        ref = fake_quantize_unchecked(x, fmt, "activation")
        y = fake_quantize_activation(x, fmt)
        assert y.shape == x.shape and y.dtype == dtype
        assert torch.equal(y, ref), f"{fmt} {dtype} {shape}: max diff {(y.double() - ref.double()).abs().max():.3g}"
        assert not torch.equal(y, x), "the rounding must change some values (else this test cannot fail)"


@gpu
@pytest.mark.fp8
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "fp8-tensor"])
def test_fp8_rounding_kernels_keep_nan_visible(fmt):
    """A NaN activation must not come out finite (a clamp without NaN propagation would make it -448)."""
    from quarl.kernels import fake_quantize_activation, fake_quantize_columns, try_quantize_fp8_block_weight

    x = torch.randn(4, 300, device="cuda", dtype=torch.bfloat16)
    x[1, 7] = float("nan")
    assert torch.isnan(fake_quantize_activation(x, fmt)[1, 7])
    if fmt == "fp8-block":
        assert torch.isnan(fake_quantize_columns(x)[1, 7])
        assert torch.isnan(try_quantize_fp8_block_weight(x).dequantize()[1, 7])


@gpu
@pytest.mark.fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_block_weight_quantization_is_exact(dtype):
    """One-pass 128x128 tile quantization of W and of W^T (read from W) equals the reference bit for bit."""
    from quarl.kernels import try_quantize_fp8_block_weight

    for n, k in [(130, 200), (384, 512), (96, 3584), (4608, 300)]:
        w = (torch.randn(n, k, device="cuda") * torch.rand(n, 1, device="cuda") * 3).to(dtype)
        w[:128, :128] = 0  # an all-zero tile: scale 1
        for transpose in (False, True):
            ref = quantize((w.t() if transpose else w).contiguous(), "fp8-block", "weight")
            q = try_quantize_fp8_block_weight(w, transpose)
            assert q.shape == ref.shape and q.data.shape == ref.data.shape, (n, k, transpose)
            assert torch.equal(q.scale, ref.scale), f"scales differ N={n} K={k} transpose={transpose}"
            assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), \
                f"codes differ N={n} K={k} transpose={transpose}"


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_column_group_rounding_is_exact(dtype):
    """FP8-block rounding of x^T returned untransposed equals the reference on the transposed copy."""
    from quarl.formats.registry import fake_quantize_unchecked
    from quarl.kernels import fake_quantize_columns

    for m, n in [(1, 64), (130, 70), (4096, 384), (300, 3584)]:
        x = (torch.randn(m, n, device="cuda") * torch.rand(1, n, device="cuda") * 5).to(dtype)
        ref = fake_quantize_unchecked(x.t().contiguous(), "fp8-block", "activation").t()
        y = fake_quantize_columns(x)
        assert y.shape == x.shape and y.dtype == dtype
        assert torch.equal(y, ref), f"M={m} N={n}: max diff {(y.double() - ref.double()).abs().max():.3g}"


W8_CASES = [
    ("raw", Cfg(16, 64, 256, stages=4)),
    ("raw", Cfg(64, 64, 128)),
    ("fused", Cfg(16, 64, 256, stages=4)),
    ("fused", Cfg(16, 32, 128, split_k=2)),
    ("fused", Cfg(64, 64, 128, native=True)),
    ("prequant", Cfg(64, 128, 128, native=True, stages=4)),
    ("prequant", Cfg(128, 128, 128, warps=8, native=True)),
    ("prequant", Cfg(16, 64, 128)),
    ("prequant", Cfg(16, 128, 128, split_k=3, native=True, swap_ab=True, stages=4)),
    ("fused", Cfg(64, 64, 256, native=True, swap_ab=True)),
    ("raw", Cfg(16, 64, 128, swap_ab=True)),
    ("prequant", Cfg(128, 128, 128, warps=8, stages=4, native=True, tma=True)),
    ("prequant", Cfg(64, 64, 128, group_m=2, native=True, tma=True)),
]


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "fp8-tensor"])
@pytest.mark.parametrize("x_mode,cfg", W8_CASES)
def test_w8a8_gemm_matches_reference(fmt, x_mode, cfg):
    from quarl.kernels.dispatch import run_plan

    if fmt == "fp8-tensor" and x_mode == "fused":
        pytest.skip("a per-tensor activation scale needs the whole tensor first: always prequant")
    if fmt == "fp8-block" and cfg.tma:
        pytest.skip("the TMA kernel takes rowwise / per-tensor scales (fp8-block scales every 128-deep step)")
    if fmt == "fp8-block" and cfg.bk != 128:
        cfg = replace(cfg, bk=128)
    weight_only = x_mode == "raw"
    for m, n, k in SHAPES:
        w, x, b = _inputs(m, n, k, bias=(m % 2 == 1))
        qw = quantize(w, fmt)
        _poison_allocator(m * n * 4 * 4)
        y = run_plan(Plan("w8a8", cfg, x_mode), x, qw, b)
        assert y.shape == (m, n) and y.dtype == x.dtype
        err = _rel_err(y, _reference(x, qw, weight_only, b))
        assert err < EXACT_TOL, f"{fmt} {x_mode} {cfg} M={m} N={n} K={k}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-tensor"])
def test_tma_decode_w8a8_matches_reference(monkeypatch, fmt):
    """The transposed TMA decode kernel (swap_ab + tma, all rows in one tile of bm): M = 1 .. bm, N not a multiple
    of bn, K not a multiple of bk, split-K 1 / 3, with and without bias, also on handed-over codes; and it is the
    kernel that ran (a launch counter), except for K = 200, whose 200-byte rows TMA cannot address."""
    from quarl.kernels import w8a8_gemm
    from quarl.kernels.dispatch import codes_matmul, run_plan

    launches = []
    real = w8a8_gemm._w8a8_tma_swap
    monkeypatch.setattr(w8a8_gemm, "_w8a8_tma_swap", lambda *a: launches.append(1) or real(*a))
    for m, n, k, cfg in [(1, 300, 1008, Cfg(16, 64, 128, split_k=3, stages=4, native=True, swap_ab=True, tma=True)),
                         (16, 4608, 3584, Cfg(16, 64, 128, stages=4, native=True, swap_ab=True, tma=True)),
                         (7, 200, 2064, Cfg(16, 128, 256, split_k=2, native=True, swap_ab=True, tma=True)),
                         (64, 520, 1024, Cfg(64, 64, 256, split_k=2, stages=4, native=True, swap_ab=True,
                                             tma=True)),
                         (33, 96, 200, Cfg(64, 64, 128, split_k=2, native=True, swap_ab=True, tma=True))]:
        w, x, b = _inputs(m, n, k, bias=(m % 2 == 1))
        qw = quantize(w, fmt)
        before = len(launches)
        plan = Plan("w8a8", cfg, "prequant")
        y = run_plan(plan, x, qw, b)
        assert (len(launches) > before) == (k % 16 == 0), (m, n, k)
        err = _rel_err(y, _reference(x, qw, False, b))
        assert y.shape == (m, n) and err < EXACT_TOL, f"{fmt} {cfg} M={m} N={n} K={k}: rel err {err:.2e}"
        if fmt != "fp8-tensor":
            qx = quantize(x, fmt, "activation")
            assert torch.equal(codes_matmul(plan, qx.data, qx.scale, qw, b, x.dtype), y)


@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int8", "fp8", "fp8-block", "fp8-tensor"])
@pytest.mark.parametrize("x_mode", ["raw", "fused", "prequant"])
def test_gemv_matches_reference(fmt, x_mode):
    """The GEMV kernels, every M they take (fp4: 1-4, 8-bit: 1), N and K not multiples of the tile."""
    from quarl.kernels.dispatch import run_plan

    if fmt in ("nvfp4", "mxfp4") and x_mode != "raw":
        pytest.skip("fp4 formats are weight-only")
    if fmt == "fp8-tensor" and x_mode == "fused":
        pytest.skip("a per-tensor activation scale needs the whole tensor first: always prequant")
    for m, n, k, bn, bk in [(1, 300, 1000, 16, 256), (2, 256, 512, 32, 256), (3, 130, 384, 8, 512),
                            (4, 64, 200, 16, 128)]:
        bias = m % 2 == 1
        if fmt not in ("nvfp4", "mxfp4"):
            m = 1  # the 8-bit GEMV takes one row (with and without a bias)
        w, x, b = _inputs(m, n, k, bias=bias)
        qw = quantize(w, fmt)
        y = run_plan(Plan("gemv", Cfg(1, bn, bk, warps=4, stages=3), x_mode), x, qw, b)
        assert y.shape == (m, n) and y.dtype == x.dtype
        err = _rel_err(y, _reference(x, qw, x_mode == "raw", b))
        assert err < EXACT_TOL, f"{fmt} gemv {x_mode} M={m} N={n} K={k}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp8-tensor", "fp8-block"])
def test_scaled_mm_path(fmt):
    from quarl.kernels.act_quant import quantize_activation
    from quarl.kernels.dispatch import run_plan, scaled_mm_codes

    shapes = [(1, 256, 512), (70, 320, 1024), (257, 512, 768)]
    if fmt == "fp8-block":  # whole 128-row weight tiles; an explicit plan pads M and Kp/128 (to a multiple of 4)
        shapes = [(64, 256, 512), (70, 384, 1000), (257, 512, 1024), (1, 128, 2000), (33, 256, 768),
                  (40, 128, 700), (1024, 256, 8960)]
        qw = quantize(torch.randn(256, 768, device="cuda"), fmt)
        codes, sx = quantize_activation(torch.randn(64, 768, device="cuda", dtype=torch.bfloat16), fmt, 768,
                                        scales_column_major=True)
        with pytest.raises(ValueError, match="multiple of 4"):  # unpadded Kp/128 = 6: refused, not run
            scaled_mm_codes(codes, sx, qw, None, torch.bfloat16)
        assert plan_for(fmt, False, 4096, 256, 768).kind != "scaled_mm"  # padding copies W: dispatch avoids it
    for m, n, k in shapes:
        w, x, b = _inputs(m, n, k, bias=True)
        qw = quantize(w, fmt)
        err = _rel_err(run_plan(Plan("scaled_mm"), x, qw, b), _reference(x, qw, False, b))
        assert err < EXACT_TOL, f"{fmt} scaled_mm M={m}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-tensor", "fp8-block", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dispatch_matches_reference(fmt, dtype):
    """The public entry point on the tuned plans, every M bucket, with and without bias."""
    n, k = 512, 1000
    for weight_only in (True, False):
        for m in (1, 16, 50, 200, 1100):
            w, x, b = _inputs(m, n, k, dtype=dtype, bias=(m % 2 == 0))
            qw = quantize(w, fmt)
            y = try_quantized_matmul(x, qw, weight_only, b)
            plan = plan_for(fmt, weight_only, m, n, k)
            if fmt in ("nvfp4", "mxfp4") and not weight_only:
                assert y is None, "there is no W4A4 kernel: must fall back"
                continue
            if fmt == "mxfp4" and dtype == torch.float16:
                assert y is None
                continue
            assert (y is None) == (plan.kind == "bf16"), f"{fmt} M={m}: result does not follow the plan {plan}"
            if y is None:
                continue
            assert y.dtype == dtype and y.shape == (m, n)
            tol = DEQ_TOL if plan.kind == "deq_mm" else EXACT_TOL
            err = _rel_err(y, _reference(x, qw, weight_only, b))
            assert err < tol, f"{fmt} weight_only={weight_only} M={m} {dtype} {plan}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "nvfp4"])
def test_quantized_matmul_always_runs_a_kernel(fmt):
    """quantized_matmul ignores the bf16 policy: a result (matching the reference) on shapes bf16 wins."""
    weight_only = fmt == "nvfp4"
    for m in (1, 16, 300):
        w, x, b = _inputs(m, 512, 1024, bias=True)
        qw = quantize(w, fmt)
        y = quantized_matmul(x, qw, weight_only, b)
        assert y is not None
        plan = plan_for(fmt, weight_only, m, 512, 1024, prefer_kernel=True)
        tol = DEQ_TOL if plan.kind == "deq_mm" else EXACT_TOL
        assert _rel_err(y, _reference(x, qw, weight_only, b)) < tol


# SmolLM2-135M's linears (q/o, k/v, gate/up, down: hidden 576 is not a multiple of 128 and K = 576 has 4.5
# fp8-block groups) and Qwen2.5-0.5B's (hidden 896).
SMALL_MODEL_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (896, 896), (128, 896), (4864, 896),
                      (896, 4864)]


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-tensor", "fp8-block"])
def test_quantized_matmul_on_small_model_shapes_at_every_batch_size(fmt):
    """The unified flow's kernel forward (`precision.kernel_forward`) runs `quantized_matmul` on every linear of
    small models at every M, decode steps to training batches, also where bf16 is faster: each plan must run and
    match the reference, with and without a bias."""
    for n, k in SMALL_MODEL_SHAPES:
        for m in (1, 7, 16, 64, 128, 300, 640, 1024, 4096, 5000):
            w, x, b = _inputs(m, n, k, bias=m % 2 == 0)
            qw = quantize(w, fmt)
            y = quantized_matmul(x, qw, False, b)
            plan = plan_for(fmt, False, m, n, k, prefer_kernel=True)
            assert y is not None and y.shape == (m, n) and y.dtype == torch.bfloat16, (fmt, n, k, m, plan)
            err = _rel_err(y, _reference(x, qw, False, b))
            assert err < EXACT_TOL, f"{fmt} [{m}, {k}] x [{n}, {k}] {plan}: rel err {err:.2e}"


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8-block", "nvfp4"])
def test_in_place_requantize_is_seen(fmt):
    """quantize(..., out=qt) (the per-step sync) changes the next product: no stale kernel-side cache."""
    n, k = 256, 512
    w1, x, _ = _inputs(4, n, k)
    qw = quantize(w1, fmt)
    weight_only = fmt == "nvfp4"
    y1 = quantized_matmul(x, qw, weight_only)
    quantize(torch.randn(n, k, device="cuda") * 0.05, fmt, out=qw)
    y2 = quantized_matmul(x, qw, weight_only)
    assert y1 is not None and y2 is not None
    assert _rel_err(y2, _reference(x, qw, weight_only)) < EXACT_TOL
    assert (y1 - y2).abs().max() > 0


@gpu
def test_bad_inputs_raise_clear_errors():
    qw = quantize(torch.randn(64, 256, device="cuda"), "int8")
    with pytest.raises(ValueError, match="input features"):
        try_quantized_matmul(torch.randn(3, 128, device="cuda", dtype=torch.bfloat16), qw, False)
    with pytest.raises(ValueError, match="bias"):
        try_quantized_matmul(torch.randn(3, 256, device="cuda", dtype=torch.bfloat16), qw, False,
                             torch.zeros(63, device="cuda"))
    act = quantize(torch.randn(3, 256, device="cuda"), "int8", "activation")
    with pytest.raises(ValueError, match="weight"):
        try_quantized_matmul(torch.randn(3, 256, device="cuda", dtype=torch.bfloat16), act, False)


# ---------------------------------------------------------------- any machine


def test_cpu_tensors_get_no_kernel():
    qw = quantize(torch.randn(32, 64), "int8")
    assert try_quantized_matmul(torch.randn(2, 64), qw, False) is None


@pytest.mark.parametrize("family", sorted(TABLE_FAMILIES) + ["w8a16"])
def test_tuning_tables_are_consistent(family, monkeypatch):
    """In the shipped tables every shape has every bucket; tile shapes respect the kernels' constraints; the policy
    follows the tabled speed-ups."""
    monkeypatch.delenv("QUARL_TUNING_FILE", raising=False)
    measured, fallback = current_tables().measured, current_tables().fallback_cost
    if family == "w8a16":
        plans = [(W8A16_PLANS[b], None) for b in M_BUCKETS]
    else:
        assert len(measured[family]) >= 4
        for shape, table in measured[family].items():
            assert sorted(table) == sorted(M_BUCKETS), f"{family} {shape}: buckets {sorted(table)}"
        plans = [e for table in measured[family].values() for e in table.values()]
        for table in measured[family].values():
            for bucket, (p, _) in table.items():
                if p.kind == "fp4_decode":  # the bucket's largest M must fit the kernel path the plan selects
                    assert bucket <= (FP4_DECODE_FMA_MAX_M if p.cfg.bm == 1 else FP4_DECODE_MAX_M), (bucket, p)
                if p.cfg is not None and p.cfg.tma and p.cfg.swap_ab:  # the TMA decode tile holds all M rows
                    assert bucket <= p.cfg.bm <= 64 and p.cfg.bn >= 64, (family, bucket, p)
    for p, speedup in plans:
        assert p.kind in ("fp4", "deq_mm", "w8a8", "scaled_mm", "gemv", "fp4_decode", "bf16")
        if speedup is not None:
            assert p.kind != "bf16" and speedup > 0
        if p.cfg is None:
            assert p.kind in ("deq_mm", "scaled_mm", "bf16")
            continue
        c = p.cfg
        if p.kind == "fp4_decode":
            assert family == "w4a16"
            check_fp4_decode_cfg(c)  # raises on a tile the kernel cannot run
            continue
        if p.kind == "gemv":
            assert c.bn <= 128 and 128 % c.bn == 0 and c.bk >= 128, f"{family}: GEMV tile {c}"
            assert family != "fp8-block" or c.bk % 128 == 0, f"fp8-block GEMV steps whole 128-groups: {c}"
            continue
        for v in (c.bm, c.bn, c.bk):
            assert v >= 16 and v & (v - 1) == 0, f"{family}: tile sizes must be powers of two >= 16: {c}"
        if family == "fp8-block":
            assert c.bk == 128, "fp8-block tiles are one 128-deep scale group"
        if family == "w4a16":
            assert p.kind == "fp4" and c.bk % 32 == 0
        if c.tma:
            assert p.kind == "w8a8" and p.x_mode == "prequant" and c.native and (c.split_k == 1 or c.swap_ab), p
            assert family in ("int8", "fp8"), f"{family}: the TMA kernel takes rowwise / per-tensor scales"
        if c.native:
            # the tile side the codes' MMA puts on its 64-row side: bn when transposed (swap_ab), else bm
            assert p.kind == "w8a8" and p.x_mode != "raw" and (c.bn if c.swap_ab else c.bm) >= 64
        if c.swap_ab:
            assert p.kind == "w8a8"
    assert choose_plan("nvfp4", False, 1, 64, 64).kind == "bf16"  # no W4A4
    if family in fallback:  # the W8A8 families: the fallback's cost at every measured shape and bucket
        assert sorted(fallback[family]) == sorted(measured[family]), family
        for shape, costs in fallback[family].items():
            assert sorted(costs) == sorted(M_BUCKETS) and all(1.0 <= c < 3.0 for c in costs.values()), (shape, costs)
    if family in measured:
        for (n, k), table in measured[family].items():
            for b, (plan, speedup) in table.items():
                cost = fallback.get(family, {}).get((n, k), {}).get(b, 1.0)
                expected = plan if speedup * cost >= MIN_SPEEDUP else Plan("bf16")
                assert choose_plan(family if family != "w4a16" else "nvfp4", family == "w4a16", b, n, k) == expected
                assert choose_plan(family if family != "w4a16" else "nvfp4", family == "w4a16", b, n, k,
                                   prefer_kernel=True) == plan


def test_dispatch_weighs_kernels_against_the_w8a8_fallback(monkeypatch, tmp_path):
    """A W8A8 kernel slower than bare bf16 is still chosen where it beats the path without a kernel (fake
    quantization + bf16 GEMM, the tables' `fallback_cost`) by MIN_SPEEDUP; the cost comes from the nearest tabled
    shape and the M bucket; weight-only formats have no such pass; fp8-tensor uses fp8's costs; prefer_kernel
    always gets the kernel. (The tables come from a QUARL_TUNING_FILE.)"""
    import random

    from quarl.kernels import tuning

    plan = Plan("w8a8", Cfg(64, 64, 128, native=True), "prequant")
    speedup = random.uniform(0.85, 0.99)
    need = tuning.MIN_SPEEDUP / speedup  # the fallback cost from which the kernel wins
    small, big = (1024, 1024), (16384, 16384)
    measured = {"fp8": {s: {b: (plan, speedup) for b in tuning.M_BUCKETS} for s in (small, big)},
                "w4a16": {small: {b: (Plan("fp4", Cfg(16, 64, 256)), speedup) for b in tuning.M_BUCKETS}}}
    costs_small = {b: need * 1.01 for b in tuning.M_BUCKETS}
    costs_small[16] = need * 0.99
    fallback = {"fp8": {small: costs_small, big: {b: need * 0.99 for b in tuning.M_BUCKETS}}}
    path = tmp_path / "tables.json"
    write_tuning_file(path, TuningTables(measured, fallback, {"device": "test", "capability": [9, 0], "torch": "-",
                                                              "triton": "-", "command": "-"}))
    monkeypatch.setenv("QUARL_TUNING_FILE", str(path))
    assert tuning.choose_plan("fp8", False, 1, *small) == plan
    assert tuning.choose_plan("fp8-tensor", False, 200, 1000, 1100) == plan  # nearest: small, bucket 256
    assert tuning.choose_plan("fp8", False, 200, 15000, 16000) == Plan("bf16")  # nearest: big, cheap fallback
    assert tuning.choose_plan("fp8", False, 16, *small) == Plan("bf16")  # the fallback is cheap enough here
    assert tuning.choose_plan("fp8", False, 16, *small, prefer_kernel=True) == plan
    assert tuning.choose_plan("nvfp4", True, 1, *small) == Plan("bf16")  # weight-only: bare bf16 is the path
    assert tuning.fallback_cost("w4a16", *small, 1) == 1.0


@gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-tensor", "fp8-block"])
def test_fake_quantize_weight_is_the_reference(fmt):
    """The unified forward's weight rounding (one-pass kernels where they apply) equals the reference exactly."""
    from quarl.formats.registry import fake_quantize_unchecked
    from quarl.kernels import fake_quantize_weight

    for n, k in [(130, 200), (384, 3584)]:
        w = (torch.randn(n, k, device="cuda") * torch.rand(n, 1, device="cuda")).to(torch.bfloat16)
        ref = fake_quantize_unchecked(w, fmt, "weight")
        got = fake_quantize_weight(w, fmt)
        assert got.dtype == w.dtype and torch.equal(got, ref), f"{fmt} N={n} K={k}"
