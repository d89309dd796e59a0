"""policy_loss: hand-derived values for every correction and aggregation, float64 references for values,
gradients and metrics on fresh random inputs, micro-batch additivity, and input validation."""

import math

import pytest
import torch

from quarl.rl.objectives import LossConfig, policy_loss

LOG = math.log


# ----------------------------------------------------------------------------------------------------------
# helpers


def _tokens(ratios, rhos, behaviour=None):
    """logprobs, proximal, behaviour [1, T] such that π_θ/π_prox = ratios and π_prox/μ = rhos."""
    t = len(ratios)
    beh = torch.full((1, t), LOG(0.25)) if behaviour is None else behaviour
    prox = beh + torch.log(torch.tensor([rhos], dtype=torch.float32))
    lp = prox + torch.log(torch.tensor([ratios], dtype=torch.float32))
    return lp.clone().requires_grad_(True), prox, beh


def _run(ratios, rhos, adv=1.0, mask=None, **cfg):
    lp, prox, beh = _tokens(ratios, rhos)
    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask
    return policy_loss(lp, prox, beh, torch.tensor([adv]), mask, LossConfig(**cfg))


def reference_loss(lp, prox, beh, adv, mask, cfg, ref=None, num_sequences=None, num_tokens=None):
    """The BRIEF §4 formulas written directly (float64, no log-space tricks, explicit loops for aggregation)."""
    cfg = cfg.validate()
    m = mask.bool()
    anchor = beh if cfg.correction in ("naive", "bypass") else prox
    a = adv[:, None].expand_as(lp) if adv.dim() == 1 else adv
    ratio = torch.exp(lp - anchor)
    rho = torch.exp(prox - beh) if prox is not None else torch.ones_like(lp)
    lo, hi, cap = 1 - cfg.epsilon_low, 1 + cfg.epsilon_high, cfg.is_cap
    upper = torch.full_like(ratio, hi)
    if cfg.correction in ("naive", "bypass"):
        w = torch.ones_like(ratio)
    elif cfg.correction == "decoupled":
        w = rho
    elif cfg.correction == "tis" and cfg.correction_level == "token":
        w = torch.clamp(rho, max=cap)
    elif cfg.correction == "tis":
        seq = torch.exp(torch.stack([torch.log(rho[b][m[b]]).sum() for b in range(lp.shape[0])]))
        w = torch.clamp(seq, max=cap)[:, None].expand_as(ratio)
    elif cfg.correction == "mis" and cfg.correction_level == "token":
        w = torch.where((rho >= cfg.mis_low) & (rho <= cfg.mis_high), rho, torch.zeros_like(rho))
    elif cfg.correction == "mis":
        seq = torch.stack([torch.prod(rho[b][m[b]]) for b in range(lp.shape[0])])  # Π ρ_t = exp Σ log ρ_t
        w = torch.where((seq >= cfg.mis_low) & (seq <= cfg.mis_high), seq, torch.zeros_like(seq))
        w = w[:, None].expand_as(ratio)
    else:  # acr
        r = torch.clamp(cap / rho, max=1.0)
        w = torch.clamp(rho, max=cap)
        upper = hi / r
    clipped = torch.minimum(torch.maximum(ratio, torch.full_like(ratio, lo)), upper)
    per = torch.maximum(-ratio * a, -clipped * a) * w.detach()
    if ref is not None and cfg.kl_coef > 0:
        per = per + cfg.kl_coef * (torch.exp(ref - lp) - (ref - lp) - 1)
    per = torch.where(m, per, torch.zeros_like(per))
    n_seq = num_sequences or lp.shape[0]
    if cfg.aggregation == "token-mean":
        return per.sum() / (num_tokens or max(int(m.sum()), 1))
    if cfg.aggregation == "seq-mean-token-mean":
        total = sum(per[b].sum() / max(int(m[b].sum()), 1) for b in range(lp.shape[0]))
        return total / n_seq
    return per.sum() / (n_seq * cfg.max_new_tokens)


def _random_batch(b=6, t=9, seed=None, dtype=torch.float64, token_adv=False, spread=0.6):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    beh = -torch.rand(b, t, generator=g, dtype=dtype) * 3 - 0.05
    prox = beh + torch.randn(b, t, generator=g, dtype=dtype) * spread  # ρ spans ~[0.2, 5]: truncation + masking
    lp = prox + torch.randn(b, t, generator=g, dtype=dtype) * 0.3  # R spans both clip sides
    ref = lp + torch.randn(b, t, generator=g, dtype=dtype) * 0.2
    adv = torch.randn((b, t) if token_adv else (b,), generator=g, dtype=dtype)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0] = False  # an overlong-masked answer
    mask[1, :3] = True
    return lp, prox, beh, adv, mask, ref


