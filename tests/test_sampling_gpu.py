"""The one-pass sampling kernel (`quarl.kernels.sampling`) against the torch definition of the decode step.

- Same draws as `filtered_logprobs` + `gumbel_max` on the same noise: every token equal (a differing token
  needs two Gumbel scores within one float32 rounding of each other, ~1e-6 per row), log-probs within 2e-5.
- Greedy: the argmax of the logits (lowest index among ties) and its log-softmax value.
- Draws follow softmax(logits / T): empirical frequencies within 5 standard deviations.
"""

from __future__ import annotations

import pytest
import torch

from quarl.rollout.fast_step import gumbel_max, sample_next
from quarl.rollout.sampling import SamplingParams, filtered_logprobs

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("ranges,block,warps", [(1, 1024, 4), (5, 1024, 4), (3, 2048, 8)])
def test_same_draws_as_torch(dtype, temperature, ranges, block, warps):
    from quarl.kernels.sampling import sample_rows

    B, V = 300, 5003  # V not a multiple of the 1024-wide block
    logits = (torch.randn(B, V, device=DEV) * 3).to(dtype)
    noise = torch.rand(B, V, device=DEV)
    tok, lp = sample_rows(logits, noise, temperature, ranges, block, warps)
    ref_lp = filtered_logprobs(logits, SamplingParams(temperature))
    ref_tok = gumbel_max(ref_lp, noise)
    assert tok.dtype == torch.long and lp.dtype == torch.float32 and tok.shape == lp.shape == (B,)
    assert torch.equal(tok, ref_tok), f"{int((tok != ref_tok).sum())} of {B} draws differ"
    torch.testing.assert_close(lp, ref_lp.gather(1, ref_tok[:, None]).squeeze(1), atol=2e-5, rtol=0)


@pytest.mark.parametrize("ranges", [1, 3])
def test_greedy_is_argmax_with_lowest_index_on_ties(ranges):
    from quarl.kernels.sampling import sample_rows

    logits = torch.randn(64, 3000, device=DEV)
    logits[0] = 1.0  # all tied: index 0
    logits[1, 2500] = logits[1, 7] = 50.0  # a tie across blocks (and ranges): the lower index
    tok, lp = sample_rows(logits, None, 0.0, ranges)
    assert torch.equal(tok, logits.argmax(-1)) and tok[0] == 0 and tok[1] == 7
    torch.testing.assert_close(lp, torch.log_softmax(logits.double(), -1).gather(1, tok[:, None]).squeeze(1).float(),
                               atol=2e-5, rtol=0)


def test_draws_follow_the_tempered_distribution():
    from quarl.kernels.sampling import sample_rows

    V, N, T = 2050, 40000, 0.8
    row = torch.randn(V, device=DEV) * 2
    row[:6] = torch.tensor([4.0, 3.5, 3.0, 2.0, 1.0, 0.0], device=DEV)  # a few tokens with visible mass
    tok, _ = sample_rows(row.expand(N, V), torch.rand(N, V, device=DEV), T)
    p = torch.softmax(row.double() / T, -1)
    counts = torch.bincount(tok, minlength=V).double()
    sd = (N * p * (1 - p)).sqrt()
    worst = float(((counts - N * p).abs() / (sd + 1e-9))[:6].max())
    assert worst < 5, f"frequencies off by {worst:.1f} standard deviations"


