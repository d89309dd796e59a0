"""FastRolloutEngine on the CPU (no CUDA graphs): same results as the reference RolloutEngine.

Tolerances: behaviour log-probs vs a float64 full-sequence forward of the same weights: 1e-4 for a float32 model
(decode and full attention sum in different orders; float32 rounding of logits ~1e-6 relative). Greedy tokens
must equal the reference engine's exactly in float32/float64 (tiny models with O(1) logits: no near-ties at
float32 resolution). Decode attention vs a float64 per-head loop: 1e-5 in float32.
"""

import textwrap

import pytest
import torch

from quarl.model.precision_apply import apply_precision
from quarl.model.tiny import tiny_tokenizer
from quarl.precision import PrecisionConfig
from quarl.rollout.engine import RolloutEngine
from quarl.rollout.fast_attention import FP8_KV_DTYPE, decode_attention_torch
from quarl.rollout.fast_cache import SlotKVCache
from quarl.rollout.fast_engine import FastRolloutEngine, batch_buckets
from quarl.rollout.fast_step import gumbel_max
from quarl.rollout.sampling import SamplingParams, filtered_logprobs
from interpreter import INTERPRETER_PATCH, run_in_interpreter
from tiny_models import make_model, rand_prompts


pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()




def float64_logprobs(model, prompt, completion, params: SamplingParams, with_cut_margin: bool = False):
    """log q(token) of every completion token under the filtered distribution, from one float64 forward; with
    with_cut_margin, also bool [T]: the steps whose top-k / top-p cut is clear of float32 rounding (`clear_cuts`)."""
    m64 = _double(model)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = m64(ids)[0, len(prompt) - 1:-1]
    lp = filtered_logprobs(logits, params).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
    return (lp, clear_cuts(logits, params)) if with_cut_margin else lp


def clear_cuts(logits64: torch.Tensor, params: SamplingParams, margin: float = 1e-5) -> torch.Tensor:
    """bool [T]: steps whose filter keeps the same tokens in float32 as in float64. The engine filters float32
    logits, the reference float64 ones: where the k-th and (k+1)-th scaled logits, or top-p and the mass ranked
    above some token, lie within `margin` (100x float32's error on them), the two may keep different tokens, which
    moves every log-prob by the boundary token's probability. Such steps are left out of the comparison."""
    scaled = logits64 / params.temperature
    clear = torch.ones(scaled.shape[0], dtype=torch.bool)
    if 0 < params.top_k < scaled.shape[-1]:
        top = torch.topk(scaled, params.top_k + 1, dim=-1).values
        clear &= (top[:, -2] - top[:, -1]) >= margin
        scaled = scaled.masked_fill(scaled < top[:, -2:-1], float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(torch.sort(scaled, dim=-1, descending=True).values, dim=-1)
        clear &= ~((probs.cumsum(-1) - probs - params.top_p).abs() < margin).any(-1)
    return clear


_DOUBLE: list = []  # [(model, its float64 copy)] for the last model asked about


def _double(model):
    """A float64 copy of model, made once per model. The cache holds the model itself and compares identity: keyed
    by id(model), a new model allocated at a collected one's address got the old model's copy (a flaky failure of
    the logprob tests, the reference then being another model's)."""
    if not _DOUBLE or _DOUBLE[0][0] is not model:
        import copy

        _DOUBLE[:] = [(model, copy.deepcopy(model).double())]
    return _DOUBLE[0][1]


def assert_same_outputs(ref, fast, lp_tol=1e-4):
    assert len(ref) == len(fast)
    for r, f in zip(ref, fast):
        assert r.prompt_token_ids == f.prompt_token_ids and r.prompt == f.prompt
        assert len(r.completions) == len(f.completions)
        for a, b in zip(r.completions, f.completions):
            assert a.token_ids == b.token_ids
            assert (a.finish_reason, a.text) == (b.finish_reason, b.text)
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=lp_tol, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_reference_with_continuous_batching(tok, arch):
    model = make_model(arch)
    prompts = rand_prompts([1, 5, 9, 3, 7, 2, 11])  # 7 groups of 2 through 4 slots: refills; 1-token prompt
    ref = RolloutEngine(model, tok).generate(prompts, n=2, max_new_tokens=14, temperature=0)
    fast_engine = FastRolloutEngine(model, tok, max_batch_size=4, sync_every=3)
    fast = fast_engine.generate(prompts, n=2, max_new_tokens=14, temperature=0)
    assert_same_outputs(ref, fast)
    assert fast_engine.last_stats["attention"] == "torch" and not fast_engine.last_stats["cuda_graphs"]
    p = SamplingParams(0.0)
    for pr, out in zip(prompts, fast):
        for c in out.completions:
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64),
                                       float64_logprobs(model, pr, c.token_ids, p), atol=1e-4, rtol=0)