ALL_CONFIGS = [
    dict(correction="naive"), dict(correction="bypass"), dict(correction="decoupled"),
    dict(correction="tis"), dict(correction="tis", correction_level="sequence"),
    dict(correction="mis"), dict(correction="mis", correction_level="sequence", mis_low=0.5, mis_high=2.0),
    dict(correction="mis", mis_low=0.7, mis_high=1.5), dict(correction="acr"), dict(correction="acr", is_cap=1.5),
]
AGGS = [dict(loss_type="grpo"), dict(loss_type="dapo"), dict(loss_type="dr_grpo", max_new_tokens=12)]


# ----------------------------------------------------------------------------------------------------------
# hand-derived values (ε = 0.2 → clip range [0.8, 1.2]; C = 2; A = 1 unless said; GRPO per-answer mean)


def test_tis_token_truncation_by_hand():
    # R = [1.5, 0.9, 1.0], ρ = [3, 0.5, 1]: J = [min(1.5, 1.2), 0.9, 1.0] = [1.2, 0.9, 1.0];
    # w = min(ρ, 2) = [2, 0.5, 1] → loss = −(2.4 + 0.45 + 1.0)/3
    loss, met = _run([1.5, 0.9, 1.0], [3.0, 0.5, 1.0], correction="tis")
    assert loss.item() == pytest.approx(-3.85 / 3, rel=1e-6)
    assert met["is/truncated_frac"] == pytest.approx(1 / 3)
    assert met["clip/frac_high"] == pytest.approx(1 / 3) and met["clip/frac_low"] == 0.0
    assert met["is/weight_mean"] == pytest.approx(3.5 / 3, rel=1e-6)
    assert met["is/ess"] == pytest.approx(3.5**2 / (3 * (4 + 0.25 + 1)), rel=1e-6)
    assert met["is/masked_frac"] == 0.0
    assert met["policy/ratio_mean"] == pytest.approx((1.5 + 0.9 + 1.0) / 3, rel=1e-6)


def test_tis_gradient_zero_where_clipped_by_hand():
    lp, prox, beh = _tokens([1.5, 0.9, 1.0], [3.0, 0.5, 1.0])
    loss, _ = policy_loss(lp, prox, beh, torch.tensor([1.0]), torch.ones(1, 3), LossConfig(correction="tis"))
    loss.backward()
    # d/dlp of −w·R·A/3 = −w·R/3 where unclipped; 0 where the upper clip binds (token 0).
    expected = torch.tensor([[0.0, -0.5 * 0.9 / 3, -1.0 / 3]])
    torch.testing.assert_close(lp.grad, expected, rtol=1e-5, atol=1e-7)


def test_tis_sequence_by_hand():
    # Π ρ = 3·0.5·1 = 1.5 < C: every token weighted 1.5 → −1.5·(1.2 + 0.9 + 1.0)/3
    loss, met = _run([1.5, 0.9, 1.0], [3.0, 0.5, 1.0], correction="tis", correction_level="sequence")
    assert loss.item() == pytest.approx(-1.55, rel=1e-6)
    assert met["is/truncated_frac"] == 0.0
    # Π ρ = 3 > C = 2: weight 2 on every token, all truncated
    loss, met = _run([1.5, 0.9, 1.0], [3.0, 1.0, 1.0], correction="tis", correction_level="sequence")
    assert loss.item() == pytest.approx(-2 * 3.1 / 3, rel=1e-6)
    assert met["is/truncated_frac"] == 1.0 and met["is/weight_mean"] == pytest.approx(2.0)


def test_mis_token_masking_by_hand():
    # ρ = 3.5 > 3 is rejected, the others keep weight ρ: w = [0, 0.5, 1] on J = [1.2, 0.9, 1.0]
    # → −(0 + 0.45 + 1.0)/3; the rejected token stays in the denominator.
    loss, met = _run([1.5, 0.9, 1.0], [3.5, 0.5, 1.0], correction="mis")
    assert loss.item() == pytest.approx(-1.45 / 3, rel=1e-6)
    assert met["is/masked_frac"] == pytest.approx(1 / 3)
    assert met["is/weight_mean"] == pytest.approx(1.5 / 3, rel=1e-6)
    assert met["is/ess"] == pytest.approx(1.5**2 / (3 * (0.25 + 1.0)), rel=1e-6)
    assert met["is/truncated_frac"] == 0.0
    # with mis_low = 0.6 the ρ = 0.5 token goes too; the bounds are inclusive (ρ = 1 kept with mis_high = 1)
    loss, met = _run([1.5, 0.9, 1.0], [3.5, 0.5, 1.0], correction="mis", mis_low=0.6, mis_high=1.0)
    assert loss.item() == pytest.approx(-1.0 / 3, rel=1e-6)
    assert met["is/masked_frac"] == pytest.approx(2 / 3)


