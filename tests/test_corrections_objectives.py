"""TBPO, adaptive IS, geometric-mean masking (geo_mask, seq_mask_tis), IcePop token masking, GSPO's sequence
ratio and the dual clip: float64 references written from the papers' formulas with explicit per-answer loops
(products and powers, no log-space tricks), hand-derived cases, where each differs from TIS, and validation."""

import math

import pytest
import torch

from quarl.rl.objectives import LossConfig, policy_loss

LOG = math.log


def _random_batch(b=8, t=9, seed=None, spread=0.25):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    f64 = torch.float64
    beh = -torch.rand(b, t, generator=g, dtype=f64) * 3 - 0.05
    # a per-answer offset spreads the geometric means across the bands; per-token noise spreads ρ_t
    offset = torch.randn(b, 1, generator=g, dtype=f64) * 0.08
    prox = beh + offset + torch.randn(b, t, generator=g, dtype=f64) * spread
    lp = prox + torch.randn(b, t, generator=g, dtype=f64) * 0.3
    adv = torch.randn(b, generator=g, dtype=f64)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[0] = False  # an empty (overlong-masked) answer
    mask[1, :4] = True
    return lp, prox, beh, adv, mask


def reference_loss(lp, prox, beh, adv, mask, cfg):
    """The formulas of docs/CORRECTIONS.md, one answer at a time, in float64."""
    cfg = cfg.validate()
    B, T = lp.shape
    lo, hi, cap = 1 - cfg.epsilon_low, 1 + cfg.epsilon_high, cfg.is_cap
    c = {"tbpo": 3.0}.get(cfg.correction, 0.0) if cfg.dual_clip is None else cfg.dual_clip
    rho = torch.exp(prox - beh)
    R = torch.exp(lp - prox)
    rows = [b for b in range(B) if mask[b].any()]
    rho_seq = {b: torch.prod(rho[b][mask[b]]) for b in rows}
    lam = None
    if cfg.correction == "ais":
        ws = torch.stack([rho_seq[b] for b in rows])
        lam = (ws.sum() ** 2 / (len(rows) * (ws ** 2).sum())).item()
    per = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        if not idx:
            continue
        n = len(idx)
        geo = torch.prod(rho[b, idx]) ** (1.0 / n)  # geometric mean of ρ over the answer
        s = torch.prod(R[b, idx]) ** (1.0 / n)  # GSPO sequence ratio
        for t in idx:
            r_t = rho[b, t]
            if cfg.correction == "geo_mask":
                low = cfg.geo_low if cfg.geo_low is not None else 1 / cfg.geo_high
                w = 1.0 if low <= geo <= cfg.geo_high else 0.0
            elif cfg.correction == "seq_mask_tis":
                low = cfg.geo_low if cfg.geo_low is not None else 1 / cfg.geo_high
                w = min(r_t, cap) if low <= geo <= cfg.geo_high else 0.0
            elif cfg.correction == "icepop":
                w = r_t if cfg.icepop_low <= r_t <= cfg.icepop_high else 0.0
            elif cfg.correction == "tbpo":
                w = geo if 1 / cfg.tbpo_band <= geo <= cfg.tbpo_band else 0.0
            elif cfg.correction == "ais":
                w = lam * min(rho_seq[b], cap) + (1 - lam) * min(r_t, cap)
            elif cfg.correction == "tis":
                w = min(r_t, cap)
            else:
                raise AssertionError(cfg.correction)
            ratio = s if cfg.importance_sampling_level == "sequence" else R[b, t]
            a = adv[b]
            j = torch.minimum(ratio * a, torch.clamp(ratio, lo, hi) * a)
            if c and a < 0:
                j = torch.maximum(j, c * a)
            per[b, t] = -w * j
    if cfg.aggregation == "token-mean":
        return per.sum() / mask.sum()
    return sum(per[b].sum() / max(int(mask[b].sum()), 1) for b in range(B)) / B