@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(1.3, top_k=20),
                                    SamplingParams(1.0, top_p=0.8), SamplingParams(0.9, top_p=0.9, top_k=50)])
def test_sampled_behaviour_logprobs_equal_float64_forward(tok, params):
    model = make_model("qwen2")
    prompts = rand_prompts([4, 8, 1])
    outs = FastRolloutEngine(model, tok, max_batch_size=6, sync_every=4).generate(
        prompts, n=3, max_new_tokens=10, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=3)
    for pr, out in zip(prompts, outs):
        assert len(out.completions) == 3
        for c in out.completions:
            assert 0 < len(c.token_ids) == len(c.logprobs) <= 10
            ref, clear = float64_logprobs(model, pr, c.token_ids, params, with_cut_margin=True)
            assert torch.isfinite(ref[clear]).all(), "a sampled token lies outside the filtered support"
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64)[clear], ref[clear], atol=1e-4,
                                       rtol=0)


@pytest.mark.parametrize("case", range(8))
def test_continuous_batching_with_early_eos_keeps_every_completion_on_its_own_prompt(tok, case):
    """Randomized configurations (architecture, prompt lengths, samples per prompt, slots, sync interval,
    temperature) with EOS made likely, so sequences end at different steps: slots are refilled and compacted while
    others run. Every request comes back exactly once, and every completion's behaviour log-probs equal a float64
    forward of its own prompt (a completion attributed to the wrong prompt, or decoded over another sequence's
    cache columns, fails)."""
    import random

    rnd = random.Random(1000 + case)
    torch.manual_seed(1000 + case)
    model = make_model(rnd.choice(["qwen2", "llama"]))
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= rnd.choice([3.0, 6.0])
    prompts = rand_prompts([rnd.randint(1, 9) for _ in range(rnd.randint(2, 5))])
    n = rnd.randint(1, 3)
    params = SamplingParams(rnd.choice([0.7, 1.0, 1.3]))
    outs = FastRolloutEngine(model, tok, max_batch_size=rnd.randint(n, 7), sync_every=rnd.randint(1, 5)).generate(
        prompts, n=n, max_new_tokens=10, temperature=params.temperature, seed=case)
    assert [o.prompt_token_ids for o in outs] == prompts and all(len(o.completions) == n for o in outs)
    for pr, out in zip(prompts, outs):
        for c in out.completions:
            assert 0 < len(c.token_ids) == len(c.logprobs) <= 10
            ref = float64_logprobs(model, pr, c.token_ids, params)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


def test_gumbel_max_draws_from_the_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, generator=gen) * 1.5
    logits[3] = float("-inf")  # outside the support: never drawn
    lp = torch.log_softmax(logits, -1)
    N = 40000
    u = torch.rand(N, 8, generator=gen)
    draws = gumbel_max(lp.expand(N, 8), u)
    freq = torch.bincount(draws, minlength=8).double() / N
    assert freq[3] == 0
    # binomial std <= sqrt(0.25 / N) = 0.0025: 0.015 is 6 standard deviations
    torch.testing.assert_close(freq, lp.exp().double(), atol=0.015, rtol=0)


def test_continuous_batching_returns_every_request_once(tok):
    """EOS on ~10% of the vocabulary: ragged lengths, slots refilled from the queue, compaction at the end."""
    model = make_model("llama")
    model.config.eos_token_ids = list(range(0, 320, 10))
    prompts = rand_prompts([3, 6, 2, 8, 5, 4, 7, 1, 9, 3, 6])
    counted = []
    engine = FastRolloutEngine(model, None, max_batch_size=8, sync_every=2)
    outs = engine.generate(prompts, n=3, max_new_tokens=25, temperature=1.0, seed=5, progress=counted.append)
    eos = set(model.config.eos_token_ids)
    assert [o.prompt_token_ids for o in outs] == prompts
    total = 0
    for out in outs:
        assert len(out.completions) == 3
        for c in out.completions:
            total += len(c.token_ids)
            assert c.finish_reason in ("eos", "length")
            assert all(t not in eos for t in c.token_ids[:-1])
            assert (c.token_ids[-1] in eos) == (c.finish_reason == "eos")
            assert c.finish_reason == "eos" or len(c.token_ids) == 25
    assert sum(counted) == total
    lengths = {len(c.token_ids) for o in outs for c in o.completions}
    assert len(lengths) > 3, "EOS should end completions at different lengths"
    # greedy with the same EOS set: identical to the reference engine, slot moves included
    ref = RolloutEngine(model, None).generate(prompts, n=3, max_new_tokens=25, temperature=0)
    fast = engine.generate(prompts, n=3, max_new_tokens=25, temperature=0)
    assert_same_outputs(ref, fast)


