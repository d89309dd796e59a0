"""PPO with a critic: GAE against the closed form A_k = Σ_l (γλ)^l δ_{k+l} in float64, and the clipped value
loss against its formula."""

import math

import pytest
import torch

from quarl.rl.advantages import gae_advantages, token_rewards
from quarl.rl.critic import ValueHead, explained_variance, value_loss


def _gae_closed_form(r, v, mask, gamma, lam):
    """Per answer, over its counted tokens in order: δ_k with V after the last = 0, then the discounted sum."""
    adv = torch.zeros_like(r)
    for b in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if mask[b, t]]
        vals = [v[b, t].item() for t in idx] + [0.0]
        delta = [r[b, t].item() + gamma * vals[k + 1] - vals[k] for k, t in enumerate(idx)]
        for k, t in enumerate(idx):
            adv[b, t] = sum((gamma * lam) ** l * delta[k + l] for l in range(len(idx) - k))
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_closed_form(gamma, lam):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    r = torch.randn(5, 11, generator=g, dtype=torch.float64)
    v = torch.randn(5, 11, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 11, generator=g) > 0.3  # holes inside answers: the recursion must skip them
    mask[0] = False
    want = _gae_closed_form(r, v, mask, gamma, lam)
    adv, ret = gae_advantages(r, v, mask, gamma, lam, whiten=False)
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(mask, want + v, torch.zeros_like(v)), rtol=1e-12, atol=1e-12)
    white, _ = gae_advantages(r, v, mask, gamma, lam, whiten=True)
    sel = want[mask]
    torch.testing.assert_close(white[mask], (sel - sel.mean()) / (sel.std(unbiased=False) + 1e-6))
    assert white[~mask].abs().max() == 0


def test_gae_outcome_reward_lambda_one_is_reward_minus_value():
    # γ = λ = 1, reward only on the last token: A_t = R − V_t (Monte Carlo)
    v = torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64)
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), 1.0, 1.0, whiten=False)
    torch.testing.assert_close(adv, 1.0 - v)
    torch.testing.assert_close(ret, torch.ones_like(v))
    with pytest.raises(ValueError, match="lam"):
        gae_advantages(r, v, torch.ones(1, 3), 1.0, 1.5)


def test_value_loss_matches_formula_and_clips():
    g = torch.Generator().manual_seed(2)
    old = torch.randn(4, 6, generator=g, dtype=torch.float64)
    v = (old + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.5).requires_grad_(True)
    ret = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.2
    loss, met = value_loss(v, old, ret, mask, clip_range=0.2)
    vc = old + torch.clamp(v.detach() - old, -0.2, 0.2)
    per = 0.5 * torch.maximum((v.detach() - ret) ** 2, (vc - ret) ** 2)
    torch.testing.assert_close(loss.detach(), per[mask].mean(), rtol=1e-12, atol=0)
    assert 0 < met["critic/vf_clipfrac"] < 1
    loss.backward()
    # where the clipped error wins and V left the band, the gradient is zero
    frozen = ((vc - ret) ** 2 > (v.detach() - ret) ** 2) & ((v.detach() - old).abs() > 0.2) & mask
    assert frozen.any() and v.grad[frozen].abs().max() == 0
    unclipped, _ = value_loss(v, old, ret, mask, clip_range=None)
    assert unclipped.item() < loss.item()
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(v, old, ret, mask, clip_range=0.0)


def test_value_head_shapes():
    head = ValueHead(8)
    out = head(torch.randn(2, 5, 8, dtype=torch.bfloat16))
    assert out.shape == (2, 5) and out.dtype == torch.float32 and out.abs().max() == 0
    with pytest.raises(ValueError, match=r"\[B, T, 8\]"):
        head(torch.randn(2, 8))


def test_token_rewards_sit_on_the_last_counted_token():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    mask = torch.rand(6, 9, generator=g) > 0.4
    mask[2] = False  # an answer with no counted token receives nothing
    rewards = torch.randn(6, generator=g, dtype=torch.float64)
    got = token_rewards(rewards, mask)
    want = torch.zeros(6, 9, dtype=torch.float64)
    for b in range(6):
        counted = [t for t in range(9) if mask[b, t]]
        if counted:
            want[b, counted[-1]] = rewards[b]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"rewards must be \[B\]"):
        token_rewards(rewards[:5], mask)


def test_explained_variance_matches_its_formula():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    ret = torch.randn(4, 7, generator=g, dtype=torch.float64)
    val = ret + 0.3 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 7, generator=g) > 0.3
    r, v = ret[mask].numpy(), val[mask].numpy()
    assert explained_variance(ret, val, mask) == pytest.approx(1 - (r - v).var() / r.var(), rel=1e-12)
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert math.isnan(explained_variance(torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3)))