def test_sample_next_takes_the_kernel_for_plain_sampling_only(monkeypatch):
    """Temperature sampling and greedy decoding call the kernel, top-p keeps the torch path (its support is
    filtered); both give the torch definition's answer."""
    import quarl.kernels.sampling as sampling_kernel

    calls = []
    real = sampling_kernel.sample_rows
    monkeypatch.setattr(sampling_kernel, "sample_rows", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(8, 1000, device=DEV, dtype=torch.bfloat16)
    noise = torch.rand(8, 1000, device=DEV)
    for params, kernel in ((SamplingParams(1.0), True), (SamplingParams(1.0, top_p=0.5), False),
                           (SamplingParams(0.0), True)):
        calls.clear()
        tok, lp = sample_next(logits, params, None if params.greedy else noise)
        assert bool(calls) == kernel, params
        ref_lp = filtered_logprobs(logits, params)
        ref = logits.float().argmax(-1) if params.greedy else gumbel_max(ref_lp, noise)
        assert torch.equal(tok, ref), params
        torch.testing.assert_close(lp.float(), ref_lp.gather(1, ref[:, None]).squeeze(1), atol=2e-5, rtol=0)


def test_nan_rows_give_a_valid_token_and_a_nan_logprob():
    """A NaN row must not produce an index outside the vocabulary (it would crash the next embedding lookup)."""
    from quarl.kernels.sampling import sample_rows

    logits = torch.randn(3, 3000, device=DEV)
    logits[0] = float("nan")
    logits[1, 2100] = logits[1, 1700] = float("nan")
    for noise, t in ((None, 0.0), (torch.rand(3, 3000, device=DEV), 0.7)):
        tok, lp = sample_rows(logits, noise, t)
        assert tok.tolist()[:2] == [0, 1700] and torch.isnan(lp[:2]).all() and torch.isfinite(lp[2])


def test_a_failing_kernel_leaves_the_torch_sampler_in_charge(monkeypatch):
    import quarl.fallbacks
    import quarl.kernels.sampling as sampling_kernel
    from quarl.kernels import capabilities

    monkeypatch.setattr(capabilities, "CAPABILITIES", capabilities.CapabilityRegistry())
    monkeypatch.setattr(quarl.fallbacks, "_reported", {})  # reported once per process: start afresh
    monkeypatch.setattr(sampling_kernel, "sample_rows", lambda logits, *a: (torch.zeros_like(logits[:, 0]).long(),
                                                                           torch.zeros_like(logits[:, 0])))
    logits = torch.randn(5, 700, device=DEV) * 4
    noise = torch.rand(5, 700, device=DEV)
    with pytest.warns(UserWarning, match="sampling kernel: disagrees"):
        tok, lp = sample_next(logits, SamplingParams(1.0), noise)
    ref_lp = filtered_logprobs(logits, SamplingParams(1.0))
    assert torch.equal(tok, gumbel_max(ref_lp, noise))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,V,ranges", [(512, 152064, None), (300, 5003, 1), (7, 5003, 3)])
def test_inverse_cdf_kernel_draws_are_inverse_cdf_draws(dtype, B, V, ranges):
    """`sample_rows_cdf`: every token lies in the float64 interval of its uniform (within 1e-5 of the mass),
    log-probs within 5e-5 of the filtered log-probs (float32 sums over up to 152k columns), NaN (+inf) rows give
    the first NaN's (+inf's) index and a NaN log-prob, rows without mass token 0 and a NaN log-prob; and
    `sample_next` with one draw per row takes this kernel."""
    from quarl.kernels.sampling_cdf import sample_rows_cdf
    from quarl.rollout.fast_step import inverse_cdf_consistent

    logits = (torch.randn(B, V, device=DEV) * 3).to(dtype)
    logits[0, 11] = logits[0, V - 1] = float("nan")
    logits[1] = float("-inf")
    logits[2, : V // 2] = float("-inf")
    logits[3, 4] = logits[3, V - 2] = float("inf")
    u = torch.rand(B, 1, device=DEV)
    for T in (1.0, 0.6):
        tok, lp = sample_rows_cdf(logits, u, T, ranges)
        ref_lp = filtered_logprobs(logits, SamplingParams(T))
        rows = torch.cat((torch.tensor([2], device=DEV), torch.arange(4, B, device=DEV)))
        assert tok[0] == 11 and torch.isnan(lp[0]) and tok[1] == 0 and torch.isnan(lp[1])
        assert tok[3] == 4 and torch.isnan(lp[3])
        assert bool(inverse_cdf_consistent(ref_lp[rows], u[rows, 0], tok[rows]).all())
        torch.testing.assert_close(lp[rows], ref_lp.gather(1, tok[:, None]).squeeze(1)[rows].float(), atol=5e-5,
                                   rtol=0)
        tok2, lp2 = sample_next(logits, SamplingParams(T), u)
        if ranges is None:
            assert torch.equal(tok2, tok) and torch.equal(lp2.nan_to_num(), lp.nan_to_num())


def test_inverse_cdf_draws_follow_the_tempered_distribution():
    from quarl.kernels.sampling_cdf import sample_rows_cdf

    V, N, T = 2050, 200000, 0.8
    row = torch.randn(V, device=DEV) * 2
    row[:6] = torch.tensor([4.0, 3.5, 3.0, 2.0, 1.0, 0.0], device=DEV)
    tok, _ = sample_rows_cdf(row.expand(N, V), torch.rand(N, device=DEV), T)
    p = torch.softmax(row.double() / T, -1)
    counts = torch.bincount(tok, minlength=V).double()
    sd = (N * p * (1 - p)).sqrt()
    assert bool(((counts - N * p).abs() <= 5 * sd + 2).all())