def test_slot_compaction_preserves_sequences():
    """Sequences that outlive their neighbours are moved to low slots; outputs stay equal to the reference."""
    model = make_model("qwen3")
    model.config.eos_token_ids = list(range(0, 320, 4))
    prompts = rand_prompts([4, 2, 6, 3, 5, 7, 2, 4])
    engine = FastRolloutEngine(model, None, max_batch_size=16, sync_every=1)
    fast = engine.generate(prompts, n=2, max_new_tokens=30, temperature=0)
    ref = RolloutEngine(model, None).generate(prompts, n=2, max_new_tokens=30, temperature=0)
    assert_same_outputs(ref, fast)
    assert engine.last_stats["slot_moves"] > 0


def test_stop_strings_match_reference(tok):
    model = make_model("llama")
    prompts = ["hello there", "a", "the quick brown fox"]
    greedy = RolloutEngine(model, tok).generate(prompts, n=1, max_new_tokens=30, temperature=0)
    text = greedy[2].completions[0].text
    stop = [text[6:8], "\u00ff\u00fe"]  # one that occurs, one that (almost surely) does not
    ref = RolloutEngine(model, tok).generate(prompts, n=2, max_new_tokens=30, temperature=0, stop=stop)
    fast = FastRolloutEngine(model, tok, max_batch_size=4, sync_every=5).generate(
        prompts, n=2, max_new_tokens=30, temperature=0, stop=stop)
    assert_same_outputs(ref, fast)
    assert fast[2].completions[0].finish_reason == "stop"


def test_quantized_split_flow_equals_reference(tok):
    """Rollout-mode int8 linears act in the fast engine exactly as in the reference (float64: no rounding flips)."""
    model = make_model("qwen2", dtype=torch.float64)
    apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    prompts = rand_prompts([5, 3, 8])
    fast = FastRolloutEngine(model, tok, max_batch_size=6).generate(prompts, n=2, max_new_tokens=12,
                                                                    temperature=0)
    ref = RolloutEngine(model, tok).generate(prompts, n=2, max_new_tokens=12, temperature=0)
    assert_same_outputs(ref, fast, lp_tol=1e-9)
    assert not model.model.layers[0].mlp.up_proj.rollout  # rollout mode switched off afterwards
    # and the quantized copy was really used: the training-precision model gives other log-probs
    train_lp = float64_logprobs(model, prompts[0], fast[0].completions[0].token_ids, SamplingParams(0.0))
    assert (train_lp - torch.tensor(fast[0].completions[0].logprobs, dtype=torch.float64)).abs().max() > 1e-6


def test_seed_reproducible_and_seeds_differ(tok):
    model = make_model("llama")
    prompts = rand_prompts([4, 6])
    engine = FastRolloutEngine(model, tok, max_batch_size=4)
    a = engine.generate(prompts, n=2, max_new_tokens=12, seed=11)
    b = engine.generate(prompts, n=2, max_new_tokens=12, seed=11)
    c = engine.generate(prompts, n=2, max_new_tokens=12, seed=12)
    ids = lambda outs: [cc.token_ids for o in outs for cc in o.completions]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_ignore_eos_runs_to_max_new_tokens():
    model = make_model("llama")
    model.config.eos_token_ids = list(range(320))  # every token is EOS
    prompts = rand_prompts([3, 5])
    engine = FastRolloutEngine(model, None, max_batch_size=4)
    assert all(len(c.token_ids) == 1 for o in engine.generate(prompts, n=2, max_new_tokens=9) for c in o.completions)
    outs = engine.generate(prompts, n=2, max_new_tokens=9, ignore_eos=True)
    assert all(len(c.token_ids) == 9 and c.finish_reason == "length" for o in outs for c in o.completions)


