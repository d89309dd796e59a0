"""FastRolloutEngine on a CUDA GPU: CUDA graphs, the Triton decode attention, bf16, continuous batching.

Tolerances and their reasons:
- Triton decode attention vs a float64 computation on the same (bf16 / FP8) cache values: relative error 1e-2
  (bf16 operands; float32 accumulation).
- Greedy tokens vs the reference engine in bf16: the two engines round differently (other kernels, batch
  shapes), so a greedy choice may flip where the top two logits are nearly tied. A divergence is accepted only at
  such a near-tie: top-1 minus top-2 logit of the float64 forward below 0.1 x the logits' standard deviation;
  after it the sequences are not compared. At least half of all tokens must be compared.
- Behaviour log-probs (bf16) vs the float64 forward: mean absolute error at most 2x the reference engine's own
  mean error + 1e-3 on the same tokens.
"""

import copy

import pytest
import torch

from quarl.model.precision_apply import apply_precision
from quarl.precision import PrecisionConfig
from quarl.rollout.engine import RolloutEngine
from quarl.rollout.fast_attention import FP8_KV_DTYPE, decode_attention_torch
from quarl.rollout.fast_engine import FastRolloutEngine
from tiny_models import make_model, small_qwen2

pytestmark = pytest.mark.gpu
DEV = "cuda"


def tiny_model(arch="qwen2", std=0.25):
    return make_model(arch, torch.bfloat16, std).to(DEV)


def small_model():
    """Qwen2-style, 4 layers, hidden 512, GQA 8:2, head_dim 64, vocab 32000; lm_head std 0.15 -> logits std ~3."""
    return small_qwen2(32000, 4, DEV)


def rand_prompts(lengths, vocab=256):
    return [torch.randint(0, vocab, (n,)).tolist() for n in lengths]


def float64_logits(model64, prompt, completion):
    ids = torch.tensor([prompt + completion], device=DEV)
    with torch.no_grad():
        return model64(ids)[0, len(prompt) - 1:-1]  # [len(completion), V]: logits that chose each token


def compare_greedy(model, ref_outs, fast_outs, prompts):
    """Near-tie-tolerant greedy comparison (module docstring); returns (compared tokens, total tokens)."""
    model64 = copy.deepcopy(model).double()
    model64.set_rollout(True)  # quantized models: the rollout weights are what both engines sample from
    compared = total = 0
    ref_err, fast_err = [], []
    for p, r, f in zip(prompts, ref_outs, fast_outs):
        assert len(r.completions) == len(f.completions)
        for a, b in zip(r.completions, f.completions):
            total += len(a.token_ids)
            n = 0
            while n < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[n] == b.token_ids[n]:
                n += 1
            logits = float64_logits(model64, p, a.token_ids)
            if n < len(a.token_ids) and n < len(b.token_ids):
                top2 = logits[n].topk(2).values
                margin = float(top2[0] - top2[1])
                assert margin < 0.1 * float(logits[n].std()), (
                    f"greedy tokens differ at step {n} where the float64 margin {margin:.3f} is no near-tie")
            elif n < max(len(a.token_ids), len(b.token_ids)):
                raise AssertionError(f"one engine stopped early at step {n}: {a.finish_reason} / {b.finish_reason}")
            compared += n
            lp64 = torch.log_softmax(logits[:n], -1).gather(1, torch.tensor(a.token_ids[:n], device=DEV)[:, None])
            lp64 = lp64.squeeze(1).cpu()
            ref_err.append((torch.tensor(a.logprobs[:n], dtype=torch.float64) - lp64).abs())
            fast_err.append((torch.tensor(b.logprobs[:n], dtype=torch.float64) - lp64).abs())
    ref_mean, fast_mean = torch.cat(ref_err).mean(), torch.cat(fast_err).mean()
    assert fast_mean <= 2 * ref_mean + 1e-3, (float(fast_mean), float(ref_mean))
    assert compared >= total / 2, (compared, total)
    return compared, total