def test_mis_accepted_tokens_keep_weight_rho_not_one():
    # Regression: MIS used to give accepted tokens weight 1. Unclipped tokens (R = 1, A = 1) have gradient
    # d/dlp (−w·R·A/3) = −w/3 with w = ρ for the accepted ones (0.5, 2.5) and 0 for the rejected one (ρ = 3.5).
    lp, prox, beh = _tokens([1.0, 1.0, 1.0], [0.5, 2.5, 3.5])
    loss, met = policy_loss(lp, prox, beh, torch.tensor([1.0]), torch.ones(1, 3), LossConfig(correction="mis"))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5 / 3, -2.5 / 3, 0.0]]), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(lp.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0]]), rtol=1e-2)  # the old weight-1 result
    assert loss.item() == pytest.approx(-3.0 / 3, rel=1e-6)
    assert met["is/weight_mean"] == pytest.approx(3.0 / 3, rel=1e-6)
    # sequence level: Π ρ = 0.5·2.5·1 = 1.25 ∈ [0, 3] weights every token 1.25 (not 1)
    lp, prox, beh = _tokens([1.0, 1.0, 1.0], [0.5, 2.5, 1.0])
    loss, met = policy_loss(lp, prox, beh, torch.tensor([1.0]), torch.ones(1, 3),
                            LossConfig(correction="mis", correction_level="sequence"))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.full((1, 3), -1.25 / 3), rtol=1e-5, atol=1e-7)
    assert met["is/weight_mean"] == pytest.approx(1.25, rel=1e-6) and met["is/ess"] == pytest.approx(1.0)


def test_mis_sequence_by_hand():
    # Π ρ = 1.75 ∈ [0, 3]: nothing rejected, every token weighted 1.75: −1.75·(1.2 + 0.9 + 1.0)/3
    loss, met = _run([1.5, 0.9, 1.0], [3.5, 0.5, 1.0], correction="mis", correction_level="sequence")
    assert loss.item() == pytest.approx(-1.75 * 3.1 / 3, rel=1e-6)
    assert met["is/masked_frac"] == 0.0 and met["is/weight_mean"] == pytest.approx(1.75, rel=1e-6)
    # Π ρ = 3.5 > 3: the whole answer rejected
    loss, met = _run([1.5, 0.9, 1.0], [3.5, 1.0, 1.0], correction="mis", correction_level="sequence")
    assert loss.item() == 0.0 and met["is/masked_frac"] == 1.0 and met["is/ess"] == 0.0


def test_decoupled_by_hand():
    # untruncated ρ = [3, 0.5, 1] on J = [1.2, 0.9, 1.0]
    loss, met = _run([1.5, 0.9, 1.0], [3.0, 0.5, 1.0], correction="decoupled")
    assert loss.item() == pytest.approx(-(3.6 + 0.45 + 1.0) / 3, rel=1e-6)
    assert met["is/truncated_frac"] == 0.0 and met["is/weight_mean"] == pytest.approx(4.5 / 3, rel=1e-6)


def test_acr_widens_upper_bound_by_hand():
    # token 0: ρ = 3 > C = 2 → r = 2/3, upper = 1.2 / (2/3) = 1.8, so R = 1.5 is NOT clipped: J = 1.5, w = 2.
    # token 1: R = 2.0 with ρ = 3 → clipped at 1.8, w = 2.   token 2: ρ = 0.5 ≤ C → plain TIS: 0.5·0.9.
    loss, met = _run([1.5, 2.0, 0.9], [3.0, 3.0, 0.5], correction="acr")
    assert loss.item() == pytest.approx(-(2 * 1.5 + 2 * 1.8 + 0.45) / 3, rel=1e-6)
    assert met["clip/frac_high"] == pytest.approx(1 / 3)  # only the R = 2.0 token
    assert met["is/truncated_frac"] == pytest.approx(2 / 3)
    # the same tokens under TIS clip both high-ratio tokens at 1.2
    loss_tis, met_tis = _run([1.5, 2.0, 0.9], [3.0, 3.0, 0.5], correction="tis")
    assert loss_tis.item() == pytest.approx(-(2 * 1.2 + 2 * 1.2 + 0.45) / 3, rel=1e-6)
    assert met_tis["clip/frac_high"] == pytest.approx(2 / 3)


def test_acr_equals_tis_when_rho_below_cap():
    lp, prox, beh, adv, mask, _ = _random_batch(seed=3, dtype=torch.float32, spread=0.1)
    prox = torch.minimum(prox, beh + LOG(1.9))  # ρ ≤ 1.9 < C everywhere
    a, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="acr"))
    b, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tis"))
    assert a.item() == pytest.approx(b.item(), rel=1e-6, abs=1e-7)


def test_naive_and_bypass_use_behaviour_as_old_policy_by_hand():
    # R̂ = π_θ/μ = R·ρ = [4.5, 0.45, 1.0] → J = [1.2, 0.45, 1.0] (0.45 < 0.8 but A > 0: the low clip does not bind)
    for correction in ("naive", "bypass"):
        loss, met = _run([1.5, 0.9, 1.0], [3.0, 0.5, 1.0], correction=correction)
        assert loss.item() == pytest.approx(-2.65 / 3, rel=1e-6)
        assert met["is/weight_mean"] == 1.0 and met["is/ess"] == pytest.approx(1.0)
        assert met["policy/ratio_mean"] == pytest.approx((4.5 + 0.45 + 1.0) / 3, rel=1e-6)
    lp, _, beh = _tokens([1.5, 0.9, 1.0], [3.0, 0.5, 1.0])
    loss, _ = policy_loss(lp, None, beh, torch.tensor([1.0]), torch.ones(1, 3), LossConfig(correction="bypass"))
    assert loss.item() == pytest.approx(-2.65 / 3, rel=1e-6)