def test_bad_arguments_raise_clear_errors(tok):
    model = make_model("llama")
    with pytest.raises(ValueError, match="max_batch_size"):
        FastRolloutEngine(model, tok, max_batch_size=2).generate([[1, 2]], n=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        FastRolloutEngine(model, tok, max_seq_len=8).generate([[1, 2, 3]], max_new_tokens=7)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        FastRolloutEngine(model, tok, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="sync_every"):
        FastRolloutEngine(model, tok, sync_every=0)
    with pytest.raises(ValueError, match="CUDA"):
        FastRolloutEngine(model, tok, use_cuda_graphs=True)
    with pytest.raises(ValueError, match="prompts must be"):
        FastRolloutEngine(model, tok).generate([], max_new_tokens=4)


def test_batch_buckets_cover_every_size():
    for slots in (1, 3, 64, 200, 512, 1000):
        b = batch_buckets(slots)
        assert b[-1] == slots and b == sorted(set(b)) and all(x >= 1 for x in b)


# ---------------------------------------------------------------- attention and cache


def naive_attention(q, k_cache, v_cache, lengths):
    """float64 per-sequence, per-head loop: the definition."""
    B, Hq, D = q.shape
    G = Hq // k_cache.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(lengths[b])
        for h in range(Hq):
            k = k_cache[b, h // G, :L].double()
            v = v_cache[b, h // G, :L].double()
            p = torch.softmax(k @ q[b, h].double() / D**0.5, 0)
            out[b, h] = p @ v
    return out


def test_decode_attention_torch_matches_definition():
    B, Hq, Hkv, D, C = 4, 6, 2, 16, 40
    q = torch.randn(B, Hq, D)
    k, v = torch.randn(B + 3, Hkv, C, D), torch.randn(B + 3, Hkv, C, D)
    k[:, :, 30:] = float("nan")  # beyond every length: must not leak into the result
    v[:, :, 30:] = float("nan")
    lengths = torch.tensor([1, 7, 30, 19])
    out = decode_attention_torch(q, torch.nan_to_num(k), torch.nan_to_num(v), lengths, kv_len=32)
    ref = naive_attention(q, k, v, lengths)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_fp8_kv_cache_saturates_and_round_trips():
    cache = SlotKVCache(1, 2, 1, 4, 8, FP8_KV_DTYPE, "cpu")
    x = torch.tensor([[[0.1, -3.0, 1000.0, -1e6]], [[0.0, 2.5, 448.0, -0.015625]]])
    cache.write_tokens(0, torch.tensor([0, 5]), x, x)
    stored = cache.keys[0][torch.arange(2), :, torch.tensor([0, 5])].float()
    assert torch.isfinite(stored).all()
    expected = x.clamp(-448, 448).to(FP8_KV_DTYPE).float()
    assert torch.equal(stored, expected)
    assert stored[0, 0, 2] == 448 and stored[0, 0, 3] == -448


def test_token_scaled_fp8_cache_writes_codes_and_scales_everywhere():
    """Decode and prefill writes store the rowwise-FP8 codes and scales of each head vector; move carries both."""
    from quarl.formats import quantize

    cache = SlotKVCache(2, 4, 2, 8, 6, FP8_KV_DTYPE, "cpu", token_scales=True)
    k, v = torch.randn(3, 2, 8) * 1e3, torch.randn(3, 2, 8) * 1e-3
    k[2, 1] = 0  # an all-zero vector stores scale 0 (codes 0: the same values as the format's scale 1)
    pos = torch.tensor([0, 5, 2])
    cache.write_tokens(1, pos, k, v)
    assert cache.key_scales[1][2, 1, 2] == 0
    written = ((cache.keys[1], cache.key_scales[1], k), (cache.values[1], cache.value_scales[1], v))
    for got_codes, got_scales, x in written:
        ref = quantize(x, "fp8", "activation")
        rows = torch.arange(3)
        assert torch.equal(got_codes[rows, :, pos].view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(got_scales[rows, :, pos], torch.where(x.abs().amax(-1) > 0, ref.scale[..., 0], 0))
    kp, vp = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8) * 50
    cache.write_prompts(0, torch.tensor([3, 1]), torch.tensor([1, 0]), kp, vp)
    ref = quantize(vp[1], "fp8", "activation")
    assert torch.equal(cache.values[0][3, :, :4].view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(cache.value_scales[0][3, :, :4], ref.scale[..., 0])
    cache.move(torch.tensor([3]), torch.tensor([0]), 4)
    assert torch.equal(cache.value_scales[0][0, :, :4], ref.scale[..., 0])
    assert torch.equal(cache.values[0][0, :, :4].view(torch.uint8), ref.data.view(torch.uint8))
    assert cache.nbytes_for(2, 4, 2, 8, 6, FP8_KV_DTYPE, True) == 2 * 2 * 4 * 2 * 6 * (8 + 4)
    with pytest.raises(ValueError, match="token_scales"):
        SlotKVCache(1, 1, 1, 8, 4, torch.float32, "cpu", token_scales=True)


def test_prefill_write_gives_each_slot_its_prompts_codes():
    """write_prompts converts each prompt once and copies it to its slots (a group): every slot holds exactly the
    single-scale FP8 codes of its own prompt row (saturated beyond +-448 / kv_scale), other slots stay zero."""
    kv_scale = 0.3
    cache = SlotKVCache(1, 6, 2, 8, 5, FP8_KV_DTYPE, "cpu", kv_scale=kv_scale)
    k, v = torch.randn(3, 2, 4, 8) * 100, torch.randn(3, 2, 4, 8)
    slots, rows = torch.tensor([5, 0, 2, 3]), torch.tensor([2, 2, 0, 1])
    cache.write_prompts(0, slots, rows, k, v)
    for got, x in ((cache.keys[0], k), (cache.values[0], v)):
        for slot, row in zip(slots.tolist(), rows.tolist()):
            expected = (x[row].float() / kv_scale).clamp(-448, 448).to(FP8_KV_DTYPE)
            assert torch.equal(got[slot, :, :4].view(torch.uint8), expected.view(torch.uint8)), (slot, row)
        assert got[[1, 4]].float().abs().sum() == 0 and got[:, :, 4].float().abs().sum() == 0


def test_token_scaled_attention_matches_float64():
    """Attention over codes and per-token scales equals float64 attention over float32(code * scale) rounded to
    q's dtype (here float64 q: the dequantized values exactly)."""
    B, Hq, Hkv, C, D = 3, 4, 2, 12, 8
    q = torch.randn(B, Hq, D, dtype=torch.float64)
    k = (torch.randn(B + 1, Hkv, C, D) * 100).to(FP8_KV_DTYPE)
    v = (torch.randn(B + 1, Hkv, C, D) * 100).to(FP8_KV_DTYPE)
    ks, vs = torch.rand(B + 1, Hkv, C) * 1e-2, torch.rand(B + 1, Hkv, C) * 1e2
    lengths = torch.tensor([1, 7, 12])
    out = decode_attention_torch(q, k, v, lengths, C, k_scales=ks, v_scales=vs)
    kd = (k.float() * ks[..., None]).double()
    vd = (v.float() * vs[..., None]).double()
    torch.testing.assert_close(out, naive_attention(q, kd, vd, lengths), atol=1e-9, rtol=1e-9)
    plain = decode_attention_torch(q, k, v, lengths, C)
    assert not torch.allclose(plain, out)  # the scales are applied


def test_fp8_kv_cache_engine_close_to_float64(tok):
    """E4M3 keys/values (3 mantissa bits, relative step 1/8): the log-prob error follows the size of q.k, so a
    model with small activations (std 0.05 weights; measured max error ~0.02) stays within 0.05, while a
    float32 cache on the same model is within 1e-5."""
    model = make_model("llama", std=0.05)
    prompts = rand_prompts([6, 3])
    for kv in ("fp8", "fp8-token"):
        _engine_close_to_float64(model, tok, prompts, kv)


def _engine_close_to_float64(model, tok, prompts, kv):
    outs = FastRolloutEngine(model, tok, max_batch_size=4, kv_cache_dtype=kv).generate(
        prompts, n=2, max_new_tokens=8, temperature=1.0, seed=0)
    for pr, out in zip(prompts, outs):
        for c in out.completions:
            ref = float64_logprobs(model, pr, c.token_ids, SamplingParams(1.0))
            err = (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max()
            assert 1e-5 < err < 0.05  # fp8 rounding is visible, but small


_TRITON_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    from quarl.kernels.decode_attention import decode_attention
    from quarl.rollout.fast_attention import decode_attention_torch
    torch.manual_seed(0)
    worst = 0.0
    for B, hq, hkv, d, C, splits, dt, kdt in [(3, 4, 2, 16, 40, 1, torch.float32, torch.float32),
                                              (3, 4, 2, 16, 130, 3, torch.float32, torch.float32),
                                              (2, 7, 1, 24, 70, 2, torch.float32, torch.float32),
                                              (3, 8, 2, 32, 100, 2, torch.float16, torch.float16),
                                              (3, 8, 2, 32, 100, 2, torch.float16, torch.float8_e4m3fn)]:
        q = torch.randn(B, hq, d).to(dt)
        k = torch.randn(B + 1, hkv, C, d).to(kdt)
        v = torch.randn(B + 1, hkv, C, d).to(kdt)
        lengths = torch.randint(1, C + 1, (B,))
        lengths[0], lengths[1], lengths[-1] = 1, 32, C  # block-aligned lengths: no partial last block
        ref = decode_attention_torch(q.double(), k, v, lengths, C)
        for block_n in (64, 16):  # 16: several full (unmasked) blocks per range, then a masked partial one
            out = decode_attention(q, k, v, lengths, splits, block_n=block_n)
            err = float((out.double() - ref).norm() / ref.norm())
            tol = 1e-6 if dt == torch.float32 else 2e-3
            assert err < tol, (B, hq, hkv, d, C, splits, dt, kdt, block_n, err)
    # a token-scaled FP8 cache: per-column key and value scales over orders of magnitude
    B, hq, hkv, d, C = 3, 8, 2, 32, 100
    q = torch.randn(B, hq, d).half()
    k, v = (torch.randn(B + 1, hkv, C, d).to(torch.float8_e4m3fn) for _ in "kv")
    scales = [torch.exp(torch.randn(B + 1, hkv, C) * w) * c for w, c in ((0.7, 0.3), (2.0, 1.0))]
    lengths = torch.tensor([1, 48, 77])
    ref = decode_attention_torch(q.double(), k, v, lengths, C, 1.0, *scales)
    for splits, block_n in [(1, 64), (1, 16), (2, 16)]:
        out = decode_attention(q, k, v, lengths, splits, block_n=block_n, k_scales=scales[0], v_scales=scales[1])
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < 2e-3, ("token scales", splits, block_n, err)
    print("ok")
""")


_SAMPLER_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    from quarl.kernels.sampling import sample_rows
    from quarl.rollout.fast_step import gumbel_max
    from quarl.rollout.sampling import SamplingParams, filtered_logprobs
    torch.manual_seed(0)
    B, V = 6, 3000
    logits = torch.randn(B, V) * 3
    logits[0] = 1.0  # all tied: index 0 (greedy)
    logits[1, 2500] = logits[1, 7] = 50  # a tie across ranges: the lower index
    logits[2, 1900] = logits[2, 2999] = float("nan")  # the first NaN's index, and a NaN log-prob
    logits[3, :1024] = float("-inf")  # a whole range without mass
    logits[5] = float("-inf")  # a row without mass: token 0, NaN log-prob
    noise = torch.rand(B, V)
    rows = [0, 1, 3, 4]
    for ranges, block in [(1, 1024), (3, 256), (8, 128), (None, 1024)]:
        for T in (0.0, 0.7):
            tok, lp = sample_rows(logits, None if T == 0 else noise, T, ranges, block)
            if T == 0:
                ref_tok = logits.nan_to_num(nan=float("inf")).argmax(-1)
                ref_lp = torch.log_softmax(logits.double(), -1).gather(1, ref_tok[:, None]).squeeze(1)
            else:
                flp = filtered_logprobs(logits, SamplingParams(T))
                ref_tok = gumbel_max(flp, noise)
                ref_lp = flp.gather(1, ref_tok[:, None]).squeeze(1).double()
            assert tok[2].item() == 1900 and torch.isnan(lp[2]), (ranges, T)
            assert tok[5].item() == 0 and torch.isnan(lp[5]), (ranges, T)
            assert torch.equal(tok[rows], ref_tok[rows]), (ranges, block, T)
            assert float((lp[rows].double() - ref_lp[rows]).abs().max()) < 1e-4, (ranges, block, T)
            assert T > 0 or (tok[0] == 0 and tok[1] == 7)
    print("ok")
""")


def test_sampling_kernel_in_interpreter():
    """The one-pass sampling kernel, whole rows and rows split into column ranges merged by a second kernel,
    run by Triton's CPU interpreter against the torch definition on the same noise: the same tokens, log-probs
    within 1e-4, the lowest index among ties (across ranges too), the first NaN's index with a NaN log-prob, and
    token 0 with a NaN log-prob for a row without mass."""
    run_in_interpreter(_SAMPLER_CHECK)


_CDF_SAMPLER_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    from quarl.kernels.sampling_cdf import sample_rows_cdf
    from quarl.rollout.fast_step import inverse_cdf, inverse_cdf_consistent
    from quarl.rollout.sampling import SamplingParams, filtered_logprobs
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    B, V = 8, 3000
    logits = torch.randn(B, V) * 3
    logits[2, 1900] = logits[2, 2999] = float("nan")  # the first NaN's index, and a NaN log-prob
    logits[7, 2100] = logits[7, 2500] = float("inf")  # the first +inf's index, and a NaN log-prob
    logits[3, :1024] = float("-inf")  # a whole range without mass
    logits[4, :] = float("-inf")
    logits[4, 2999] = 0.0  # all the mass on the last column
    logits[5] = float("-inf")  # a row without mass: token 0, NaN log-prob
    logits[6, 5] = 40.0  # nearly all the mass on one early column
    u = torch.rand(B, 1)
    u[0] = 0.0
    u[1] = 1.0 - 2.0**-24  # the largest float32 below 1: the last token with mass
    rows = [0, 1, 3, 4, 6]
    for ranges, block, T in [(1, 1024, 0.7), (3, 256, 1.0), (8, 128, 1.6), (None, 1024, 1.0), (32, 64, 0.7)]:
        tok, lp = sample_rows_cdf(logits, u, T, ranges, block)
        flp = filtered_logprobs(logits, SamplingParams(T))
        assert tok[2].item() == 1900 and torch.isnan(lp[2]), (ranges, T)
        assert tok[5].item() == 0 and torch.isnan(lp[5]), (ranges, T)
        assert tok[7].item() == 2100 and torch.isnan(lp[7]), (ranges, T)
        assert bool(inverse_cdf_consistent(flp[rows], u[rows, 0], tok[rows]).all()), (ranges, block, T)
        assert tok[4].item() == 2999 and tok[6].item() == 5, (ranges, T)
        ref_lp = flp.gather(1, tok[:, None]).squeeze(1).double()
        assert float((lp[rows].double() - ref_lp[rows]).abs().max()) < 1e-4, (ranges, block, T)
        ref_tok = inverse_cdf(flp, u[:, 0])
        assert int((tok[rows] != ref_tok[rows]).sum()) <= 1  # float32 vs float64 running sums
    # 300 fresh uniforms on one small distribution: every draw lands in its own interval
    n, v = 300, 40
    row = torch.randn(v) * 1.5
    row[7] = float("-inf")
    uu = torch.rand(n)
    tok, lp = sample_rows_cdf(row.expand(n, v).contiguous(), uu, 1.0, 4, 16)
    assert bool(inverse_cdf_consistent(row.expand(n, v).log_softmax(-1), uu, tok).all())
    assert not bool((tok == 7).any())
    for bad in (torch.rand(n, 2), torch.rand(n, 1, 1), torch.rand(n).double(), torch.rand(n - 1)):
        try:
            sample_rows_cdf(row.expand(n, v).contiguous(), bad, 1.0)
        except ValueError as e:
            assert "uniforms must be float32" in str(e)
        else:
            raise AssertionError(f"uniforms {tuple(bad.shape)} {bad.dtype} were accepted")
    print("ok")
""")


def test_inverse_cdf_sampling_kernel_in_interpreter():
    """The inverse-CDF sampling kernel (per-range mass, then a scan of the one range where the target falls) run
    by Triton's CPU interpreter: every token is an inverse-CDF draw of its uniform (its float64 interval holds
    u * total within 1e-5 of the mass), log-probs within 1e-4 of the filtered log-probs, mass at either end, u = 0
    and the largest u below 1, a range without mass, the first NaN's index with a NaN log-prob, token 0 for a
    row without mass; and 300 fresh draws from one distribution (the frequencies of such draws are tested on the
    torch definition, `test_inverse_cdf_draws_follow_the_distribution`)."""
    run_in_interpreter(_CDF_SAMPLER_CHECK)


def test_triton_decode_attention_in_interpreter():
    """The Triton kernel's indexing, GQA grouping, split merge and FP8 path, run by Triton's CPU interpreter
    (float32 and float16 only: the interpreter mis-handles bf16 dots)."""
    run_in_interpreter(_TRITON_CHECK)


def test_triton_decode_attention_refuses_caches_it_cannot_read():
    """Keys and values in q's dtype or E4M3, both the same: another cache dtype (e5m2, fp16 under bf16 queries)
    would be misread as E4M3 codes, so it is refused with the accepted choices."""
    pytest.importorskip("triton")
    from quarl.kernels.decode_attention import decode_attention

    q = torch.randn(2, 4, 16).bfloat16()
    lengths = torch.tensor([3, 5])
    for k_dtype, v_dtype in [(torch.float8_e5m2, torch.float8_e5m2), (torch.float16, torch.float16),
                             (torch.float8_e4m3fn, torch.bfloat16)]:
        k, v = torch.zeros(2, 2, 8, 16).to(k_dtype), torch.zeros(2, 2, 8, 16).to(v_dtype)
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            decode_attention(q, k, v, lengths)


def test_inverse_cdf_draws_follow_the_distribution():
    """`fast_step.inverse_cdf`: over 200,000 fresh uniforms the frequencies match softmax within 5 standard errors,
    a token without mass is never drawn, u = 0 gives the first token with mass and the largest u below 1 the last;
    a NaN row gives its first NaN's index; every draw passes `inverse_cdf_consistent`, and a token moved to a
    neighbour does not."""
    from quarl.rollout.fast_step import inverse_cdf, inverse_cdf_consistent

    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    n, v = 200_000, 50
    row = torch.randn(v) * 1.5
    row[0] = row[9] = row[v - 1] = float("-inf")
    lp = row.log_softmax(-1).expand(n, v)
    u = torch.rand(n)
    tok = inverse_cdf(lp, u)
    q = torch.softmax(row.double(), -1)
    freq = torch.bincount(tok, minlength=v).double() / n
    assert freq[0] == freq[9] == freq[v - 1] == 0
    assert float((freq - q).abs().max()) < 5 * float((q * (1 - q) / n).sqrt().max())
    assert bool(inverse_cdf_consistent(lp, u, tok).all())
    moved = (tok + 1).clamp(max=v - 2)
    assert not bool(inverse_cdf_consistent(lp[:1000], u[:1000], moved[:1000]).all())
    ends = inverse_cdf(lp[:2], torch.tensor([0.0, 1.0 - 2.0**-24]))
    assert ends.tolist() == [1, v - 2]
    nan_row = row.clone()
    nan_row[[4, 30]] = float("nan")
    assert inverse_cdf(nan_row[None], torch.tensor([0.5])).item() == 4


def test_inverse_cdf_engine_gives_the_reference_logprobs():
    """FastRolloutEngine(sampler="inverse-cdf") on the CPU: every request comes back once with max_new_tokens
    tokens (EOS ignored), its recorded log-probs equal a float64 recomputation of the sampled tokens, the same seed
    gives the same tokens, and a bad sampler name is refused with the choices."""
    torch.manual_seed(0)
    model = make_model("qwen2", dtype=torch.float32)
    prompts = rand_prompts([5, 3, 8])
    engine = FastRolloutEngine(model, None, max_batch_size=8, sampler="inverse-cdf")
    assert engine._noise_width() == 1 and engine.sampler == "inverse-cdf"
    with pytest.raises(AttributeError):
        engine.sampler = "gumbel"  # the decode state's noise was allocated for the chosen sampler
    outs = engine.generate(prompts, n=2, max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    again = engine.generate(prompts, n=2, max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    assert [len(o.completions) for o in outs] == [2, 2, 2]
    for o, o2, pr in zip(outs, again, prompts):
        for c, c2 in zip(o.completions, o2.completions):
            assert len(c.token_ids) == 6 and c.token_ids == c2.token_ids
            ref = float64_logprobs(model, pr, c.token_ids, SamplingParams(1.0))
            assert float((torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max()) < 1e-4
    with pytest.raises(ValueError, match="sampler must be one of inverse-cdf, gumbel"):
        FastRolloutEngine(model, None, max_batch_size=8, sampler="multinomial")


def test_make_engine_takes_the_configured_sampler():
    """`rollout.sampler` reaches the fast engine the trainer builds (default: inverse CDF)."""
    from quarl.config import load_config
    from quarl.rl.trainer import make_engine

    model = make_model("llama")
    assert make_engine(model, None, load_config(None, ["rollout.engine=fast"]), torch.device("cpu")).sampler \
        == "inverse-cdf"
    cfg = load_config(None, ["rollout.engine=fast", "rollout.sampler=gumbel"])
    assert make_engine(model, None, cfg, torch.device("cpu")).sampler == "gumbel"


def test_column_ranges_give_every_sm_two_programs_and_no_more():
    """`choose_num_splits`: one range once batch x kv heads covers two programs per SM (more ranges only add the
    float32 partials and the merge); below that, the fewest ranges reaching two per SM, capped at one range per
    block of columns."""
    pytest.importorskip("triton")
    from quarl.kernels.decode_attention import choose_num_splits

    for sms in (1, 108, 132):
        for batch in (1, 3, 16, 64, 128, 512):
            for heads in (1, 4, 8):
                for capacity in (64, 700, 4096):
                    s = choose_num_splits(batch, heads, capacity, 64, num_sms=sms)
                    cap = -(-capacity // 64)
                    assert 1 <= s <= cap
                    if s < cap:  # not capped: two programs per SM, and one range fewer would not reach it
                        assert batch * heads * s >= 2 * sms
                        assert s == 1 or batch * heads * (s - 1) < 2 * sms, (sms, batch, heads, capacity, s)


def test_model_fingerprint_follows_every_tensor_a_reconfiguration_moves():
    """The engine's fingerprint (what decides whether captured CUDA graphs still read the model's tensors) holds the
    address of every parameter and buffer, and changes when a reconfiguration replaces a linear's buffers."""
    model = make_model("llama")
    engine = FastRolloutEngine(model, None, max_batch_size=4)
    before = engine._model_fingerprint()
    every = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    assert set(before) == every
    assert engine._model_fingerprint() == before  # nothing moved
    apply_precision(model, PrecisionConfig(flow="split", format="int8", smooth_alpha=0))  # new rollout buffers
    after = engine._model_fingerprint()
    assert after != before and set(after) == {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