# kv_scale -1 stands for per-token scales (a token-scaled FP8 cache).
ATTENTION_CASES = [(28, 4, 128, torch.bfloat16, 1.0), (8, 2, 64, torch.bfloat16, 1.0), (4, 2, 24, torch.bfloat16, 1.0),
                   *(pytest.param(*case, marks=pytest.mark.fp8) for case in [
                       (28, 4, 128, FP8_KV_DTYPE, 1.0), (8, 2, 64, FP8_KV_DTYPE, 0.037),
                       (28, 4, 128, FP8_KV_DTYPE, -1.0)])]


@pytest.mark.parametrize("hq,hkv,d,kv_dtype,kv_scale", ATTENTION_CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_attention_matches_float64(hq, hkv, d, kv_dtype, kv_scale, splits):
    from quarl.kernels.decode_attention import decode_attention

    B, C = 6, 700
    q = torch.randn(B, hq, d, device=DEV).bfloat16()
    k = (torch.randn(B + 2, hkv, C, d, device=DEV) / abs(kv_scale)).to(kv_dtype)
    v = (torch.randn(B + 2, hkv, C, d, device=DEV) / abs(kv_scale)).to(kv_dtype)
    lengths = torch.tensor([1, 2, 65, 300, 699, 700], device=DEV)
    scales = {}
    if kv_scale < 0:  # per-token scales over eight orders of magnitude, in both caches
        scales = {n: torch.exp(torch.randn(B + 2, hkv, C, device=DEV) * 3) * 1e-2 for n in ("k_scales", "v_scales")}
        kv_scale = 1.0
    out = decode_attention(q, k, v, lengths, splits, kv_scale=kv_scale, **scales)
    ref = decode_attention_torch(q.double(), k, v, lengths, C, kv_scale, scales.get("k_scales"),
                                 scales.get("v_scales"))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("which", ["tiny-qwen2", "tiny-qwen3", "small"])
def test_greedy_matches_reference_engine_bf16(which):
    torch.manual_seed(0)
    model = small_model() if which == "small" else tiny_model(which.split("-")[1])
    vocab = model.config.vocab_size
    prompts = rand_prompts([5, 17, 1, 9, 30, 4], vocab=min(vocab, 256) if which != "small" else vocab)
    ref = RolloutEngine(model, None).generate(prompts, n=2, max_new_tokens=24, temperature=0)
    engine = FastRolloutEngine(model, None, max_batch_size=8, sync_every=4)
    fast = engine.generate(prompts, n=2, max_new_tokens=24, temperature=0)
    assert engine.last_stats["cuda_graphs"] and engine.last_stats["attention"] == "triton", engine.last_stats
    assert "graph_error" not in engine.last_stats
    compared, total = compare_greedy(model, ref, fast, prompts)
    print(f"{which}: {compared}/{total} tokens compared")


@pytest.mark.parametrize("sampler,top_p", [("gumbel", 0.95), ("inverse-cdf", 1.0), ("inverse-cdf", 0.95)])
def test_cuda_graphs_equal_eager_and_every_request_returns_once(sampler, top_p):
    """Sampling with EOS on ~10% of the vocabulary: ragged finishes, refills, compaction into smaller buckets
    (lazy captures). Graph replay runs the eager engine's kernels on the same noise, so for the same seed the
    completions agree; a library may pick another GEMM algorithm under capture (bf16 rounding, which can flip a
    near-tied draw), so >= 90% of completions must be identical (a capture or state bug garbles nearly all).
    Both samplers; inverse CDF with top-p takes the torch path, without it the kernel."""
    torch.manual_seed(1)
    model = tiny_model("llama")
    model.config.eos_token_ids = list(range(0, 320, 10))
    prompts = rand_prompts([3, 6, 2, 8, 5, 4, 7, 1, 9, 3, 6, 12, 2])
    counted = []
    graphs = FastRolloutEngine(model, None, max_batch_size=16, sync_every=3, sampler=sampler)
    outs = graphs.generate(prompts, n=4, max_new_tokens=40, temperature=1.0, top_p=top_p, seed=7,
                           progress=counted.append)
    eager = FastRolloutEngine(model, None, max_batch_size=16, sync_every=3, use_cuda_graphs=False, sampler=sampler)
    outs_eager = eager.generate(prompts, n=4, max_new_tokens=40, temperature=1.0, top_p=top_p, seed=7)
    assert graphs.last_stats["graph_captures"] >= 2 and graphs.last_stats["slot_moves"] > 0, graphs.last_stats
    eos = set(model.config.eos_token_ids)
    total = same = 0
    assert [o.prompt_token_ids for o in outs] == prompts
    for o, oe in zip(outs, outs_eager):
        assert len(o.completions) == 4
        for c, ce in zip(o.completions, oe.completions):
            total += len(c.token_ids)
            if c.token_ids == ce.token_ids:
                same += 1
                torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ce.logprobs), atol=2e-2, rtol=0)
            assert (c.token_ids[-1] in eos) == (c.finish_reason == "eos")
            assert all(t not in eos for t in c.token_ids[:-1])
            assert c.finish_reason == "eos" or len(c.token_ids) == 40
    assert same >= 0.9 * 4 * len(prompts), f"only {same} of {4 * len(prompts)} completions equal the eager run"
    assert sum(counted) == total
    # a second call reuses the captured graphs
    graphs.generate(prompts[:4], n=4, max_new_tokens=10, temperature=1.0, seed=8)