CONFIGS = [
    dict(correction="geo_mask", geo_high=1.1),
    dict(correction="geo_mask", geo_low=0.97, geo_high=1.05),
    dict(correction="seq_mask_tis", geo_high=1.08, is_cap=1.5),
    dict(correction="icepop"),
    dict(correction="icepop", icepop_low=0.8, icepop_high=1.3),
    dict(correction="tbpo", tbpo_band=1.08),
    dict(correction="tbpo", tbpo_band=1.08, dual_clip=1.5),
    dict(correction="ais"),
    dict(correction="ais", is_cap=1.3),
    dict(correction="tis", dual_clip=1.5),
]
ids = lambda c: "-".join(f"{k}={v}" for k, v in c.items())  # noqa: E731


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("corr", CONFIGS, ids=ids)
def test_matches_float64_reference_values_and_gradients(corr, loss_type, level):
    lp64, prox, beh, adv, mask = _random_batch()
    cfg = LossConfig(loss_type=loss_type, importance_sampling_level=level, **corr)
    lp_ref = lp64.clone().requires_grad_(True)
    want = reference_loss(lp_ref, prox, beh, adv, mask, cfg)
    want.backward()
    lp_a = lp64.clone().requires_grad_(True)
    got, _ = policy_loss(lp_a, prox, beh, adv, mask, cfg)
    got.backward()
    # float64 implementation vs float64 formula: rounding only
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_ref.grad, rtol=1e-9, atol=1e-12)
    # float32 (the training dtype): float32 rounding
    lp_b = lp64.float().requires_grad_(True)
    got32, _ = policy_loss(lp_b, prox.float(), beh.float(), adv.float(), mask, cfg)
    got32.backward()
    torch.testing.assert_close(got32.double(), want.detach(), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(lp_b.grad.double(), lp_ref.grad, rtol=2e-4, atol=2e-6)


# ---------------------------------------------------------------------------------------------------- by hand


def _one(ratios, rhos, adv=1.0):
    beh = torch.full((1, len(ratios)), LOG(0.25), dtype=torch.float64)
    prox = beh + torch.log(torch.tensor([rhos], dtype=torch.float64))
    lp = (prox + torch.log(torch.tensor([ratios], dtype=torch.float64))).requires_grad_(True)
    return lp, prox, beh, torch.tensor([adv], dtype=torch.float64), torch.ones(1, len(ratios), dtype=torch.bool)


def test_tbpo_trust_band_by_hand():
    # ρ = (1.21, 1/1.1... ): geometric mean of (1.21, 1.0) = 1.1 -> inside band 1.2, weight 1.1 on both tokens
    lp, prox, beh, adv, mask = _one([1.0, 1.0], [1.21, 1.0])
    loss, met = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tbpo", tbpo_band=1.2))
    assert loss.item() == pytest.approx(-1.1, rel=1e-12)
    assert met["is/masked_frac"] == 0.0 and met["is/weight_mean"] == pytest.approx(1.1)
    # same answer, band 1.05: the geometric mean 1.1 leaves it -> rejected, loss 0 (token TIS would give -1.105)
    loss, met = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tbpo", tbpo_band=1.05))
    assert loss.item() == 0.0 and met["is/masked_frac"] == 1.0
    tis, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tis"))
    assert tis.item() == pytest.approx(-(1.21 + 1.0) / 2, rel=1e-12)


def test_dual_clip_by_hand():
    # A = -1, R = 5 > c = 3: the objective is c·A = -3 (loss +3) with no gradient; without the dual clip it is
    # R·A = -5 (loss +5, gradient +5 through R)
    lp, prox, beh, adv, mask = _one([5.0], [1.0], adv=-1.0)
    loss, met = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tbpo", tbpo_band=1.5))
    loss.backward()
    assert loss.item() == pytest.approx(3.0, rel=1e-12) and lp.grad.abs().max().item() == 0.0
    assert met["clip/frac_dual"] == 1.0
    lp2 = lp.detach().clone().requires_grad_(True)
    plain, met2 = policy_loss(lp2, prox, beh, adv, mask, LossConfig(correction="tbpo", tbpo_band=1.5, dual_clip=0))
    plain.backward()
    assert plain.item() == pytest.approx(5.0, rel=1e-12) and lp2.grad.item() == pytest.approx(5.0, rel=1e-12)
    assert "clip/frac_dual" not in met2
    # positive advantage: the dual clip never acts (R = 5 is clipped at 1.2 by the ordinary clip)
    lp, prox, beh, adv, mask = _one([5.0], [1.0], adv=1.0)
    loss, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tis", dual_clip=3.0))
    assert loss.item() == pytest.approx(-1.2, rel=1e-12)


def test_geo_mask_and_seq_mask_tis_by_hand():
    # geometric mean of ρ = (1.5, 0.6) is sqrt(0.9) ≈ 0.949: outside [1/1.001, 1.001], inside [0.9, 1.1]
    lp, prox, beh, adv, mask = _one([1.0, 1.0], [1.5, 0.6])
    loss, met = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="geo_mask"))
    assert loss.item() == 0.0 and met["is/masked_frac"] == 1.0
    loss, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="geo_mask", geo_high=1.1))
    assert loss.item() == pytest.approx(-1.0, rel=1e-12)  # accepted at weight 1 (pure rejection, no IS weight)
    loss, met = policy_loss(lp, prox, beh, adv, mask,
                            LossConfig(correction="seq_mask_tis", geo_high=1.1, is_cap=1.2))
    assert loss.item() == pytest.approx(-(1.2 + 0.6) / 2, rel=1e-12)  # token TIS inside the accepted answer
    assert met["is/truncated_frac"] == 0.5