def test_negative_advantage_low_clip_by_hand():
    # A = −1, R = [0.5, 1.5, 1.0]: min(−0.5, −0.8) = −0.8 (low clip binds), min(−1.5, −1.2) = −1.5 (unclipped)
    loss, met = _run([0.5, 1.5, 1.0], [1.0, 1.0, 1.0], adv=-1.0, correction="tis")
    assert loss.item() == pytest.approx((0.8 + 1.5 + 1.0) / 3, rel=1e-6)
    assert met["clip/frac_low"] == pytest.approx(1 / 3) and met["clip/frac_high"] == 0.0


def test_dapo_clip_higher_by_hand():
    # DAPO: ε_high = 0.28 → R = 1.25 unclipped, R = 1.3 clipped at 1.28; token-mean over 2 tokens
    loss, met = _run([1.25, 1.3], [1.0, 1.0], loss_type="dapo")
    assert loss.item() == pytest.approx(-(1.25 + 1.28) / 2, rel=1e-6)
    assert met["clip/frac_high"] == pytest.approx(0.5)


def _aggregation_batch():
    # naive with R = 1 (logprobs = behaviour): per-token loss = −A.
    # answers: [−2 | · ·], [−3, −3, −3], [· · ·] (overlong-masked); masked slots hold garbage on purpose.
    beh = torch.full((3, 3), -1.0)
    lp = beh.clone()
    lp[0, 1:] = float("nan")
    lp[2] = float("inf")
    adv = torch.tensor([[2.0, 1e30, 1e30], [3.0, 3.0, 3.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
    return lp.requires_grad_(True), beh, adv, mask


@pytest.mark.parametrize("cfg,expected", [
    (dict(loss_type="grpo"), (-2 - 3 + 0) / 3),  # mean over answers of per-answer token means
    (dict(loss_type="dapo"), (-2 - 9) / 4),  # sum / counted tokens
    (dict(loss_type="dr_grpo", max_new_tokens=5), (-2 - 9) / (3 * 5)),  # sum / (answers × max_new_tokens)
    (dict(loss_type="grpo", aggregation="token-mean"), (-2 - 9) / 4),  # explicit override
])
def test_aggregations_by_hand(cfg, expected):
    lp, beh, adv, mask = _aggregation_batch()
    loss, _ = policy_loss(lp, None, beh, adv, mask, LossConfig(correction="naive", **cfg))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[mask == 0] == 0).all()


def test_kl_to_reference_by_hand():
    # A = 0 leaves only β·k3; ref − θ = ln 2 → k3 = 2 − ln 2 − 1; ref = θ → 0. Mean over 2 tokens, β = 0.1.
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = lp.detach() + torch.tensor([[LOG(2.0), 0.0]])
    k3 = 1 - LOG(2.0)
    loss, met = policy_loss(lp, lp.detach(), lp.detach(), torch.zeros(1), torch.ones(1, 2),
                            LossConfig(kl_coef=0.1), reference_logprobs=ref)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, rel=1e-6)
    assert met["policy/kl_ref"] == pytest.approx(k3 / 2, rel=1e-6)
    loss.backward()  # d k3/dθ = 1 − exp(ref − θ)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.1 * (1 - 2.0) / 2, 0.0]]), rtol=1e-5, atol=1e-8)
    # a reference without kl_coef is only reported
    loss0, met0 = policy_loss(lp, lp.detach(), lp.detach(), torch.zeros(1), torch.ones(1, 2), LossConfig(),
                              reference_logprobs=ref)
    assert loss0.item() == 0.0 and met0["policy/kl_ref"] == pytest.approx(k3 / 2, rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# float64 references on fresh random inputs


@pytest.mark.parametrize("agg", AGGS, ids=lambda c: c["loss_type"])
@pytest.mark.parametrize("corr", ALL_CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("token_adv", [False, True], ids=["adv[B]", "adv[B,T]"])
def test_matches_float64_reference_values_and_gradients(corr, agg, token_adv):
    lp64, prox, beh, adv, mask, ref = _random_batch(token_adv=token_adv)
    cfg = LossConfig(kl_coef=0.05, **corr, **agg)
    # reference: float64 autograd of the formula
    lp_ref = lp64.clone().requires_grad_(True)
    want = reference_loss(lp_ref, prox, beh, adv, mask, cfg, ref=ref)
    want.backward()
    # implementation in float64: same numbers to rounding
    lp_a = lp64.clone().requires_grad_(True)
    got64, _ = policy_loss(lp_a, prox, beh, adv, mask, cfg, reference_logprobs=ref)
    got64.backward()
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_ref.grad, rtol=1e-10, atol=1e-12)
    # implementation in float32 (the training dtype): float32 rounding tolerance
    lp_b = lp64.float().requires_grad_(True)
    got32, _ = policy_loss(lp_b, prox.float(), beh.float(), adv.float(), mask, cfg, reference_logprobs=ref.float())
    got32.backward()
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want.detach(), rtol=2e-5, atol=2e-6)
    # (a float32 ratio landing on the other side of a clip boundary than its float64 twin would need a ratio
    # within ~1e-7 of a boundary: negligible for continuous random inputs)
    torch.testing.assert_close(lp_b.grad.double(), lp_ref.grad, rtol=2e-4, atol=2e-6)


def test_metrics_match_float64_reference():
    lp, prox, beh, adv, mask, ref = _random_batch(b=16, t=20)
    m = mask
    cap, lo, hi = 2.0, 0.8, 1.2
    ratio = torch.exp(lp - prox)
    rho = torch.exp(prox - beh)
    a = adv[:, None].expand_as(lp)
    _, met = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tis"), reference_logprobs=ref)
    w = torch.clamp(rho, max=cap)[m]
    assert met["is/weight_mean"] == pytest.approx(w.mean().item(), rel=1e-9)
    assert met["is/ess"] == pytest.approx((w.sum() ** 2 / (w.numel() * (w**2).sum())).item(), rel=1e-9)
    assert met["is/truncated_frac"] == pytest.approx((rho[m] > cap).double().mean().item(), rel=1e-9)
    assert met["clip/frac_high"] == pytest.approx(((a > 0) & (ratio > hi))[m].double().mean().item(), rel=1e-9)
    assert met["clip/frac_low"] == pytest.approx(((a < 0) & (ratio < lo))[m].double().mean().item(), rel=1e-9)
    assert met["policy/ratio_mean"] == pytest.approx(ratio[m].mean().item(), rel=1e-9)
    k3 = torch.exp(ref - lp) - (ref - lp) - 1
    assert met["policy/kl_ref"] == pytest.approx(k3[m].mean().item(), rel=1e-9)
    assert 0 < met["is/truncated_frac"] < 1 and met["clip/frac_high"] > 0 and met["clip/frac_low"] > 0
    # sequence-level ESS is over answers with counted tokens
    _, met_s = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tis", correction_level="sequence"))
    rows = m.any(dim=1)
    ws = torch.stack([torch.clamp(torch.exp(torch.log(rho[b][m[b]]).sum()), max=cap) for b in range(16)])[rows]
    assert met_s["is/ess"] == pytest.approx((ws.sum() ** 2 / (ws.numel() * (ws**2).sum())).item(), rel=1e-9)
    # MIS masked fraction
    _, met_m = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="mis", mis_low=0.5, mis_high=2.0))
    out = ((rho < 0.5) | (rho > 2.0))[m].double().mean().item()
    assert met_m["is/masked_frac"] == pytest.approx(out, rel=1e-9) and 0 < out < 1


