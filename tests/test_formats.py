"""Number formats vs float64 references of the BRIEF §3 formulas, hand-derived codes, bounds and bad input.

Reference strategy: scales are recomputed in float64 from the formula and must match ours to float32 rounding
(rtol 2**-22). Codes are then recomputed in float64 from x / (our scale); because our quotient is a float32
division, an element whose exact quotient lies within 2**-21 (relative) of a rounding boundary may round either
way, so our code must equal the float64 code of quotient*(1-2**-21) or of quotient*(1+2**-21) (and such
ambiguous elements must be rare). Everything else must be exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from quarl.formats import FORMATS, QuantizedTensor, fake_quantize, quantize
from quarl.formats import e2m1
from quarl.formats.fp8 import to_e4m3

EPS = 2.0**-21  # quotient perturbation covering float32 rounding of scale products and divisions
RTOL32 = 2.0**-22  # one or two float32 roundings
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ----------------------------------------------------------------------------------------------------------
# float64 references, written independently of the implementation
# ----------------------------------------------------------------------------------------------------------
def round_int8_ref(v: torch.Tensor) -> torch.Tensor:
    return torch.round(v).clamp(-127, 127)  # torch.round is half-to-even


def round_e4m3_ref(v: torch.Tensor) -> torch.Tensor:
    """float64 -> nearest E4M3 value (3 mantissa bits, min normal 2^-6, subnormal step 2^-9), ties to even,
    saturating at 448."""
    a = v.abs()
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))).clamp(min=-6)
    step = torch.pow(2.0, e - 3)
    r = (torch.round(a / step) * step).clamp(max=448.0)
    return torch.where(a > 0, r, torch.zeros_like(r)) * torch.sign(v)


def round_e2m1_ref(v: torch.Tensor) -> torch.Tensor:
    """float64 -> nearest of +-{0, .5, 1, 1.5, 2, 3, 4, 6}; on a tie the even code index wins; saturating."""
    a = v.abs().clamp(max=6.0).unsqueeze(-1)
    dist = (a - E2M1_GRID).abs()
    best = dist.min(dim=-1, keepdim=True).values
    cand = dist == best
    idx = torch.arange(8)
    # among the (one or two) nearest, prefer the even index
    score = cand.to(torch.int64) * 2 + ((idx % 2) == 0).to(torch.int64)
    pick = torch.where(cand, score, torch.full_like(score, -1)).argmax(dim=-1)
    return E2M1_GRID[pick] * torch.sign(v)


def assert_codes(ours: torch.Tensor, quotient: torch.Tensor, round_fn, max_ambiguous: float = 1e-3) -> None:
    """ours (float64 code values) must be round_fn(quotient) up to float32 ambiguity at rounding boundaries.

    max_ambiguous: the largest fraction of elements allowed to sit on a boundary (keeps the check meaningful).
    bf16/fp16 inputs have short mantissas, so exact ties of x/s are common there.
    """
    lo = round_fn(quotient * (1 - EPS))
    hi = round_fn(quotient * (1 + EPS))
    ok = (ours == lo) | (ours == hi)
    assert bool(ok.all()), f"{int((~ok).sum())} codes differ from the reference, e.g. quotient " \
        f"{quotient[~ok][:4].tolist()} ours {ours[~ok][:4].tolist()} ref {lo[~ok][:4].tolist()}"
    assert float((lo != hi).double().mean()) <= max_ambiguous


def assert_scale(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours.double(), ref, rtol=RTOL32, atol=0)


def padded(x64: torch.Tensor, mult: int) -> torch.Tensor:
    k = x64.shape[-1]
    kp = -(-k // mult) * mult
    return torch.nn.functional.pad(x64, (0, kp - k))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (compares fp8/float/uint8 tensors bit for bit, incl. 0-dim)."""
    return t.reshape(-1).view(torch.uint8)


def codes64(qt: QuantizedTensor) -> torch.Tensor:
    return qt.codes().double()


