"""Batch invariance on a GPU in bf16: the kernels (`quarl.kernels.batch_invariant`) give a row the same bits in any
batch, and a batch-invariant model's fast-engine rollout and training forward give the same log-probs.

Tolerances: kernels against float64, four bf16 spacings (2^-8 relative) of the output's magnitude (float32 sums,
one rounding to bf16; attention rounds its probabilities to bf16 before the second product, as flash attention
does: 2^-6). Rollout against training log-probs: both come from the same bf16 logits, through two float32
log-softmax kernels that sum the vocabulary in different orders: 1e-4 (without batch invariance the unified flow's
log-probs differ by more than twice that on the same tokens, as the control asserts).
"""

import math

import pytest
import torch

from quarl.kernels import batch_invariant as bi
from quarl.model.precision_apply import apply_precision
from quarl.precision import LoraConfig, PrecisionConfig
from quarl.rollout.fast_engine import FastRolloutEngine
from tiny_models import make_model, rollout_vs_training

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
# SmolLM2-135M's layer shapes (9 heads of 64, 3 KV heads, MLP 1536), two layers
SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64, num_layers=2)


@pytest.mark.parametrize("n,k", [(576, 576), (1536, 576), (576, 1536), (192, 576), (49152, 576)])
def test_linear_rows_are_alike_in_every_batch(n, k):
    x = torch.randn(4096, k, device=DEV).to(BF16)
    w = (torch.randn(n, k, device=DEV) / math.sqrt(k)).to(BF16)
    bias = torch.randn(n, device=DEV).to(BF16)
    full = bi.linear(x, w, bias)
    exact = x.double() @ w.double().t() + bias.double()
    assert float((full.double() - exact).abs().max()) <= 4 * 2.0**-8 * float(exact.abs().max())
    for m in (1, 2, 7, 64, 130, 1000):
        rows = torch.randint(0, 4096 - m + 1, (1,)).item()
        assert torch.equal(bi.linear(x[rows:rows + m], w, bias), full[rows:rows + m]), (n, k, m)


def test_rms_norm_rows_are_alike_in_every_batch():
    x = torch.randn(3000, 576, device=DEV).to(BF16)
    w = (1 + 0.3 * torch.randn(576, device=DEV)).to(BF16)
    full = bi.rms_norm(x, w, 1e-5)
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert float((full.double() - exact).abs().max()) <= 4 * 2.0**-8 * float(exact.abs().max())
    for m in (1, 5, 64, 700):
        assert torch.equal(bi.rms_norm(x[:m], w, 1e-5), full[:m]), m


def test_attention_decode_step_matches_the_training_row():
    """Queries of a left-padded batch (rows of 300, 129 and 7 tokens) against the same queries fed one at a time
    over a slot cache of many rows, as the engine's decode steps feed them."""
    B, Hq, Hkv, T, D = 3, 9, 3, 300, 64
    lens = torch.tensor([300, 129, 7], device=DEV)
    q, k, v = (torch.randn(B, h, T, D, device=DEV).to(BF16) for h in (Hq, Hkv, Hkv))
    first, zeros, S = T - lens, torch.zeros(B, dtype=torch.long, device=DEV), torch.full((B,), T, device=DEV)
    out = bi.attention(q, k, v, first, zeros, S)
    mask = bi.visible_keys(first, zeros, S, T, T)
    s = (q.double() @ k.double().repeat_interleave(3, 1).transpose(-1, -2)) / 8.0
    exact = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0) @ v.double().repeat_interleave(3, 1)
    real = (torch.arange(T, device=DEV)[None, :] >= first[:, None])[:, None, :, None]
    assert float(((out.double() - exact) * real).abs().max()) <= 4 * 2.0**-6 * float(exact.abs().max())
    slots = 5  # a slot cache: row b at slot b + 1, from column 0, with garbage past its length
    cache_k = torch.randn(slots, Hkv, T + 64, D, device=DEV).to(BF16)
    cache_v = torch.randn(slots, Hkv, T + 64, D, device=DEV).to(BF16)
    for b in range(B):
        n, start = int(lens[b]), int(first[b])
        cache_k[b + 1, :, :n], cache_v[b + 1, :, :n] = k[b, :, start:], v[b, :, start:]
    for c in range(0, 300, 7):
        live = [b for b in range(B) if c < int(lens[b])]
        qs = torch.stack([q[b, :, int(first[b]) + c] for b in live])  # [rows, Hq, D]
        idx = torch.tensor([b + 1 for b in live], device=DEV)
        got = bi.attention(qs[:, :, None], cache_k[idx], cache_v[idx], torch.zeros_like(idx),
                           torch.full_like(idx, c), torch.full_like(idx, c + 1))[:, :, 0]
        want = torch.stack([out[b, :, int(first[b]) + c] for b in live])
        assert torch.equal(got, want), c


def _rollout_vs_training(model) -> float:
    """Max |behaviour log-prob - training log-prob| over sampled answers of ragged prompts."""
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 17, 70, 9)]
    return rollout_vs_training(FastRolloutEngine(model, None, max_batch_size=32), prompts, 4, 40)


@pytest.mark.parametrize("flow,fmt,lora", [("bf16", None, 0), ("unified", "fp8-block", 0), ("unified", "int8", 0),
                                           ("qlora", "nvfp4", 8), ("bf16", None, 8)])
def test_rollout_and_training_log_probs_agree_on_smollm2_shapes(flow, fmt, lora):
    torch.manual_seed(1)
    model = make_model("llama", std=0.05, **SMOLLM2_SHAPES).to(DEV, BF16)
    # the unified model first runs off the invariant kernels, as the control; W8A8 (at this hidden size its default
    # is weight-only, which the bf16 rows cover)
    precision = PrecisionConfig(flow=flow, format=fmt, batch_invariant=flow != "unified", lora=LoraConfig(rank=lora),
                                weight_only=False if flow == "unified" else None)
    apply_precision(model, precision)
    assert model.batch_invariant == (flow != "unified")
    if lora:
        with torch.no_grad():  # adapters that change the function
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
    if flow == "unified":  # the control: off the invariant kernels, the same tokens score visibly apart
        assert _rollout_vs_training(model) > 2e-4
    model.set_batch_invariant(True)
    assert _rollout_vs_training(model) < 1e-4
