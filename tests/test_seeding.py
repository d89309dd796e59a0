"""Per-answer random streams (`seeds=`): uniform, independent of the batch, and an engine's answers to a prompt are
the same alone or among other prompts, chunked or continuously batched (what makes N ranks reproduce one)."""

import math

import pytest
import torch

from quarl.rollout.engine import RolloutEngine, _sample_seeded
from quarl.rollout.fast_engine import FastRolloutEngine
from quarl.rollout.sampling import SamplingParams, filtered_logprobs
from quarl.rollout.seeding import answer_seed, counter_uniform
from tiny_models import make_model, rand_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_counter_uniform_is_uniform_and_a_function_of_its_row_alone():
    seeds = torch.randint(0, 2**62, (4000,))
    draws = torch.randint(0, 1000, (4000,))
    u = counter_uniform(seeds, draws, 25)  # 100,000 draws
    assert u.shape == (4000, 25) and u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # mean and variance of U(0, 1) within 5 standard errors; a 20-bin histogram within 5 sigma per bin
    n = u.numel()
    assert abs(float(u.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.double().var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    counts = torch.histc(u.double(), bins=20, min=0, max=1)
    expected = n / 20
    assert float((counts - expected).abs().max()) < 5 * math.sqrt(expected)
    # neighbouring draws and seeds are uncorrelated
    a, b = u[:, :-1].flatten().double(), u[:, 1:].flatten().double()
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02
    # a row's values depend on (seed, draw) only: the same row inside another batch, in another order
    perm = torch.randperm(4000)
    assert torch.equal(counter_uniform(seeds[perm], draws[perm], 25), u[perm])
    assert torch.equal(counter_uniform(seeds[7:8], draws[7:8], 25), u[7:8])
    assert not torch.equal(counter_uniform(seeds[:1], draws[:1] + 1, 25), u[:1])


def test_seeded_draws_follow_the_sampling_distribution():
    """Many answers' first draws from one row of logits: frequencies match the filtered distribution."""
    torch.manual_seed(0)
    logits = torch.randn(1, 37) * 1.5
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
    q = filtered_logprobs(logits.double(), params).exp()[0]
    N = 40000
    seeds = torch.tensor([answer_seed(12345, j) for j in range(N)])
    tokens, logprobs = _sample_seeded(logits.expand(N, -1), params, seeds, 0)
    counts = torch.bincount(tokens, minlength=37).double()
    assert float(counts[q == 0].sum()) == 0  # never outside the top-k / top-p support
    sigma = (N * q * (1 - q)).sqrt()
    assert bool(((counts - N * q).abs() <= 5 * sigma + 1).all())
    torch.testing.assert_close(logprobs.double(), q.log()[tokens], atol=1e-6, rtol=0)


@pytest.mark.parametrize("engine_kind", ["reference", "fast"])
def test_a_prompts_answers_do_not_depend_on_the_other_prompts(engine_kind):
    torch.manual_seed(1)
    model = make_model("llama")
    prompts = rand_prompts([5, 9, 3, 7, 6])
    seeds = [11, 2**40 + 3, 5, 8, 13]

    def engine(max_batch_size):
        if engine_kind == "reference":
            return RolloutEngine(model, None, max_batch_size=max_batch_size)
        return FastRolloutEngine(model, None, max_batch_size=max_batch_size, sync_every=2)

    kw = dict(n=3, max_new_tokens=8, temperature=1.0, top_p=0.95)
    together = engine(64).generate(prompts, seeds=seeds, **kw)
    # a few slots: chunks (reference) or continuous batching with refills and slot moves (fast)
    squeezed = engine(6).generate(prompts[::-1], seeds=seeds[::-1], **kw)[::-1]
    alone = [engine(64).generate([p], seeds=[s], **kw)[0] for p, s in zip(prompts, seeds)]
    for a, b, c in zip(together, squeezed, alone):
        assert [x.token_ids for x in a.completions] == [x.token_ids for x in b.completions] == \
            [x.token_ids for x in c.completions]
        for x, y in zip(a.completions, c.completions):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    # the streams differ between prompts' seeds and between the answers of one prompt
    other = engine(64).generate(prompts, seeds=[s + 1 for s in seeds], **kw)
    assert [x.token_ids for o in other for x in o.completions] != [x.token_ids for o in together for x in o.completions]
    assert len({tuple(x.token_ids) for o in together for x in o.completions}) > 10


def test_seeds_must_match_the_prompts():
    model = make_model("llama")
    with pytest.raises(ValueError, match="one non-negative integer per prompt"):
        RolloutEngine(model, None).generate(rand_prompts([3, 4]), n=2, max_new_tokens=2, seeds=[1])