def _surrogate_grad(lp, anchor, adv, mask, w, upper, lower, agg):
    """d loss / d logprobs of −w·min(R·A, clip(R, lower, upper)·A) written out (float64, no autograd):
    −w·R·A·s where the clip does not bind (A > 0: R ≤ upper; A < 0: R ≥ lower), else 0; s the aggregation scale."""
    m = mask.bool()
    a = adv[:, None].expand_as(lp) if adv.dim() == 1 else adv
    ratio = torch.exp(lp - anchor)
    free = torch.where(a > 0, ratio <= upper, ratio >= lower)
    if agg == "token-mean":
        scale = torch.full_like(lp, 1.0 / int(m.sum()))
    else:  # seq-mean-token-mean
        scale = (1.0 / (lp.shape[0] * m.sum(dim=1).clamp(min=1).to(lp.dtype)))[:, None].expand_as(lp)
    g = -w * ratio * a * scale
    return torch.where(m & free, g, torch.zeros_like(g))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_matches_float64_reference_with_tokens_at_the_bounds(level):
    """MIS weights ρ (token) or Π_t ρ_t (sequence) inside [mis_low, mis_high] inclusive, 0 outside; checked against
    the formula in float64 (loss, autograd gradient and the written-out gradient to rtol 1e-10) on fresh random
    inputs that include ratios exactly at both bounds and 1e-9 (in log) outside them."""
    lo, hi = 0.5, 2.0  # exp(log(x)) == x in float64 for both: "exactly at the bound" is the same in both spaces
    lp, prox, beh, adv, mask, _ = _random_batch(b=10, t=12, spread=0.8)
    mask[:, :4] = True
    edge = [LOG(hi), LOG(lo), LOG(hi) + 1e-9, LOG(lo) - 1e-9]  # at the bounds (kept), just outside (rejected)
    if level == "token":
        rows = range(2, 10)  # every row gets the four edge tokens in columns 0..3
        for b in rows:
            beh[b, :4] = -0.25  # (−0.25 + x) − (−0.25) == x exactly in float64 for these x
            prox[b, :4] = beh[b, :4] + torch.tensor(edge, dtype=torch.float64)
    else:
        for b, x in zip(range(2, 6), edge):  # rows 2..5: Σ_t log ρ_t lands on an edge value (one token x, rest 0)
            prox[b] = beh[b]
            beh[b, 0] = -0.25
            prox[b, 0] = beh[b, 0] + x
    log_rho = prox - beh
    assert (log_rho[2:, 0] == LOG(hi)).all() if level == "token" else log_rho[2].sum() == LOG(hi)  # precondition
    cfg = LossConfig(loss_type="dapo", epsilon_high=0.2, correction="mis", correction_level=level,
                     mis_low=lo, mis_high=hi)
    # the formula in float64: ρ = exp(log π_prox − log μ), sequence ratio = product over the counted tokens
    rho = torch.exp(log_rho)
    if level == "token":
        ratio_is = rho
    else:
        ratio_is = torch.stack([torch.prod(rho[b][mask[b]]) for b in range(lp.shape[0])])[:, None].expand_as(rho)
    keep = (ratio_is >= lo) & (ratio_is <= hi)
    w = torch.where(keep, ratio_is, torch.zeros_like(ratio_is))
    # the edge values: at the bound kept with weight = the bound, just outside rejected
    if level == "token":
        assert keep[2:, :2].all() and not keep[2:, 2:4].any()
        assert (w[2:, 0] == hi).all() and (w[2:, 1] == lo).all()
    else:
        assert keep[2:4].all() and not keep[4:6].any() and (w[2] == hi).all() and (w[3] == lo).all()
    want_grad = _surrogate_grad(lp, prox, adv, mask, w, 1.2, 0.8, "token-mean")
    lp_ref = lp.clone().requires_grad_(True)
    want = reference_loss(lp_ref, prox, beh, adv, mask, cfg)
    want.backward()
    lp_a = lp.clone().requires_grad_(True)
    got, met = policy_loss(lp_a, prox, beh, adv, mask, cfg)
    got.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp_a.grad, want_grad, rtol=1e-10, atol=1e-12)
    m = mask
    assert met["is/masked_frac"] == pytest.approx((~keep)[m].double().mean().item(), rel=1e-12)
    assert met["is/weight_mean"] == pytest.approx(w[m].mean().item(), rel=1e-10)
    if level == "token":
        ess = w[m].sum() ** 2 / (w[m].numel() * (w[m] ** 2).sum())
    else:
        ws = w[m.any(dim=1), 0]
        ess = ws.sum() ** 2 / (ws.numel() * (ws**2).sum())
    assert met["is/ess"] == pytest.approx(ess.item(), rel=1e-10)
    assert 0 < met["is/masked_frac"] < 1
    # the old behaviour (accepted tokens weighted 1) gives a different gradient on these inputs
    old_grad = _surrogate_grad(lp, prox, adv, mask, keep.to(lp.dtype), 1.2, 0.8, "token-mean")
    assert not torch.allclose(lp_a.grad, old_grad, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_acr_differs_from_tis_when_the_clip_binds(loss_type):
    """At a later optimizer step π_θ ≠ π_prox: for A > 0 and ρ > C, a ratio R with 1+ε_high < R < (1+ε_high)·ρ/C is
    clipped by TIS (zero gradient) but not by ACR (gradient −C·R·A·s); where ρ ≤ C (or A < 0) the two gradients
    are identical. Both are checked against the written-out float64 gradient (rtol 1e-10) on fresh random inputs."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    b, t, cap = 8, 16, 2.0
    f64 = dict(generator=g, dtype=torch.float64)
    beh = -torch.rand(b, t, **f64) * 3 - 0.05
    high = torch.rand(b, t, generator=g) < 0.5  # ρ > C on about half of the tokens
    log_rho = torch.where(high, LOG(2.2) + torch.rand(b, t, **f64) * (LOG(6.0) - LOG(2.2)),
                          LOG(0.3) + torch.rand(b, t, **f64) * (LOG(1.9) - LOG(0.3)))
    prox = beh + log_rho
    eps_high = 0.28 if loss_type == "dapo" else 0.2
    # ρ > C: log R = log(1+ε_high) + u·log(ρ/C); u ∈ (0.1, 0.9) lands inside ACR's widened range, u = 1.4 beyond it
    u = torch.where(torch.rand(b, t, generator=g) < 0.8, 0.1 + 0.8 * torch.rand(b, t, **f64),
                    torch.full((b, t), 1.4, dtype=torch.float64))
    log_r = torch.where(high, LOG(1 + eps_high) + u * (log_rho - LOG(cap)), torch.randn(b, t, **f64) * 0.3)
    lp = prox + log_r
    adv = torch.rand(b, **f64) + 0.1
    adv[-2:] = -adv[-2:]  # two answers with negative advantage
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[:, 0] = True
    grads, metrics = {}, {}
    for corr in ("acr", "tis"):
        x = lp.clone().requires_grad_(True)
        loss, metrics[corr] = policy_loss(x, prox, beh, adv, mask, LossConfig(loss_type=loss_type, correction=corr))
        loss.backward()
        grads[corr] = x.grad
    rho = torch.exp(log_rho)
    w = torch.clamp(rho, max=cap)
    agg = "token-mean" if loss_type == "dapo" else "seq-mean-token-mean"
    upper_acr = (1 + eps_high) * torch.clamp(rho / cap, min=1.0)  # (1+ε_high)/r, r = min(1, C/ρ)
    torch.testing.assert_close(grads["acr"], _surrogate_grad(lp, prox, adv, mask, w, upper_acr, 0.8, agg),
                               rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grads["tis"], _surrogate_grad(lp, prox, adv, mask, w, 1 + eps_high, 0.8, agg),
                               rtol=1e-10, atol=1e-13)
    m = mask
    a = adv[:, None].expand_as(lp)
    window = m & high & (a > 0) & (u < 1)  # TIS clips, ACR does not
    assert int(window.sum()) >= 10
    assert (grads["tis"][window] == 0).all() and (grads["acr"][window] < 0).all()
    same = m & ~window
    assert (same & ~high).any() and (same & high).any()  # ρ ≤ C tokens, and ρ > C tokens with A < 0 or u = 1.4
    torch.testing.assert_close(grads["acr"][same], grads["tis"][same], rtol=0, atol=0)
    assert metrics["tis"]["clip/frac_high"] > metrics["acr"]["clip/frac_high"]


def test_acr_equals_tis_at_the_first_optimizer_step():
    # π_θ = π_prox (R = 1, the only step when a batch gets one optimizer step): the clip cannot bind, ACR = TIS
    lp, prox, beh, adv, mask, _ = _random_batch(spread=1.0)
    lp = prox.clone()
    out = {}
    for corr in ("acr", "tis"):
        x = lp.clone().requires_grad_(True)
        loss, _ = policy_loss(x, prox, beh, adv, mask, LossConfig(loss_type="dapo", correction=corr))
        loss.backward()
        out[corr] = (loss.detach(), x.grad)
    assert (torch.exp(prox - beh)[mask] > 2.0).any()  # truncation is active, yet nothing differs
    torch.testing.assert_close(out["acr"][0], out["tis"][0], rtol=0, atol=0)
    torch.testing.assert_close(out["acr"][1], out["tis"][1], rtol=0, atol=0)


@pytest.mark.parametrize("agg", AGGS, ids=lambda c: c["loss_type"])
@pytest.mark.parametrize("corr", [dict(correction="tis"), dict(correction="mis", correction_level="sequence"),
                                  dict(correction="acr")], ids=["tis", "mis-seq", "acr"])
def test_micro_batches_sum_to_full_batch(corr, agg):
    lp, prox, beh, adv, mask, ref = _random_batch(b=7, t=11, dtype=torch.float32)
    cfg = LossConfig(kl_coef=0.02, **corr, **agg)
    full_lp = lp.clone().requires_grad_(True)
    full, _ = policy_loss(full_lp, prox, beh, adv, mask, cfg, reference_logprobs=ref)
    full.backward()
    n_seq, n_tok = lp.shape[0], int(mask.sum())
    parts_lp = lp.clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 2), slice(2, 3), slice(3, 7)):
        part, _ = policy_loss(parts_lp[sl], prox[sl], beh[sl], adv[sl], mask[sl], cfg, reference_logprobs=ref[sl],
                              num_sequences=n_seq, num_tokens=n_tok)
        part.backward()
        total = total + part.item()
    assert total == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(parts_lp.grad, full_lp.grad, rtol=1e-5, atol=1e-7)


def test_bf16_inputs_are_reduced_in_float32_and_large_ratios_stay_finite():
    lp, prox, beh, adv, mask, _ = _random_batch(dtype=torch.float32)
    lp = lp.bfloat16().requires_grad_(True)
    loss, _ = policy_loss(lp, prox.bfloat16(), beh.bfloat16(), adv.bfloat16(), mask, LossConfig())
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16
    # log ratios of ±200 would overflow exp: capped at e^20, the loss stays finite
    big = torch.tensor([[200.0, -200.0]], requires_grad=True)
    for corr in ("decoupled", "tis", "acr", "naive", "mis"):
        loss, met = policy_loss(big, torch.zeros(1, 2) + 100.0, torch.zeros(1, 2), torch.tensor([-1.0]),
                                torch.ones(1, 2), LossConfig(correction=corr))
        assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in met.values())


def test_empty_mask_gives_zero_loss_and_metrics():
    lp = torch.randn(2, 4, requires_grad=True)
    loss, met = policy_loss(lp, lp.detach(), lp.detach(), torch.ones(2), torch.zeros(2, 4), LossConfig())
    loss.backward()
    assert loss.item() == 0.0 and all(v == 0.0 for v in met.values())
    assert (lp.grad == 0).all()


# ----------------------------------------------------------------------------------------------------------
# configuration and input validation


def test_validate_resolves_defaults():
    c = LossConfig(loss_type="dapo").validate()
    assert c.aggregation == "token-mean" and c.epsilon_high == pytest.approx(0.28)
    c = LossConfig(loss_type="grpo", epsilon_low=0.1).validate()
    assert c.aggregation == "seq-mean-token-mean" and c.epsilon_high == pytest.approx(0.1)
    c = LossConfig(loss_type="dr_grpo", max_new_tokens=64).validate()
    assert c.aggregation == "seq-mean-token-sum-norm"
    assert LossConfig(loss_type="dapo", epsilon_high=0.3).validate().epsilon_high == pytest.approx(0.3)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(loss_type="ppo2"), "loss_type"),
    (dict(aggregation="sum"), "aggregation"),
    (dict(correction="clip"), "correction"),
    (dict(correction_level="batch"), "correction_level"),
    (dict(correction="acr", correction_level="sequence"), "'tis' or 'mis'"),
    (dict(epsilon_low=1.5), "epsilon_low"),
    (dict(epsilon_high=-0.1), "epsilon_high"),
    (dict(is_cap=0.0), "is_cap"),
    (dict(mis_low=3.0, mis_high=2.0), "mis_low"),
    (dict(kl_coef=-1.0), "kl_coef"),
    (dict(loss_type="dr_grpo"), "max_new_tokens"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_validate_rejects_bad_config(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        LossConfig(**kwargs).validate()


def test_bad_inputs_raise_clear_errors():
    lp = torch.zeros(2, 3, requires_grad=True)
    z = torch.zeros(2, 3)
    ones = torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs proximal_logprobs"):
        policy_loss(lp, None, z, torch.ones(2), ones, LossConfig(correction="tis"))
    with pytest.raises(ValueError, match="reference_logprobs"):
        policy_loss(lp, z, z, torch.ones(2), ones, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="behaviour_logprobs must have the shape"):
        policy_loss(lp, z, torch.zeros(2, 4), torch.ones(2), ones, LossConfig())
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(lp, z, z, torch.ones(3), ones, LossConfig())
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(torch.zeros(3), z, z, torch.ones(2), ones, LossConfig())
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(lp, z, z, torch.ones(2), ones, LossConfig(), num_tokens=0)
    with pytest.raises(ValueError, match="correction"):
        policy_loss(lp, z, z, torch.ones(2), ones, LossConfig(correction="nope"))


@pytest.mark.gpu
@pytest.mark.parametrize("corr", ALL_CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_cuda_matches_float64_reference(corr):
    lp64, prox, beh, adv, mask, ref = _random_batch(b=32, t=64)
    for agg in AGGS:
        cfg = LossConfig(kl_coef=0.05, **corr, **agg)
        lp_ref = lp64.clone().requires_grad_(True)
        want = reference_loss(lp_ref, prox, beh, adv, mask, cfg, ref=ref)
        want.backward()
        _, want_metrics = policy_loss(lp64, prox, beh, adv, mask, cfg, reference_logprobs=ref)
        cuda = lambda t: t.float().cuda()  # noqa: E731
        lp = cuda(lp64).requires_grad_(True)
        got, metrics = policy_loss(lp, cuda(prox), cuda(beh), cuda(adv), mask.cuda(), cfg,
                                   reference_logprobs=cuda(ref))
        got.backward()
        assert got.is_cuda
        torch.testing.assert_close(got.double().cpu(), want.detach(), rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(lp.grad.double().cpu(), lp_ref.grad, rtol=2e-4, atol=2e-6)
        assert metrics.keys() == want_metrics.keys()
        for k in metrics:
            assert metrics[k] == pytest.approx(want_metrics[k], rel=1e-4, abs=1e-6), k


def test_a_registered_correction_is_selectable_by_name():
    """A new correction is one registered function: LossConfig accepts its name and policy_loss applies its
    weights (here w = 0.5 on every token), metrics included."""
    from quarl.rl import objectives

    @objectives.register_correction("half-test")
    def _half(log_rho, cfg, sequence_level):
        return objectives.CorrectionWeights(torch.full_like(log_rho, 0.5))

    try:
        torch.manual_seed(5)
        lp = torch.randn(3, 6, dtype=torch.float64) * 0.1 - 1.0
        prox, beh = lp + 0.01 * torch.randn_like(lp), lp + 0.05 * torch.randn_like(lp)
        adv, mask = torch.randn(3, dtype=torch.float64), torch.ones(3, 6, dtype=torch.bool)
        half, metrics = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="half-test"))
        plain, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="naive"))
        anchored = (lp - prox).exp()  # R against π_prox, unclipped here (R = 1 +- 1e-2 inside [0.8, 1.2])
        expected = -(0.5 * anchored * adv[:, None]).mean(dim=1).mean()
        torch.testing.assert_close(half, expected, rtol=1e-12, atol=0)
        assert metrics["is/weight_mean"] == pytest.approx(0.5)
        assert not torch.allclose(half, plain)
        with pytest.raises(ValueError, match="half-test"):
            LossConfig(correction="half-test", correction_level="sequence").validate()
    finally:
        objectives.CORRECTION_REGISTRY.pop("half-test")
    with pytest.raises(ValueError, match="unknown; choose one of"):
        LossConfig(correction="half-test").validate()