def test_quantized_split_flow_matches_reference_engine():
    torch.manual_seed(2)
    model = small_model()
    apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    prompts = rand_prompts([8, 20, 3, 11], vocab=model.config.vocab_size)
    ref = RolloutEngine(model, None).generate(prompts, n=2, max_new_tokens=16, temperature=0)
    engine = FastRolloutEngine(model, None, max_batch_size=8)
    fast = engine.generate(prompts, n=2, max_new_tokens=16, temperature=0)
    assert engine.last_stats["cuda_graphs"] and "graph_error" not in engine.last_stats
    compare_greedy(model, ref, fast, prompts)


@pytest.mark.fp8
@pytest.mark.parametrize("kv", ["fp8", "fp8-token"])
def test_fp8_kv_cache_close_to_bf16_cache(kv):
    torch.manual_seed(3)
    model = small_model()
    prompts = rand_prompts([8, 20, 3, 11], vocab=model.config.vocab_size)
    bf16 = FastRolloutEngine(model, None, max_batch_size=8).generate(prompts, n=2, max_new_tokens=16, temperature=0)
    engine = FastRolloutEngine(model, None, max_batch_size=8, kv_cache_dtype=kv)
    fp8 = engine.generate(prompts, n=2, max_new_tokens=16, temperature=0)
    expected = "float8_e4m3fn" if kv == "fp8" else kv
    assert engine.last_stats["attention"] == "triton" and engine.last_stats["kv_cache"] == expected
    # compare the first token's log-prob (same context in both): FP8 keys/values move it a little
    a = torch.tensor([o.completions[0].logprobs[0] for o in bf16])
    b = torch.tensor([o.completions[0].logprobs[0] for o in fp8])
    assert torch.isfinite(b).all() and (a - b).abs().max() < 0.5


@pytest.mark.parametrize("kv_dtype,kv_scale,token", [
    (torch.bfloat16, 1.0, False),
    *(pytest.param(FP8_KV_DTYPE, scale, token, marks=pytest.mark.fp8) for scale, token in
      [(1.0, False), (0.037, False), (1.0, True)])])
