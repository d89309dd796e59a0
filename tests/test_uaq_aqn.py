"""UAQ keeps the network's function; AQN perturbs exactly the rollout model's targeted norms with the scheduled σ."""

import pytest
import torch

from quarl.model.decoder import QuarlForCausalLM
from quarl.model.tiny import tiny_config
from quarl.rl.aqn import aqn_sigma, noised_norms, set_aqn_noise
from quarl.rl.uaq import apply_uaq


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_uaq_preserves_function_in_float64(arch):
    model = QuarlForCausalLM(tiny_config(arch)).double()
    with torch.no_grad():  # random norm weights so the test would catch a missing fold
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 256, (2, 12))
    ref = model(ids)
    q_before = model.model.layers[0].self_attn.q_proj.weight.clone()
    o_before = model.model.layers[0].self_attn.o_proj.weight.clone()
    assert apply_uaq(model, 1.5) == 5 * len(model.model.layers)
    torch.testing.assert_close(model(ids), ref, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj.weight, q_before / 1.5)
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, o_before)  # never folded into o/down


def test_uaq_rejects_bad_scale():
    with pytest.raises(ValueError, match="> 0"):
        apply_uaq(QuarlForCausalLM(tiny_config("llama")), 0.0)


def test_aqn_schedule():
    s0, s1, K = 1e-2, 1e-4, 10
    total = 100
    assert aqn_sigma(0, total, s0, s1, K) == 0.0 and aqn_sigma(9, total, s0, s1, K) == 0.0  # stage 0
    assert aqn_sigma(10, total, s0, s1, K) == pytest.approx(s0)  # first noisy stage
    assert aqn_sigma(99, total, s0, s1, K) == pytest.approx(s1)  # last stage
    mid = [aqn_sigma(10 * k, total, s0, s1, K) for k in range(1, K)]
    ratios = [b / a for a, b in zip(mid, mid[1:])]
    assert ratios == pytest.approx([ratios[0]] * len(ratios))  # exponential decay
    assert aqn_sigma(50, total, 0.0, 0.0, K) == 0.0


def test_aqn_changes_only_rollout_norms():
    torch.manual_seed(0)
    model = QuarlForCausalLM(tiny_config("llama"))
    ids = torch.randint(0, 256, (2, 8))
    train_ref = model(ids)
    norms = noised_norms(model)
    assert len(norms) == 2 * len(model.model.layers)
    sigma = 0.05
    set_aqn_noise(model, sigma, torch.Generator().manual_seed(1))
    noise = torch.cat([n.rollout_noise.flatten() for n in norms])
    assert noise.std().item() == pytest.approx(sigma, rel=0.25)
    assert torch.equal(model.model.norm.rollout_noise, torch.zeros_like(model.model.norm.rollout_noise))
    torch.testing.assert_close(model(ids), train_ref)  # the training forward never sees the noise
    model.set_rollout(True)
    try:
        noisy = model(ids)
        eff = norms[0].effective_weight()
        torch.testing.assert_close(eff, norms[0].weight + norms[0].rollout_noise)
    finally:
        model.set_rollout(False)
    assert not torch.allclose(noisy, train_ref, atol=1e-4)
    set_aqn_noise(model, 0.0)
    assert all(n.rollout_noise.abs().sum() == 0 for n in norms)