def test_icepop_equals_token_mis_with_the_same_band():
    lp, prox, beh, adv, mask = _random_batch(spread=0.8)
    a, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="icepop", icepop_low=0.5, icepop_high=2.0))
    b, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="mis", mis_low=0.5, mis_high=2.0))
    t, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tis", is_cap=2.0))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    assert abs(a.item() - t.item()) > 1e-6  # tokens with ρ < 0.5 are dropped, not kept at weight ρ


def test_ais_limits_are_sequence_and_token_tis():
    # ρ constant within each answer and equal across answers -> sequence weights all equal -> ESS = 1 -> λ = 1:
    # AIS is sequence-level TIS
    lp, prox, beh, adv, mask = _random_batch(seed=3)
    mask[:] = True
    prox_eq = beh + 0.05
    ais, met = policy_loss(lp, prox_eq, beh, adv, mask, LossConfig(correction="ais", is_cap=5.0))
    seq, _ = policy_loss(lp, prox_eq, beh, adv, mask,
                         LossConfig(correction="tis", correction_level="sequence", is_cap=5.0))
    assert met["ais/lambda"] == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(ais, seq, rtol=1e-12, atol=1e-14)
    # one answer's sequence weight dominates -> λ ≈ 1/n: close to token-level TIS, far from sequence TIS
    prox_big = prox.clone()
    prox_big[2] += 3.0  # ρ_seq of answer 2 is e^27 times larger than the others
    ais, met = policy_loss(lp, prox_big, beh, adv, mask, LossConfig(correction="ais"))
    tok, _ = policy_loss(lp, prox_big, beh, adv, mask, LossConfig(correction="tis"))
    assert met["ais/lambda"] == pytest.approx(1 / 8, rel=1e-6)
    assert met["ais/ess_seq"] == met["ais/lambda"]
    assert abs(ais.item() - tok.item()) > 1e-6
    # diagnostics: k1 KL = mean(log μ − log π_prox) over counted tokens
    assert met["ais/kl"] == pytest.approx((beh - prox_big)[mask].mean().item(), rel=1e-12)


