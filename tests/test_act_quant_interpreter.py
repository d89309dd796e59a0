"""The activation quantization kernel (`quarl.kernels.act_quant`) in Triton's CPU interpreter, against
`quarl.formats.quantize(x, fmt, "activation")` and `fake_quantize`: codes and scales bit for bit, through each
of the kernel's routes (a whole row in one pass, a row walked twice for its amax, rows split over programs or
walked block by block, unrolled or counted walks, codes padded past K).

The compiled kernel runs the same checks on a GPU: tests/test_kernels_gpu.py, test_activation_quantization_is_exact.
"""

import textwrap

import pytest

from interpreter import INTERPRETER_PATCH, run_in_interpreter

_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    from quarl.formats import quantize
    from quarl.formats.registry import fake_quantize_unchecked
    from quarl.kernels import act_quant

    FMT = FMT_ARG
    SPLIT_AMAX = act_quant.SPLIT_AMAX_ROWS_BELOW  # the shipped threshold (these rows are below it)
    torch.manual_seed(SEED_ARG)
    print("seed", SEED_ARG)  # shown with the traceback when a check fails
    # K: one 128-group; ragged (a partial group, zero codes past K for fp8-block); several blocks of 256
    for m, k in [(3, 128), (4, 1000), (2, 700)]:
        x = (torch.randn(m, k) * torch.rand(m, 1) * 10).half()
        x[0, : k // 2] = 0  # a zero 1x128 group / half row
        x[1] = 0  # an all-zero row: scale 1
        ref = quantize(x, FMT, "activation")
        kp = ref.data.shape[-1]
        # default (one pass for per-row scales), 256-column blocks (a row walked twice: its blocks split over
        # programs that each walk the whole row for the amax; groups split over programs); with
        # SPLIT_ROWS_BELOW = SPLIT_AMAX_ROWS_BELOW = 1, rows are walked block by block by one program each, however
        # few; with MAX_UNROLL = 0 the walks are loops counted when running
        for block, split_below, unroll in [(None, 1024, 8), (256, 1024, 8), (128, 1024, 8), (256, 1, 8),
                                           (None, 1, 8), (128, 1024, 0), (256, 1, 0), (128, 1, 0)]:
            act_quant.SPLIT_ROWS_BELOW, act_quant.MAX_UNROLL = split_below, unroll
            act_quant.SPLIT_AMAX_ROWS_BELOW = min(split_below, SPLIT_AMAX)
            codes, scales = act_quant.quantize_activation(x, FMT, kp, block=block)
            assert codes.dtype == ref.data.dtype and codes.shape == ref.data.shape, (codes.shape, ref.data.shape)
            where = (FMT, m, k, block, split_below, unroll)
            assert torch.equal(scales.reshape(ref.scale.shape), ref.scale), (where, "scales")
            assert torch.equal(codes.view(torch.uint8), ref.data.view(torch.uint8)), (where, "codes")
        # codes past kp: zero codes (fp8-block: whole 128-groups with scale 1), as the training linear pads them;
        # by default (one pass), in 128-column blocks split over programs (some hold padding only; the amax walk
        # skips them) and, with MAX_UNROLL = 4 (the amax walk too long to repeat in every program), one program
        # per row walking its blocks
        act_quant.SPLIT_ROWS_BELOW, act_quant.SPLIT_AMAX_ROWS_BELOW = 1024, SPLIT_AMAX
        for block, unroll in [(None, 8), (128, 8), (128, 4)]:
            act_quant.MAX_UNROLL = unroll
            codes, scales = act_quant.quantize_activation(x, FMT, kp + 256, block=block)
            where = (FMT, m, k, block, unroll)
            assert torch.equal(codes.view(torch.uint8)[:, :kp], ref.data.view(torch.uint8)), (where, "padded")
            assert not codes.view(torch.uint8)[:, kp:].any(), (where, "padding codes")
            if FMT == "fp8-block":
                assert torch.equal(scales[:, :kp // 128], ref.scale) and bool((scales[:, kp // 128:] == 1).all())
            else:
                assert torch.equal(scales.reshape(ref.scale.shape), ref.scale), (where, "padded scales")
        act_quant.MAX_UNROLL = 8
        y = act_quant.fake_quantize_activation(x, FMT)
        want = fake_quantize_unchecked(x, FMT, "activation")
        assert y.dtype == x.dtype and torch.equal(y, want), (FMT, m, k, "fake quantize")
        assert not torch.equal(y, x)  # the rounding changes values: the check above can fail
    print("ok")
""")


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "fp8-tensor"])
def test_activation_quantization_matches_formats_in_the_interpreter(fmt):
    import torch

    seed = int(torch.randint(0, 2**31, (1,)))
    run_in_interpreter(_CHECK.replace("FMT_ARG", repr(fmt)).replace("SEED_ARG", str(seed)))