def reference_check(x: torch.Tensor, fmt: str, role: str) -> QuantizedTensor:
    """Quantize x and check scales, codes and dequantized values against the float64 formula."""
    qt = quantize(x, fmt, role)
    amb = 1e-3 if x.dtype in (torch.float32, torch.float64) else 0.2
    x64 = x.float().double()  # scales are computed from the input cast to float32
    spec = FORMATS[fmt]
    xp = padded(x64, spec.pad_multiple)
    q = codes64(qt)
    assert qt.data.shape[-1] * (2 if spec.packed else 1) == xp.shape[-1]
    if fmt in ("int8", "fp8", "fp8-tensor"):
        qmax = 127.0 if fmt == "int8" else 448.0
        amax = xp.abs().amax(dim=-1, keepdim=True) if fmt != "fp8-tensor" else xp.abs().amax()
        s_ref = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        assert_scale(qt.scale, s_ref)
        rnd = round_int8_ref if fmt == "int8" else round_e4m3_ref
        assert_codes(q, xp / qt.scale.double(), rnd, amb)
        deq_ref = q * qt.scale.double()
    elif fmt == "fp8-block":
        kt = xp.shape[-1] // 128
        if role == "weight":
            n = xp.shape[0]
            nt = math.ceil(n / 128)
            s_ref = torch.empty(nt, kt, dtype=torch.float64)
            full = torch.empty_like(xp)
            for i in range(nt):  # explicit loops: independent of the reshape-based implementation
                for j in range(kt):
                    tile = xp[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                    a = tile.abs().max()
                    s_ref[i, j] = a / 448 if a > 0 else 1.0
                    full[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = float(qt.scale[i, j])
        else:
            a = xp.abs().reshape(*xp.shape[:-1], kt, 128).amax(-1)
            s_ref = torch.where(a > 0, a / 448, torch.ones_like(a))
            full = qt.scale.double().repeat_interleave(128, dim=-1)
        assert_scale(qt.scale, s_ref)
        assert_codes(q, xp / full, round_e4m3_ref, amb)
        deq_ref = q * full
    elif fmt == "nvfp4":
        amax = x64.abs().max()
        sg_ref = amax / 2688 if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
        assert_scale(qt.global_scale, sg_ref)
        sg = qt.global_scale.double()
        blocks = xp.reshape(*xp.shape[:-1], -1, 16)
        ratio = blocks.abs().amax(-1) / 6 / sg
        sb = qt.scale.double()
        assert_codes(sb, ratio, round_e4m3_ref, amb)  # the block scale is the E4M3-rounded formula value
        step = (sb * sg).unsqueeze(-1)
        quot = torch.where(step > 0, blocks / torch.where(step > 0, step, 1.0), 0.0)
        qb = q.reshape(blocks.shape)
        assert_codes(qb, quot, round_e2m1_ref, amb)
        deq_ref = (qb * step).reshape(xp.shape)
    elif fmt == "mxfp4":
        blocks = xp.reshape(*xp.shape[:-1], -1, 32)
        a = blocks.abs().amax(-1)
        e_ref = torch.where(a > 0, (torch.floor(torch.log2(torch.where(a > 0, a, 1.0))) + 125).clamp(0, 254), 127.0)
        assert torch.equal(qt.scale.double(), e_ref)
        X = torch.pow(2.0, e_ref - 127).unsqueeze(-1)
        qb = q.reshape(blocks.shape)
        assert_codes(qb, blocks / X, round_e2m1_ref, amb)
        deq_ref = (qb * X).reshape(xp.shape)
    else:  # pragma: no cover
        raise AssertionError(fmt)
    # padding holds code 0; dequantize trims it and equals code * scale
    assert bool((q[..., x.shape[-1]:] == 0).all())
    deq = qt.dequantize(torch.float64)
    assert deq.shape == x.shape
    torch.testing.assert_close(deq, deq_ref[..., : x.shape[-1]], rtol=RTOL32, atol=0)
    return qt


def random_input(shape, dtype=torch.float32, seed=None) -> torch.Tensor:
    """Gaussian values with per-row spread over ~4 decades, 1% outliers (x30..x300) and one all-zero row."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, (1,))))
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64))
    out = torch.rand(shape, generator=g) < 0.01
    x = torch.where(out, x * torch.empty(shape, dtype=torch.float64).uniform_(30, 300, generator=g), x)
    x = x * 10 ** (torch.rand((), generator=g).item() * 4 - 2)
    if len(shape) >= 2 and shape[0] > 1:
        x.reshape(-1, shape[-1])[1].zero_()
    if dtype == torch.float16:
        x = x / x.abs().max() * 1e4  # keep inside the float16 range
    return x.to(dtype)


ALL = list(FORMATS)


# ----------------------------------------------------------------------------------------------------------
# registry and contract
# ----------------------------------------------------------------------------------------------------------
def test_registry_contract():
    assert set(FORMATS) == {"int8", "fp8", "fp8-tensor", "fp8-block", "nvfp4", "mxfp4"}
    expect = {"int8": (1, False, 8), "fp8": (1, False, 8), "fp8-tensor": (0, False, 8),
              "fp8-block": (128, False, 8), "nvfp4": (16, True, 4), "mxfp4": (32, True, 4)}
    for name, (block, wo, bits) in expect.items():
        spec = FORMATS[name]
        assert (spec.name, spec.block_size, spec.weight_only_default, spec.bits) == (name, block, wo, bits)


@pytest.mark.parametrize("fmt", ALL)
def test_layout_dtypes_and_shapes(fmt):
    n, k = 200, 300
    w = quantize(torch.randn(n, k), fmt, "weight")
    a = quantize(torch.randn(2, 3, k), fmt, "activation")
    kp = FORMATS[fmt].padded_k(k)
    code_dtype = {"int8": torch.int8, "nvfp4": torch.uint8, "mxfp4": torch.uint8}.get(fmt, torch.float8_e4m3fn)
    packed = fmt in ("nvfp4", "mxfp4")
    assert w.data.dtype == a.data.dtype == code_dtype
    assert w.data.shape == (n, kp // 2 if packed else kp) and a.data.shape == (2, 3, kp // 2 if packed else kp)
    assert w.shape == (n, k) and a.shape == (2, 3, k)
    exp_w, exp_a = {
        "int8": ((n, 1), (2, 3, 1)), "fp8": ((n, 1), (2, 3, 1)), "fp8-tensor": ((), ()),
        "fp8-block": ((2, kp // 128), (2, 3, kp // 128)), "nvfp4": ((n, kp // 16), (2, 3, kp // 16)),
        "mxfp4": ((n, kp // 32), (2, 3, kp // 32)),
    }[fmt]
    assert tuple(w.scale.shape) == exp_w and tuple(a.scale.shape) == exp_a
    scale_dtype = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.uint8}.get(fmt, torch.float32)
    assert w.scale.dtype == scale_dtype
    if fmt == "nvfp4":
        assert w.global_scale.dtype == torch.float32 and w.global_scale.dim() == 0
    else:
        assert w.global_scale is None


# ----------------------------------------------------------------------------------------------------------
# float64 reference on fresh random inputs with outliers
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_weight_matches_float64_reference(fmt, dtype):
    reference_check(random_input((200, 300), dtype), fmt, "weight")


@pytest.mark.parametrize("fmt", ALL)
def test_activation_matches_float64_reference(fmt):
    reference_check(random_input((3, 7, 260)), fmt, "activation")
    reference_check(random_input((5, 256), torch.bfloat16), fmt, "activation")


@pytest.mark.parametrize("fmt", ALL)
def test_input_dtype_only_changes_values_through_the_float32_cast(fmt):
    x = random_input((64, 160), torch.float16).double()  # inside every dtype's range
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        a, b = quantize(xd, fmt), quantize(xd.float(), fmt)
        assert torch.equal(bits(a.data), bits(b.data))
        assert torch.equal(bits(a.scale), bits(b.scale))
    assert fake_quantize(x.bfloat16(), fmt).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------------
# error bounds that follow from each format
# ----------------------------------------------------------------------------------------------------------
def _e4m3_half_step(v: torch.Tensor) -> torch.Tensor:
    """Half the E4M3 spacing around |v| (v in code units)."""
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0**-30))).clamp(min=-6)
    return torch.pow(2.0, e - 3) / 2


def _e2m1_half_step(v: torch.Tensor) -> torch.Tensor:
    a = v.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0)).double()


@pytest.mark.parametrize("fmt", ALL)
def test_error_bound_per_element(fmt):
    # moderate dynamic range so no NVFP4 block scale is subnormal (there the bound is looser by design)
    x = (torch.randn(96, 320, dtype=torch.float64) * torch.exp(torch.randn(96, 1, dtype=torch.float64))).float()
    qt = quantize(x, fmt)
    x64 = x.double()
    err = (qt.dequantize(torch.float64) - x64).abs()
    # float32 arithmetic (the division by the scale, the product code*scale) adds up to ~2^-23 |x|
    slack = x64.abs() * 2.0**-21
    if fmt == "int8":
        bound = qt.scale.double() / 2
    elif fmt in ("fp8", "fp8-tensor"):
        s = qt.scale.double()
        bound = _e4m3_half_step(x64 / s) * s
    elif fmt == "fp8-block":
        s = qt.scale.double().repeat_interleave(128, 0)[:96].repeat_interleave(128, 1)[:, :320]
        bound = _e4m3_half_step(x64 / s) * s
    elif fmt == "nvfp4":
        step = (qt.scale.double() * qt.global_scale.double()).repeat_interleave(16, -1)[:, :320]
        assert bool((qt.scale.float() >= 2.0**-6).all()), "test data should give normal E4M3 block scales"
        # the rounded block scale may be up to 1/16 below the ideal: an element may sit at most 6*(1+1/15)
        # code units out, so the clamp error stays below the top half-step (1) and the grid bound holds
        bound = _e2m1_half_step(x64 / step) * step
    else:  # mxfp4: X = 2^(floor(log2 amax)-2) puts amax in [4X, 8X); values above 6X saturate
        X = torch.pow(2.0, qt.scale.double() - 127).repeat_interleave(32, -1)[:, :320]
        bound = torch.maximum(_e2m1_half_step(x64 / X) * X, x64.abs() - 6 * X)
    assert bool((err <= bound + slack).all()), float(((err - slack) / bound).max())


# ----------------------------------------------------------------------------------------------------------
# hand-derived codes and scales
# ----------------------------------------------------------------------------------------------------------
def test_e2m1_ties_to_even_and_saturation():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 0.26, 0.74, 4.9, 5.1, 6.0, 7.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -4.0, 0.5, 0.5, 4.0, 6.0, 6.0, 6.0])
    assert torch.equal(e2m1.decode(e2m1.encode(v)), want)
    # and end to end through MXFP4: a block with amax 6 has X = 2^(2-2) = 1, so codes are the values themselves
    block = torch.zeros(32)
    block[: len(v) - 1] = v[:-1]  # leave 7.0 out so amax = 6
    qt = quantize(block.reshape(1, 32), "mxfp4")
    assert int(qt.scale) == 127
    assert torch.equal(qt.codes()[0, : len(v) - 1], want[:-1])


def test_e2m1_sign_bit_and_no_negative_zero():
    codes = e2m1.encode(torch.tensor([-0.5, 0.5, -6.0, -0.1, -0.0]))
    assert codes.tolist() == [0b1001, 0b0001, 0b1111, 0, 0]


def test_pack_layout_and_round_trip():
    assert e2m1.pack(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    codes = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8)
    assert torch.equal(e2m1.unpack(e2m1.pack(codes)), codes)
    packed = torch.randint(0, 256, (7, 10), dtype=torch.uint8)
    assert torch.equal(e2m1.pack(e2m1.unpack(packed)), packed)
    with pytest.raises(ValueError, match="even"):
        e2m1.pack(torch.zeros(3, dtype=torch.uint8))


def test_e4m3_cast_rounds_to_even_and_saturates():
    v = torch.tensor([448.0, 449.0, 464.0, 480.0, 1e9, -1e9, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10, 17.0, 19.0])
    got = to_e4m3(v).float()
    want = torch.tensor([448.0, 448.0, 448.0, 448.0, 448.0, -448.0, 0.0, 2.0**-9, 2 * 2.0**-9, 16.0, 20.0])
    assert torch.equal(got, want)
    x = torch.randn(4000, dtype=torch.float64) * torch.exp(3 * torch.randn(4000, dtype=torch.float64))
    assert_codes(to_e4m3(x.float()).double(), x.float().double(), round_e4m3_ref)


def test_nvfp4_block_scales_saturate_at_448_and_go_subnormal():
    # amax = 2688 makes s_global = 1 exactly, so block scale = e4m3(amax_block / 6) can be read off by hand
    x = torch.zeros(1, 96)
    x[0, 0] = 2688.0  # block 0: 2688/6 = 448 (the E4M3 maximum)
    x[0, 16:32] = 6 * 2.0**-8 * torch.tensor([0.5, 1, 1.5, 2, 3, 4, 6] + [0] * 9) / 6  # block 1: scale 2^-8
    x[0, 17] = -x[0, 17]
    x[0, 32] = 6 * 3 * 2.0**-9  # block 2: scale 3 * 2^-9 (subnormal), element code 6
    x[0, 48] = 6 * 2.0**-10  # block 3: scale 2^-10 is a tie between 0 and 2^-9 -> 0: the block is all zero
    x[0, 64] = 6 * 1.5 * 2.0**-10  # block 4: rounds up to the smallest subnormal 2^-9
    qt = quantize(x, "nvfp4")
    assert float(qt.global_scale) == 1.0
    assert qt.scale.float()[0].tolist() == [448.0, 2.0**-8, 3 * 2.0**-9, 0.0, 2.0**-9, 0.0]
    codes = qt.codes()[0]
    assert codes[16:23].tolist() == [0.5, -1, 1.5, 2, 3, 4, 6]
    assert float(codes[32]) == 6.0 and float(codes[48]) == 0.0
    # 9 * 2^-10 / 2^-9 = 4.5 code units -> 4: the element uses the ROUNDED scale (the unrounded 1.5 * 2^-10
    # would give code 6)
    assert float(codes[64]) == 4.0
    deq = qt.dequantize()[0]
    assert torch.equal(deq[16:23], x[0, 16:23]) and float(deq[48]) == 0.0
    assert not torch.isnan(deq).any()


def test_nvfp4_element_step_uses_rounded_block_scale():
    # amax 2688 -> s_global 1; block amax 6*1.1 -> ideal scale 1.1, E4M3 rounds it to 1.125
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0
    x[0, 16] = 6.6
    x[0, 17] = 1.6875  # 1.6875 / 1.125 = 1.5 exactly -> code 1.5 (with 1.1 it would be 1.534 -> 1.5 too)
    x[0, 18] = 2.8125  # 2.8125 / 1.125 = 2.5 -> tie -> 2 (with 1.1: 2.557 -> 3)
    qt = quantize(x, "nvfp4")
    assert float(qt.scale.float()[0, 1]) == 1.125
    assert qt.codes()[0, 16:19].tolist() == [6.0, 1.5, 2.0]


def test_mxfp4_scale_exponent_by_hand():
    x = torch.zeros(1, 96)
    x[0, 0], x[0, 1] = 0.75, -0.3  # amax 0.75: floor(log2) = -1 -> X = 2^-3, e = 124; 0.75/X = 6, -0.3/X = -2.4
    x[0, 32] = 7.9  # floor(log2 7.9) = 2 -> X = 1: 7.9 saturates to 6
    qt = quantize(x, "mxfp4")  # block 2 is all zero -> e = 127
    assert qt.scale[0].tolist() == [124, 127 + 0, 127]
    assert qt.codes()[0, [0, 1, 32]].tolist() == [6.0, -2.0, 6.0]
    assert qt.dequantize()[0, [0, 1, 32]].tolist() == [0.75, -0.25, 6.0]


def test_int8_ties_to_even_and_symmetric_range():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -127.0, 63.5]])  # amax 127 -> scale 1
    qt = quantize(x, "int8")
    assert float(qt.scale) == 1.0
    assert qt.data.tolist() == [[127, 0, 2, 2, 0, -2, -127, 64]]


@pytest.mark.parametrize("fmt", ALL)
def test_all_zero_inputs_and_blocks(fmt):
    z = quantize(torch.zeros(4, 256), fmt)
    assert torch.equal(z.dequantize(), torch.zeros(4, 256))
    if fmt in ("int8", "fp8", "fp8-tensor", "fp8-block"):
        assert bool((z.scale == 1).all())  # amax = 0 gives scale 1
    if fmt == "nvfp4":
        assert float(z.global_scale) == 1.0
    if fmt == "mxfp4":
        assert bool((z.scale == 127).all())
    x = torch.randn(4, 256)
    x[:, :128] = 0
    x[2] = 0
    deq = quantize(x, fmt).dequantize()
    assert not torch.isnan(deq).any()
    assert bool((deq[:, :128] == 0).all()) and bool((deq[2] == 0).all())


# ----------------------------------------------------------------------------------------------------------
# padding, empty tensors, out=
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("k", [20, 40, 300, 576])
def test_padding_round_trip(fmt, k):
    x = random_input((130, k))
    mult = FORMATS[fmt].pad_multiple
    kp = -(-k // mult) * mult
    xp = torch.nn.functional.pad(x, (0, kp - k))
    a, b = quantize(x, fmt), quantize(xp, fmt)
    # padding with zeros changes neither any scale nor any code
    assert torch.equal(bits(a.data), bits(b.data))
    assert torch.equal(bits(a.scale), bits(b.scale))
    deq = a.dequantize()
    assert deq.shape == x.shape
    assert torch.equal(deq, b.dequantize()[:, :k])


@pytest.mark.parametrize("fmt", ALL)
def test_empty_rows_are_allowed(fmt):
    qt = quantize(torch.zeros(0, 3, 48), fmt, "activation")
    assert qt.dequantize().shape == (0, 3, 48)
    assert quantize(torch.zeros(0, 48), fmt, "weight").dequantize(torch.bfloat16).shape == (0, 48)


@pytest.mark.parametrize("fmt", ALL)
def test_out_reuses_buffers(fmt):
    qt = quantize(torch.randn(150, 200), fmt)
    ptrs = [t.data_ptr() for t in (qt.data, qt.scale, qt.global_scale) if t is not None]
    x2 = random_input((150, 200))
    ret = quantize(x2, fmt, out=qt)
    assert ret is qt
    assert ptrs == [t.data_ptr() for t in (qt.data, qt.scale, qt.global_scale) if t is not None]
    fresh = quantize(x2, fmt)
    assert torch.equal(qt.dequantize(), fresh.dequantize())
    assert torch.equal(bits(qt.data), bits(fresh.data))
    with pytest.raises(ValueError, match="shape"):
        quantize(torch.randn(151, 200), fmt, out=qt)
    with pytest.raises(ValueError, match="role"):
        quantize(x2, fmt, "activation", out=qt)


# ----------------------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------------------
def test_unknown_format_lists_valid_names():
    with pytest.raises(ValueError, match="unknown number format 'fp16'.*int8.*nvfp4.*mxfp4"):
        quantize(torch.randn(4, 16), "fp16")
    with pytest.raises(ValueError, match="valid formats"):
        fake_quantize(torch.randn(4, 16), "NVFP4")


def test_bad_dtype_role_and_shape():
    with pytest.raises(TypeError, match="floating"):
        quantize(torch.ones(4, 16, dtype=torch.int32), "int8")
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize([[1.0, 2.0]], "int8")
    with pytest.raises(ValueError, match="role"):
        quantize(torch.randn(4, 16), "int8", role="bias")
    with pytest.raises(ValueError, match="2-D weight"):
        quantize(torch.randn(2, 4, 16), "fp8-block", role="weight")
    with pytest.raises(ValueError, match="scalar"):
        quantize(torch.tensor(1.0), "fp8", role="activation")
    with pytest.raises(ValueError, match="empty last dimension"):
        quantize(torch.zeros(4, 0), "nvfp4")


@pytest.mark.parametrize("fmt", ALL)
def test_non_finite_values_are_reported(fmt):
    x = torch.randn(8, 64)
    x[3, 5] = float("nan")
    x[6, 1] = float("inf")
    x[7, 2] = float("nan")
    with pytest.raises(ValueError, match=r"2 NaN and 1 Inf.*index \(3, 5\).*check the weights"):
        quantize(x, fmt)
    big = torch.randn(4, 32, dtype=torch.float64)
    big[1, 1] = 1e300
    with pytest.raises(ValueError, match="overflow float32"):
        quantize(big, fmt, "activation")


# ----------------------------------------------------------------------------------------------------------
# GPU: the same reference on CUDA tensors gives the same bits
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("role", ["weight", "activation"])
def test_cuda_matches_cpu_bit_for_bit(fmt, role):
    x = random_input((300, 576), torch.bfloat16)
    a, b = quantize(x, fmt, role), quantize(x.cuda(), fmt, role)
    assert b.data.is_cuda and b.scale.is_cuda
    assert torch.equal(bits(a.data), bits(b.data.cpu()))
    assert torch.equal(bits(a.scale), bits(b.scale.cpu()))
    if a.global_scale is not None:
        assert torch.equal(bits(a.global_scale), bits(b.global_scale.cpu()))
    assert torch.equal(a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16).cpu())
    ptr = b.data.data_ptr()
    quantize(x.cuda() * 2, fmt, role, out=b)
    assert b.data.data_ptr() == ptr


@pytest.mark.parametrize("fmt,qmax", [("int8", 127.0), ("fp8", 448.0), ("fp8-tensor", 448.0)])
def test_scale_is_amax_times_float32_reciprocal(fmt, qmax):
    """The device-independent spelling of amax / qmax (what CUDA computes and the kernels reproduce)."""
    x = random_input((64, 96))
    amax = x.abs().amax(-1, keepdim=True) if fmt != "fp8-tensor" else x.abs().amax()
    want = amax * torch.tensor(1.0 / qmax, dtype=torch.float32)
    want = torch.where(want > 0, want, 1.0)
    assert torch.equal(bits(quantize(x, fmt).scale), bits(want))


def test_format_capabilities_come_from_the_spec_and_the_config_lists_derive_from_the_registry():
    from quarl.formats.registry import FORMATS
    from quarl.precision import QUANT_FORMATS, WEIGHT_ONLY_FORMATS, PrecisionConfig

    assert QUANT_FORMATS == tuple(FORMATS) == ("int8", "fp8", "fp8-tensor", "fp8-block", "nvfp4", "mxfp4")
    assert WEIGHT_ONLY_FORMATS == ("nvfp4", "mxfp4")
    caps = {name: (s.needs_fp8_hardware, s.is_8bit, s.per_tensor_scale, s.tuning_family, s.packed)
            for name, s in FORMATS.items()}
    assert caps == {
        "int8": (False, True, False, "int8", False),
        "fp8": (True, True, False, "fp8", False),
        "fp8-tensor": (True, True, True, "fp8", False),
        "fp8-block": (True, True, False, "fp8-block", False),
        "nvfp4": (True, False, False, "w4a16", True),  # E4M3 block scales
        "mxfp4": (False, False, False, "w4a16", True),  # E8M0 scales: no FP8 decoding
    }
    # every format's codes fit its declared code dtype and packing
    for name, spec in FORMATS.items():
        q = quantize(torch.randn(3, 64), name)
        assert q.data.dtype == spec.code_dtype and q.data.shape[-1] == spec.padded_k(64) // (2 if spec.packed else 1)
    # the batch-dependence refusal follows the spec, not a spelled-out name
    with pytest.raises(ValueError, match="one scale per tensor"):
        PrecisionConfig(flow="unified", format="fp8-tensor").validate()
    PrecisionConfig(flow="unified", format="fp8").validate()