def test_one_launch_kv_write_stores_what_the_torch_write_stores(kv_dtype, kv_scale, token):
    from quarl.kernels.kv_write import write_kv
    from quarl.rollout.fast_cache import SlotKVCache

    B, H, C, D = 9, 4, 50, 128
    cache = SlotKVCache(1, 12, H, D, C, kv_dtype, DEV, kv_scale, token_scales=token)
    k = (torch.randn(B, H, 1, D, device=DEV) * 300).bfloat16()[:, :, 0]  # some values beyond +-448: saturate
    v = torch.randn(B, H, D, device=DEV).bfloat16()
    v[0, 0] = 0  # an all-zero vector (token scales: scale 1)
    positions = torch.randperm(C, device=DEV)[:B]
    write_kv(k, v, cache.keys[0], cache.values[0], positions, kv_scale, *cache.scales(0))
    rows = torch.arange(B, device=DEV)
    for got, x in ((cache.keys[0], k), (cache.values[0], v)):
        ref = torch.zeros_like(got)
        ref[rows, :, positions] = cache.quantize_tokens(x)[0] if token else cache.to_storage(x)
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    if token:
        for got, x in ((cache.key_scales[0], k), (cache.value_scales[0], v)):
            assert torch.equal(got[rows, :, positions], cache.quantize_tokens(x)[1])
    assert cache.keys[0].float().abs().amax() > 0


@pytest.mark.fp8
def test_a_failing_kv_write_kernel_leaves_the_torch_write_in_charge(monkeypatch):
    import quarl.fallbacks as fallbacks
    import quarl.kernels.kv_write as kv_write
    from quarl.rollout.fast_cache import SlotKVCache

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(kv_write, "write_kv", broken)
    monkeypatch.setattr(fallbacks, "_reported", {})  # reported once per process: start afresh
    cache = SlotKVCache(1, 4, 2, 64, 8, FP8_KV_DTYPE, DEV, token_scales=True)
    k, v = torch.randn(3, 2, 64, device=DEV).bfloat16(), torch.randn(3, 2, 64, device=DEV).bfloat16()
    positions = torch.tensor([0, 5, 7], device=DEV)
    with pytest.warns(UserWarning, match="KV write: failed its check"):
        cache.write_tokens(0, positions, k, v)
    assert cache._fused_write is False
    codes, scales = cache.quantize_tokens(k)
    rows = torch.arange(3, device=DEV)
    assert torch.equal(cache.keys[0][rows, :, positions].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(cache.key_scales[0][rows, :, positions], scales)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_second_generate_reuses_the_captured_graphs(precision):
    """Graphs captured by one generate serve the next one with the same shapes: nothing in between (the prefill,
    the fused-weight bookkeeping) may drop them."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    torch.manual_seed(0)
    model = tiny_model("qwen2")
    if precision != "bf16":
        apply_precision(model, PrecisionConfig(flow="split", format=precision))
    engine = FastRolloutEngine(model, None, max_batch_size=8, sync_every=4)
    prompts = rand_prompts([5, 9, 3, 7])
    engine.generate(prompts, n=2, max_new_tokens=12, temperature=1.0, seed=1, ignore_eos=True)
    assert engine.last_stats["graph_captures"] > 0
    engine.generate(prompts, n=2, max_new_tokens=12, temperature=1.0, seed=2, ignore_eos=True)
    assert engine.last_stats["graph_captures"] == 0, engine.last_stats


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_graphs_survive_cache_regrowth_without_a_fallback(monkeypatch, fmt):
    """Each growth of the slot cache drops every captured graph; the captures after it must succeed (a graph
    pool whose graphs are all gone cannot take new captures) and nothing may fall back to eager decoding."""
    import quarl.fallbacks as fallbacks

    monkeypatch.setattr(fallbacks, "_reported", {})
    model = tiny_model()
    if fmt:
        apply_precision(model, PrecisionConfig(flow="split", format=fmt).validate())
    engine = FastRolloutEngine(model, None, max_batch_size=8, sync_every=4)
    drops = 0
    for max_new in (8, 60, 8, 160, 40):  # the tiny model's context is 256
        engine.generate(rand_prompts([5, 7]), n=2, max_new_tokens=max_new, temperature=1.0, seed=0,
                        ignore_eos=True)
        assert engine.use_cuda_graphs and "graph_error" not in engine.last_stats, engine.last_stats
        drops += engine.last_stats["graph_drops"]
    assert drops >= 2  # the two growths (60, 160 new tokens) dropped the graphs captured before them
    assert fallbacks.reported_fallbacks() == {}