def test_gspo_sequence_ratio_by_hand():
    # R = (1.1, 1.1^-1 · 1.0) ... s = (1.21 · 1.0)^(1/2) = 1.1 on both tokens; gradient of s = s/n per token
    lp, prox, beh, adv, mask = _one([1.21, 1.0], [1.0, 1.0])
    loss, met = policy_loss(lp, prox, beh, adv, mask, LossConfig(importance_sampling_level="sequence"))
    loss.backward()
    assert loss.item() == pytest.approx(-1.1, rel=1e-12)
    torch.testing.assert_close(lp.grad, torch.full_like(lp, -1.1 / 2), rtol=1e-12, atol=0)
    assert met["policy/ratio_mean"] == pytest.approx(1.1)
    # token level: R = 1.21 is clipped at 1.2 (no gradient), R = 1 not
    lp2 = lp.detach().clone().requires_grad_(True)
    tok, _ = policy_loss(lp2, prox, beh, adv, mask, LossConfig())
    tok.backward()
    assert tok.item() == pytest.approx(-(1.2 + 1.0) / 2, rel=1e-12)
    assert lp2.grad[0, 0].item() == 0.0
    # sequence ratio beyond the clip: s = 1.3 > 1.2 clips the whole answer
    lp3, prox, beh, adv, mask = _one([1.69, 1.0], [1.0, 1.0])
    loss, _ = policy_loss(lp3, prox, beh, adv, mask, LossConfig(importance_sampling_level="sequence"))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2, rel=1e-12) and lp3.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("corr", [c for c in CONFIGS if c["correction"] != "ais"], ids=ids)
def test_micro_batches_sum_to_full_batch(corr):
    """The per-answer corrections are additive over micro-batches (AIS is not: its λ is taken over the answers of
    one call, see docs/CORRECTIONS.md)."""
    lp, prox, beh, adv, mask = _random_batch(b=8)
    cfg = LossConfig(loss_type="dapo", importance_sampling_level="sequence", **corr)
    full, _ = policy_loss(lp, prox, beh, adv, mask, cfg)
    n_tok = int(mask.sum())
    parts = sum(policy_loss(lp[s], prox[s], beh[s], adv[s], mask[s], cfg, num_sequences=8, num_tokens=n_tok)[0]
                for s in (slice(0, 3), slice(3, 8)))
    torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-14)


def test_new_corrections_differ_from_tis():
    lp, prox, beh, adv, mask = _random_batch(seed=11, spread=0.4)
    tis, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(correction="tis"))
    for corr in CONFIGS[:-1]:
        got, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(**corr))
        assert abs(got.item() - tis.item()) > 1e-6, corr


@pytest.mark.parametrize("kwargs,needle", [
    (dict(importance_sampling_level="answer"), "importance_sampling_level"),
    (dict(dual_clip=0.5), "dual_clip"),
    (dict(correction="geo_mask", geo_high=0.9), "geo_high"),
    (dict(correction="geo_mask", geo_low=1.5), "geo_low"),
    (dict(icepop_low=5.0, icepop_high=2.0), "icepop_low"),
    (dict(tbpo_band=1.0), "tbpo_band"),
    (dict(error_token_guard="drop-all"), "error_token_guard"),
    (dict(error_loop_min_repeats=1), "error_loop_min_repeats"),
    (dict(error_loop_max_ngram=0), "error_loop_max_ngram"),
    (dict(error_max_abs_log_ratio=-1.0), "error_max_abs_log_ratio"),
    (dict(correction="tbpo", correction_level="sequence"), "correction_level"),
])
def test_validate_rejects_bad_config(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as e:
        LossConfig(**kwargs).validate()
    assert "\n" not in str(e.value)


def test_dual_clip_defaults():
    assert LossConfig(correction="tbpo").validate().dual_clip == 3.0
    assert LossConfig(correction="tbpo", dual_clip=0).validate().dual_clip == 0.0
    assert LossConfig(correction="tis").validate().dual_clip == 0.0
    assert LossConfig(correction="tis", dual_clip=2.5).validate().dual_clip == 2.5
