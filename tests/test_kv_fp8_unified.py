"""FP8 KV cache in the unified flow: the training forward reproduces the log-probs of rollouts that read an FP8
KV cache (the fast engine, run on the CPU here; scale 1 and per-token scales), and differs from them without the
KV rounding."""

import sys
from pathlib import Path

import pytest
import torch

from quarl.model.layers import Attention, fp8_kv_roundtrip
from quarl.model.tiny import tiny_tokenizer
from quarl.rl.batch import answer_logprobs, build_batch
from quarl.rollout.fast_engine import FastRolloutEngine

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_model, rand_prompts  # noqa: E402


def set_kv_quant(model, value):
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_quant = value


def test_fp8_roundtrip_matches_e4m3_rounding_and_saturates():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1875, 500.0, -1000.0, 3.3e-3])
    got = fp8_kv_roundtrip(x)
    # E4M3 has 3 mantissa bits: 1.0625 is a tie between 1.0 and 1.125 (to even: 1.0); 1.1875 -> 1.25 (tie, even)
    assert got.tolist()[:4] == [0.0, 1.0, 1.0, 1.25]
    assert got[4].item() == 448.0 and got[5].item() == -448.0  # saturates instead of turning into NaN
    # subnormal range: values are multiples of 2^-9, rounded to the nearest one
    assert (got[6].item() / 2 ** -9).is_integer() and abs(got[6].item() - 3.3e-3) <= 2 ** -10


@pytest.mark.parametrize("kv", ["fp8", "fp8-token"])
def test_training_forward_reproduces_fp8_kv_rollout_logprobs(kv):
    torch.manual_seed(0)
    model = make_model("qwen2", torch.float32, std=0.3)
    engine = FastRolloutEngine(model, tiny_tokenizer(), max_batch_size=8, kv_cache_dtype=kv)
    prompts = rand_prompts([5, 9, 3])
    outs = engine.generate(prompts, n=2, max_new_tokens=6, temperature=0.8, seed=1)
    rows = [(o.prompt_token_ids, c) for o in outs for c in o.completions]
    batch = build_batch([p for p, _ in rows], [c.token_ids for _, c in rows], [c.logprobs for _, c in rows],
                        [True] * len(rows), torch.zeros(len(rows)), torch.zeros(len(rows)), list(range(len(rows))),
                        pad_id=0)
    width = batch.answer_width
    mask = batch.answer_mask[:, -width:].bool()
    behaviour = batch.behaviour_logprobs[:, -width:][mask]

    def training_logprobs(kv_quant):
        set_kv_quant(model, kv_quant)
        with torch.no_grad():
            lp, _ = answer_logprobs(model, batch.input_ids, batch.attention_mask, 0.8, width,
                                    answer_lengths=batch.answer_lengths)
        return lp[mask]

    with_kv = training_logprobs(kv)
    without = training_logprobs(None)
    err_with = (with_kv - behaviour).abs().max().item()
    err_without = (without - behaviour).abs().max().item()
    assert err_with < 1e-4, err_with  # float32 kernels differ only in summation order
    assert err_without > 20 * max(err_with, 1e-6), (err_without, err_with)  # the FP8 rounding is visible


@pytest.mark.parametrize("kv", ["fp8", "fp8-token"])
def test_kv_quant_gradients_are_straight_through(kv):
    torch.manual_seed(0)
    model = make_model("llama", torch.float64)
    set_kv_quant(model, kv)
    ids = torch.tensor([rand_prompts([7])[0]])
    start = torch.tensor([3])
    out = model(ids, decode_start=start).sum()
    out.backward()
    grads = [p.grad for n, p in model.named_parameters() if "k_proj" in n or "v_proj" in n]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("kv", ["fp8", "fp8-token"])
def test_unified_flow_with_fp8_kv_cache_stays_on_policy(tmp_path, kv):
    from test_trainer import make_cfg, make_trainer, read_metrics

    # rollout.engine stays auto for fp8-token: an FP8 KV cache picks the fast engine on a CPU too
    engine = ["rollout.engine=fast"] if kv == "fp8" else []
    cfg = make_cfg(tmp_path, "precision.flow=unified", "precision.weight_only=false", f"precision.kv_cache={kv}",
                   *engine, "train.steps=1")
    trainer = make_trainer(cfg, arch="qwen2")
    assert isinstance(trainer.engine, FastRolloutEngine) and trainer.engine.kv_token_scales == (kv == "fp8-token")
    assert all(m.kv_quant == kv for m in trainer.model.modules() if isinstance(m, Attention))
    trainer.train()
    record = read_metrics(tmp_path / "run")[0]
    # rollout (FP8 weights/activations, FP8 KV cache) and training compute the same function
    assert record["mismatch/max_abs_logp_diff"] < 1e-3, record["mismatch/max_abs_logp_diff"]


def test_token_scaled_roundtrip_is_the_rowwise_fp8_format_and_does_not_saturate():
    from quarl.formats import fake_quantize

    x = torch.randn(2, 3, 5, 16) * torch.logspace(-4, 4, 5)[None, None, :, None]  # tokens of very different size
    x[0, 0, 0] = 0  # an all-zero vector: scale 1, zeros back
    got = fp8_kv_roundtrip(x, token_scales=True)
    assert torch.equal(got, fake_quantize(x, "fp8", "activation"))
    rel = ((got - x).abs() / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)).amax()
    assert rel <= 2.0**-4, rel  # E4M3 steps of 1/8 relative to each vector's own amax: half a step at most
    assert torch.equal(got[0, 0, 0], torch.zeros(16))
    assert (fp8_kv_roundtrip(x) - x).abs().amax() > 1e3  # the single-scale cache saturates the 1e4-sized tokens


@pytest.mark.parametrize("kv", ["fp8", "fp8-token"])
@pytest.mark.parametrize("padded", [False, True])
def test_prefill_attention_over_the_prefix_equals_the_full_definition(kv, padded):
    """The FP8-KV training attention runs its unrounded (prefill) part over the first max(decode_start) queries
    and keys only: its output and the gradients of q, k, v equal the definition (two full attentions, one on
    rounded K/V, selected per query) in float64 to 1e-12, with each row's own decode start (0, middle, last
    column) and with left padding."""
    from quarl.model.decoder import _build_attn_mask
    from quarl.model.tiny import tiny_config

    cfg = tiny_config("qwen2")
    attn = Attention(cfg, 0).double()
    attn.kv_quant = kv
    B, T, H, Hkv, D = 4, 13, attn.num_heads, attn.num_kv_heads, attn.head_dim
    q0, k0, v0 = (torch.randn(B, h, T, D, dtype=torch.float64) * 3 for h in (H, Hkv, Hkv))
    decode_start = torch.tensor([0, 5, 9, T - 1])
    mask = None
    if padded:
        valid = torch.ones(B, T, dtype=torch.bool)
        valid[1, :3] = False
        mask = _build_attn_mask(valid, 0, T)

    def run(fn):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        out = fn(q, k, v)
        out.pow(2).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    def definition(q, k, v):
        k_q = k + (fp8_kv_roundtrip(k, kv == "fp8-token") - k).detach()
        v_q = v + (fp8_kv_roundtrip(v, kv == "fp8-token") - v).detach()
        decoding = torch.arange(T)[None, :] >= decode_start[:, None]
        return torch.where(decoding[:, None, :, None], attn._sdpa(q, k_q, v_q, mask), attn._sdpa(q, k, v, mask))

    got = run(lambda q, k, v: attn._fp8_kv_attention(q, k, v, mask, decode_start))
    want = run(definition)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
