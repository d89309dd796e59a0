"""Clipped policy-gradient objectives (GRPO, DAPO, Dr.GRPO) with rollout-mismatch corrections (BRIEF §4).

Three policies meet in one loss:

* μ       — the behaviour policy that sampled the answers (quantized rollout); its log-probs are `behaviour_logprobs`.
* π_prox  — the pre-update weights θ_old in training precision (the trust-region anchor): `proximal_logprobs`.
* π_θ     — the current policy, with grad: `logprobs`.

Token ratios: R_t = π_θ / π_prox (trust region) and ρ_t = π_prox / μ (rollout mismatch). With the clipped
surrogate J_clip = min(R·A, clip(R, 1−ε_low, 1+ε_high)·A) the per-token loss of each correction is

=============  =====================================================================================
naive          −min(R̂·A, clip(R̂)·A) with R̂ = π_θ / μ: μ taken as the old policy, no correction at all
decoupled      −ρ·J_clip (Hilton et al.), ρ detached
tis            −w·J_clip, w = min(ρ, C) (token) or w = min(exp Σ_t log ρ_t, C) on every token (sequence)
mis            −w·J_clip, w = ρ·1[mis_low ≤ ρ ≤ mis_high] (token), or on every token of the answer
               w = ρ_seq·1[mis_low ≤ ρ_seq ≤ mis_high] with ρ_seq = exp Σ_t log ρ_t (sequence)
acr            −min(ρ, C)·min(R·A, clip(R, 1−ε_low, (1+ε_high)/r)·A), r = min(1, C/ρ)
bypass         π_prox := μ (no extra forward); numerically the naive loss, offered as a labelled choice
geo_mask       −1[geo_low ≤ ρ_geo ≤ geo_high]·J_clip, ρ_geo = exp(mean_t log ρ_t) over the answer (verl)
seq_mask_tis   −1[geo_low ≤ ρ_geo ≤ geo_high]·min(ρ_t, C)·J_clip (sequence mask + token TIS)
icepop         −ρ·1[icepop_low ≤ ρ ≤ icepop_high]·J_clip (IcePop token masking)
tbpo           −ρ_geo·1[1/band ≤ ρ_geo ≤ band]·J_dual (QaRL trust band), J_dual = J_clip, or for A < 0
               max(J_clip, c·A) with c = dual_clip (default 3)
ais            −(λ·min(ρ_seq, C) + (1−λ)·min(ρ_t, C))·J_clip, λ = ESS(ρ_seq)/n over the answers (adaptive IS)
=============  =====================================================================================

plus, when `kl_coef` > 0, β·k3 with k3 = exp(ref − θ) − (ref − θ) − 1 per token, before aggregation.
`importance_sampling_level="sequence"` (GSPO) replaces R_t by s_i = exp(mean_t log R_t) of answer i in J_clip
for any correction; `dual_clip` = c > 1 adds the dual clip to any correction. docs/CORRECTIONS.md has the
formulas, the config keys and the papers.

Each correction is one pure function registered by name (`@register_correction`, as verl's
`@register_policy_loss`): it maps log ρ [B, T] to the per-token weights (and which tokens were truncated or
rejected, and a widened upper clip bound for ACR); `LossConfig.correction` selects it and the trainer asks the
registry (`Correction.skips_proximal`), never the name, whether to compute π_prox.

All weights (ρ, w) are functions of no-grad log-probs, so the gradient flows only through R.

Design decisions (documented because other frameworks differ):

* MIS is importance sampling with rejection, as TRL's `token_mask` / `sequence_mask` and verl's rollout-correction
  masking: a token (token level) or a whole answer (sequence level) whose ρ lies outside [mis_low, mis_high]
  gets weight 0, an accepted one keeps its importance weight ρ (not 1), untruncated: the accepted range already
  bounds it by mis_high. Sequence level uses ρ_seq = exp Σ_t log ρ_t over the answer's counted tokens (TRL's
  sequence ratio) and applies it to every token of the answer. The bounds are inclusive (TRL masks ρ > cap) and
  are compared in log space (log ρ against log mis_low / log mis_high), so ρ_seq never overflows before the test;
  ρ is exponentiated only where accepted, where it is ≤ mis_high.
* MIS rejects by *zeroing* a token's policy-gradient term; the token stays in the aggregation denominator.
  This keeps the loss scale independent of how many tokens were rejected and makes micro-batch losses sum
  exactly to the full-batch loss with the caller's `num_tokens` (which cannot know rejections in advance).
  The KL term is not rejected: it regularises toward the reference on every counted token.
* ACR: the paper was not public; we read "the bound loosens as divergence grows" as widening the *upper* clip
  bound by 1/r exactly where truncation min(ρ, C) = ρ·r shrank the effective range (r < 1 iff ρ > C).
  Where ρ ≤ C the objective equals token-level TIS.
* The clip — and so ACR's widened bound and DAPO's clip-higher ε_high — binds only where π_θ ≠ π_prox, i.e. from
  the second optimizer step on the same batch (train.mini_batch_size below the batch, or train.epochs > 1). With
  one optimizer step per batch R = 1 at the only step: ACR trains exactly like TIS and ε_high does nothing
  (RunConfig.validate warns). naive/bypass are the exception: their R̂ = π_θ/μ differs from 1 from the start.
* Numeric guards: log R and log ρ are capped at +20 before `exp` (e^20 ≈ 4.9e8) so a wildly off-policy token
  yields a large finite loss instead of inf/NaN; positions outside `mask` are neutralised with `where`, so
  padding holding garbage (even ±inf) never reaches the loss or the gradient.
* Empty rows (overlong-masked answers, mask all zero) still count as answers in the "seq-mean-*" denominators,
  as in TRL's GRPO loss (per-answer mean with a token count clamped to 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
CORRECTION_LEVELS = ("token", "sequence")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
ERROR_TOKEN_GUARDS = ("off", "mask", "drop")
ADVANTAGE_ESTIMATORS = ("group", "gae")
DEFAULT_AGGREGATION = {"grpo": "seq-mean-token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
DAPO_EPSILON_HIGH = 0.28  # DAPO "clip-higher"

# exp(20) ≈ 4.9e8: far beyond any clip range, small enough that products with advantages stay finite in fp32.
_MAX_LOG_RATIO = 20.0


# ------------------------------------------------------------------------------------------------ corrections
@dataclass
class CorrectionWeights:
    """What a correction applies to each token's clipped term: weight [B, T] (no grad), and for the metrics and
    the clip, truncated / rejected bool [B, T] (None = none) and upper_scale [B, T] (None = 1), which multiplies
    the upper clip bound 1 + ε_high."""

    weight: Tensor
    truncated: Tensor | None = None
    rejected: Tensor | None = None
    upper_scale: Tensor | None = None
    # one weight per answer (the same on all its tokens): "is/ess" is then taken over answers, not tokens
    per_sequence: bool = False
    # extra diagnostics, 0-dim tensors, reported with the loss metrics (e.g. AIS's mixing coefficient)
    metrics: dict[str, Tensor] | None = None


@dataclass(frozen=True)
class Correction:
    """A registered mismatch correction: `fn(log_rho [B, T], cfg, sequence_level) -> CorrectionWeights`, where
    log_rho = log π_prox − log μ (0 outside the mask). anchor_is_behaviour: μ plays the old policy (R̂ = π_θ/μ,
    ρ = 1); skips_proximal: the trainer computes no π_prox at all; sequence_level: correction_level="sequence"
    applies; uses_mask: fn also takes the bool mask [B, T] as a fourth argument (sequence statistics such as the
    geometric mean need each answer's token count); dual_clip: the dual-clip constant c used when
    loss.dual_clip is left None (None = no dual clip by default)."""

    name: str
    fn: Callable
    anchor_is_behaviour: bool = False
    skips_proximal: bool = False
    sequence_level: bool = False
    uses_mask: bool = False
    dual_clip: float | None = None


CORRECTION_REGISTRY: dict[str, Correction] = {}


def register_correction(name: str, *, anchor_is_behaviour: bool = False, skips_proximal: bool = False,
                        sequence_level: bool = False, uses_mask: bool = False, dual_clip: float | None = None):
    """Decorator: register `fn(log_rho, cfg, sequence_level[, mask]) -> CorrectionWeights` as
    `loss.correction=name` (the mask is passed when uses_mask=True)."""
    def decorate(fn: Callable) -> Callable:
        CORRECTION_REGISTRY[name] = Correction(name, fn, anchor_is_behaviour, skips_proximal, sequence_level,
                                               uses_mask, dual_clip)
        return fn
    return decorate


def get_correction(name: str) -> Correction:
    """The registered correction `name`; ValueError listing the registered ones otherwise."""
    if name not in CORRECTION_REGISTRY:
        raise ValueError(f"loss.correction={name!r} is unknown; choose one of {tuple(CORRECTION_REGISTRY)}")
    return CORRECTION_REGISTRY[name]


@register_correction("naive", anchor_is_behaviour=True)
def _naive(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool) -> CorrectionWeights:
    return CorrectionWeights(torch.ones_like(log_rho))


@register_correction("decoupled")
def _decoupled(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool) -> CorrectionWeights:
    return CorrectionWeights(torch.exp(log_rho.clamp(max=_MAX_LOG_RATIO)))


@register_correction("tis", sequence_level=True)
def _tis(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool) -> CorrectionWeights:
    log_cap = math.log(cfg.is_cap)
    if sequence_level:
        log_rho_seq = log_rho.sum(dim=1, keepdim=True)  # masked positions already hold 0
        return CorrectionWeights(torch.exp(log_rho_seq.clamp(max=log_cap)).expand_as(log_rho),
                                 truncated=(log_rho_seq > log_cap).expand_as(log_rho))
    return CorrectionWeights(torch.exp(log_rho.clamp(max=log_cap)), truncated=log_rho > log_cap)  # min(ρ, C)


@register_correction("mis", sequence_level=True)
def _mis(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool) -> CorrectionWeights:
    log_low = math.log(cfg.mis_low) if cfg.mis_low > 0 else -math.inf
    log_high = math.log(cfg.mis_high)
    # log ρ (token) or log ρ_seq = Σ_t log ρ_t (sequence; masked positions already hold 0), tested in log space
    lr = log_rho.sum(dim=1, keepdim=True).expand_as(log_rho) if sequence_level else log_rho
    keep = (lr >= log_low) & (lr <= log_high)
    # accepted: weight ρ (≤ mis_high, so the clamp only guards the rejected branch against overflow); rejected: 0
    return CorrectionWeights(_masked_where(keep, torch.exp(lr.clamp(max=log_high))), rejected=~keep)


@register_correction("acr")
def _acr(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool) -> CorrectionWeights:
    log_cap = math.log(cfg.is_cap)
    # min(ρ, C) = ρ·r; the upper bound (1+ε_high)/r with r = min(1, C/ρ) ⇔ (1+ε_high)·max(1, ρ/C), in log space.
    return CorrectionWeights(torch.exp(log_rho.clamp(max=log_cap)), truncated=log_rho > log_cap,
                             upper_scale=torch.exp((log_rho - log_cap).clamp(min=0.0, max=_MAX_LOG_RATIO)))


@register_correction("bypass", anchor_is_behaviour=True, skips_proximal=True)
def _bypass(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool) -> CorrectionWeights:
    return CorrectionWeights(torch.ones_like(log_rho))


def _answer_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[B, 1]: the mean of x [B, T] over each answer's counted tokens (0 for an answer with none)."""
    return _masked_where(mask, x).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)


def _geo_bounds(cfg: "LossConfig") -> tuple[float, float]:
    """log lower / log upper bound of the geometric-mean band (geo_low None -> 1/geo_high, verl's default)."""
    log_high = math.log(cfg.geo_high)
    return (math.log(cfg.geo_low) if cfg.geo_low is not None else -log_high), log_high


@register_correction("geo_mask", uses_mask=True)
def _geo_mask(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool, mask: Tensor) -> CorrectionWeights:
    # verl's geometric rejection: log ρ_geo = mean_t log ρ_t is length-normalised, so one band fits any length.
    log_low, log_high = _geo_bounds(cfg)
    geo = _answer_mean(log_rho, mask)
    keep = ((geo >= log_low) & (geo <= log_high)).expand_as(log_rho)
    # pure rejection, no importance weight: accepted answers train at weight 1
    return CorrectionWeights(keep.to(log_rho.dtype), rejected=~keep, per_sequence=True)


@register_correction("seq_mask_tis", uses_mask=True)
def _seq_mask_tis(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool, mask: Tensor) -> CorrectionWeights:
    log_low, log_high = _geo_bounds(cfg)
    geo = _answer_mean(log_rho, mask)
    keep = ((geo >= log_low) & (geo <= log_high)).expand_as(log_rho)
    log_cap = math.log(cfg.is_cap)
    tis = torch.exp(log_rho.clamp(max=log_cap))  # token-level min(ρ_t, C) inside accepted answers
    return CorrectionWeights(_masked_where(keep, tis), truncated=keep & (log_rho > log_cap), rejected=~keep)


@register_correction("icepop")
def _icepop(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool) -> CorrectionWeights:
    # IcePop's M(ρ; α, β) = ρ on [α, β], 0 outside: token-level masking with its own (wider) default band
    log_low = math.log(cfg.icepop_low) if cfg.icepop_low > 0 else -math.inf
    log_high = math.log(cfg.icepop_high)
    keep = (log_rho >= log_low) & (log_rho <= log_high)
    return CorrectionWeights(_masked_where(keep, torch.exp(log_rho.clamp(max=log_high))), rejected=~keep)


@register_correction("tbpo", uses_mask=True, dual_clip=3.0)
def _tbpo(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool, mask: Tensor) -> CorrectionWeights:
    # Trust band: an answer whose geometric-mean ρ leaves [1/band, band] is rejected; an accepted one is weighted
    # by that geometric mean (≤ band, so bounded without truncation). The dual clip on A < 0 is applied by
    # policy_loss (Correction.dual_clip = 3 is the default of loss.dual_clip for this correction).
    log_band = math.log(cfg.tbpo_band)
    geo = _answer_mean(log_rho, mask)
    keep = (geo.abs() <= log_band).expand_as(log_rho)
    weight = _masked_where(keep, torch.exp(geo.clamp(min=-log_band, max=log_band)).expand_as(log_rho))
    return CorrectionWeights(weight, rejected=~keep, per_sequence=True)


@register_correction("ais", uses_mask=True)
def _ais(log_rho: Tensor, cfg: "LossConfig", sequence_level: bool, mask: Tensor) -> CorrectionWeights:
    # Adaptive IS: w = λ·min(ρ_seq, C) + (1 − λ)·min(ρ_t, C) with λ = the normalised ESS of the *raw* sequence
    # weights ρ_seq = exp Σ_t log ρ_t over the answers in this call. Sequence-level IS is the unbiased estimator
    # for a sequence reward but its variance explodes as the mismatch grows (ESS → 1/n); the token-level one is
    # biased but stays low-variance. λ moves from the first to the second exactly as the live mismatch makes the
    # sequence weights degenerate. ESS is computed in log space: 2·LSE(l) − LSE(2l) − log n.
    log_cap = math.log(cfg.is_cap)
    rows = mask.any(dim=1)
    n = rows.sum()
    log_seq = log_rho.sum(dim=1)  # masked positions already hold 0
    neg_inf = torch.full_like(log_seq, -math.inf)
    ls = torch.where(rows, log_seq, neg_inf)
    log_ess = 2 * torch.logsumexp(ls, 0) - torch.logsumexp(2 * ls, 0) - torch.log(n.to(log_rho.dtype).clamp(min=1))
    ess_seq = torch.where(n > 0, torch.exp(log_ess.clamp(max=0.0)), torch.zeros_like(log_ess))
    lam = ess_seq.detach()
    w_seq = torch.exp(log_seq.clamp(max=log_cap)).unsqueeze(1).expand_as(log_rho)
    w_tok = torch.exp(log_rho.clamp(max=log_cap))
    weight = lam * w_seq + (1 - lam) * w_tok
    # diagnostics: token-level ESS of the raw ρ_t and the k1 estimate of KL(μ‖π_prox) = mean(−log ρ_t)
    lt = torch.where(mask, log_rho, torch.full_like(log_rho, -math.inf)).flatten()
    n_tok = mask.sum().to(log_rho.dtype)
    ess_tok = torch.where(n_tok > 0, torch.exp((2 * torch.logsumexp(lt, 0) - torch.logsumexp(2 * lt, 0)
                                                - torch.log(n_tok.clamp(min=1))).clamp(max=0.0)),
                          torch.zeros_like(n_tok))
    kl = -_masked_where(mask, log_rho).sum() / n_tok.clamp(min=1)
    truncated = (log_rho > log_cap) | ((log_seq > log_cap).unsqueeze(1) & (lam > 0))
    return CorrectionWeights(weight, truncated=truncated,
                             metrics={"ais/lambda": lam, "ais/ess_seq": ess_seq, "ais/ess_token": ess_tok,
                                      "ais/kl": kl})


CORRECTIONS = tuple(CORRECTION_REGISTRY)  # the built-in ones, in order (a later registration adds to the registry)


@dataclass
class LossConfig:
    """Objective, aggregation and mismatch correction (BRIEF §4). Call `validate()` to check and resolve it."""

    loss_type: str = "grpo"  # "grpo" | "dapo" | "dr_grpo"  (sets the default aggregation)
    # group: group-relative (grpo, dapo: over the group's std; dr_grpo: centred) | gae: PPO with a critic (critic.*)
    advantage_estimator: str = "group"
    # None -> by loss_type: grpo seq-mean-token-mean, dapo token-mean, dr_grpo seq-mean-token-sum-norm
    aggregation: str | None = None
    epsilon_low: float = 0.2  # PPO clip range below 1
    epsilon_high: float | None = None  # None -> 0.28 for dapo, else epsilon_low
    # naive (R=π_θ/μ, w=1) | decoupled (×ρ) | tis (×min(ρ,C)) | mis (×ρ or 0) | acr (tis+wider clip) | bypass (=naive)
    correction: str = "tis"
    # token: each token its ρ = π_prox/μ | sequence: exp(Σ_t log ρ_t) on every token of the answer (tis and mis only)
    correction_level: str = "token"
    # C: tis weight min(ρ, C); acr: that weight, upper clip (1+epsilon_high)·max(1, ρ/C) (binds from 2nd optimizer step)
    is_cap: float = 2.0
    # mis: weight ρ where mis_low <= ρ <= mis_high (bounds inclusive), weight 0 (rejected) where ρ is outside
    mis_low: float = 0.0
    mis_high: float = 3.0  # mis: upper acceptance bound on ρ (TRL's default 3); accepted weights stay <= mis_high
    kl_coef: float = 0.0  # beta for the k3 KL to a frozen reference
    max_new_tokens: int | None = None  # needed by the dr_grpo aggregation
    # token: R_t = π_θ/π_old per token | sequence (GSPO): s_i = exp(mean_t log R_t) on every token of answer i
    importance_sampling_level: str = "token"
    # dual clip c > 1: for A < 0 the objective is max(min(R·A, clip(R)·A), c·A); null = 3 for tbpo, else off; 0 = off
    dual_clip: float | None = None
    # geo_mask / seq_mask_tis: lower bound on an answer's geometric-mean ρ; null -> 1/geo_high
    geo_low: float | None = None
    # geo_mask / seq_mask_tis: upper bound on an answer's geometric-mean ρ (verl's geometric rejection: 1.001)
    geo_high: float = 1.001
    # icepop: token weight ρ where icepop_low <= ρ <= icepop_high, 0 outside (IcePop's α = 0.5)
    icepop_low: float = 0.5
    icepop_high: float = 5.0  # icepop: upper bound of the accepted ρ band (IcePop's β = 5)
    tbpo_band: float = 1.05  # tbpo: keep answers whose geometric-mean ρ lies in [1/band, band]; weight = that mean
    # off (error/* metrics only) | mask (flagged answers get loss weight 0) | drop (flagged answers leave the batch)
    error_token_guard: str | bool = "off"
    error_loop_max_ngram: int = 16  # loops of n-grams with 1 <= n <= this are detected
    error_loop_min_repeats: int = 4  # ... repeated back to back at least this many times
    error_loop_min_tokens: int = 16  # ... covering at least this many tokens
    error_max_abs_log_ratio: float = 6.0  # a token with |log μ − log π_prox| above this flags its answer (0 = off)

    def __post_init__(self):
        # YAML 1.1 reads a bare `off` as false (hence the str | bool type of error_token_guard): map it back
        if self.error_token_guard is False:
            self.error_token_guard = "off"

    @property
    def resolved_aggregation(self) -> str:
        return self.aggregation if self.aggregation is not None else DEFAULT_AGGREGATION.get(self.loss_type, "")

    @property
    def resolved_epsilon_high(self) -> float:
        if self.epsilon_high is not None:
            return float(self.epsilon_high)
        return DAPO_EPSILON_HIGH if self.loss_type == "dapo" else float(self.epsilon_low)

    def validate(self) -> "LossConfig":
        """Check every field; return a copy with `aggregation` and `epsilon_high` filled in (None resolved).

        Raises ValueError naming the field, the bad value and the accepted values.
        """
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss.loss_type={self.loss_type!r} is unknown; choose one of {LOSS_TYPES}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"loss.advantage_estimator={self.advantage_estimator!r} is unknown; choose one of "
                             f"{ADVANTAGE_ESTIMATORS} (gae = PPO with a critic, configured under critic.*)")
        agg = self.resolved_aggregation
        if agg not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation={self.aggregation!r} is unknown; choose one of {AGGREGATIONS} "
                             "or leave it None for the loss_type default")
        correction = get_correction(self.correction)
        if self.correction_level not in CORRECTION_LEVELS:
            raise ValueError(
                f"loss.correction_level={self.correction_level!r} is unknown; choose one of {CORRECTION_LEVELS}")
        if self.correction_level == "sequence" and not correction.sequence_level:
            raise ValueError(
                "loss.correction_level='sequence' applies to correction "
                f"{' or '.join(repr(c.name) for c in CORRECTION_REGISTRY.values() if c.sequence_level)} only, not "
                f"{self.correction!r}; use correction_level='token' or switch the correction")
        if not 0.0 <= self.epsilon_low < 1.0:
            raise ValueError(f"loss.epsilon_low={self.epsilon_low} must lie in [0, 1) (clip range [1-eps_low, ...])")
        eps_high = self.resolved_epsilon_high
        if not eps_high >= 0.0 or not math.isfinite(eps_high):
            raise ValueError(f"loss.epsilon_high={self.epsilon_high} must be a finite number >= 0")
        if not (self.is_cap > 0.0 and math.isfinite(self.is_cap)):
            raise ValueError(f"loss.is_cap={self.is_cap} must be a finite number > 0 (typical: 2.0)")
        if not (0.0 <= self.mis_low < self.mis_high):
            raise ValueError(f"loss.mis_low={self.mis_low}, mis_high={self.mis_high}: need 0 <= mis_low < mis_high "
                             "(TRL's default keeps 0 <= rho <= 3)")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"loss.kl_coef={self.kl_coef} must be a finite number >= 0")
        if self.max_new_tokens is not None and (isinstance(self.max_new_tokens, bool)
                                                or not isinstance(self.max_new_tokens, int)
                                                or self.max_new_tokens < 1):
            raise ValueError(f"loss.max_new_tokens={self.max_new_tokens!r} must be a positive int or None")
        if agg == "seq-mean-token-sum-norm" and self.max_new_tokens is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' (dr_grpo) divides by answers x max_new_tokens; "
                             "set loss.max_new_tokens to the rollout's max_new_tokens")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"loss.importance_sampling_level={self.importance_sampling_level!r} is unknown; choose "
                             f"one of {IMPORTANCE_SAMPLING_LEVELS} (sequence = GSPO)")
        dual_clip = self.dual_clip if self.dual_clip is not None else (correction.dual_clip or 0.0)
        if not (dual_clip == 0.0 or (dual_clip > 1.0 and math.isfinite(dual_clip))):
            raise ValueError(f"loss.dual_clip={self.dual_clip} must be 0 (off) or a finite number > 1 "
                             "(dual-clip PPO uses 3), or None for the correction's default")
        if not (self.geo_high > 1.0 and math.isfinite(self.geo_high)):
            raise ValueError(f"loss.geo_high={self.geo_high} must be a finite number > 1 (verl's default 1.001)")
        if self.geo_low is not None and not 0.0 < self.geo_low < self.geo_high:
            raise ValueError(f"loss.geo_low={self.geo_low} must lie in (0, geo_high={self.geo_high}), or be None "
                             "for 1/geo_high")
        if not (0.0 <= self.icepop_low < self.icepop_high and math.isfinite(self.icepop_high)):
            raise ValueError(f"loss.icepop_low={self.icepop_low}, icepop_high={self.icepop_high}: need "
                             "0 <= icepop_low < icepop_high < inf (IcePop: 0.5 and 5)")
        if not (self.tbpo_band > 1.0 and math.isfinite(self.tbpo_band)):
            raise ValueError(f"loss.tbpo_band={self.tbpo_band} must be a finite number > 1 (e.g. 1.05)")
        if isinstance(self.error_token_guard, bool) or self.error_token_guard not in ERROR_TOKEN_GUARDS:
            raise ValueError(f"loss.error_token_guard={self.error_token_guard!r} is unknown; choose one of "
                             f"{ERROR_TOKEN_GUARDS}")
        for key in ("error_loop_max_ngram", "error_loop_min_repeats", "error_loop_min_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if key.endswith("repeats") else 1):
                raise ValueError(f"loss.{key}={value!r} must be an int >= "
                                 f"{2 if key.endswith('repeats') else 1}")
        if not (self.error_max_abs_log_ratio >= 0.0 and math.isfinite(self.error_max_abs_log_ratio)):
            raise ValueError(f"loss.error_max_abs_log_ratio={self.error_max_abs_log_ratio} must be a finite number "
                             ">= 0 (0 turns the log-ratio test off; e.g. 6 flags a token 400x off)")
        return replace(self, aggregation=agg, epsilon_high=eps_high, dual_clip=float(dual_clip))


def _masked_where(mask: Tensor, values: Tensor) -> Tensor:
    """values where mask, else 0 — `where` (not multiply) so inf/NaN in padding cannot leak into sums or grads."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _check_inputs(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask, cfg, reference_logprobs):
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T]; got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {"behaviour_logprobs": behaviour_logprobs, "mask": mask}
    if proximal_logprobs is not None:
        named["proximal_logprobs"] = proximal_logprobs
    if reference_logprobs is not None:
        named["reference_logprobs"] = reference_logprobs
    for name, t in named.items():
        if not isinstance(t, Tensor) or t.shape != shape:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}; got {got}")
    if advantages.shape != shape and advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(shape[:1])} or [B, T]={tuple(shape)}; "
                         f"got {tuple(advantages.shape)}")
    for name, t in (("logprobs", logprobs), ("behaviour_logprobs", behaviour_logprobs),
                    ("advantages", advantages)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor; got {t.dtype}")
    if proximal_logprobs is None and not get_correction(cfg.correction).anchor_is_behaviour:
        raise ValueError(f"correction {cfg.correction!r} needs proximal_logprobs (log pi_prox from a no-grad forward "
                         "of the training model at the pre-update weights); pass them, or use correction='bypass'")
    if cfg.kl_coef > 0 and reference_logprobs is None:
        raise ValueError(f"loss.kl_coef={cfg.kl_coef} > 0 needs reference_logprobs (log pi_ref of a frozen reference "
                         "model); pass them or set kl_coef=0")


def _aggregate(per_token: Tensor, mask: Tensor, agg: str, num_sequences: int | None, num_tokens: int | None,
               max_new_tokens: int | None) -> Tensor:
    """Reduce [B, T] per-token losses (already zero outside mask) to a scalar."""
    batch = per_token.shape[0]
    if agg == "token-mean":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
        return per_token.sum() / denom
    n_seq = num_sequences if num_sequences is not None else batch
    if agg == "seq-mean-token-mean":
        per_seq = per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / n_seq
    # seq-mean-token-sum-norm (Dr.GRPO): a constant denominator, so answer length does not rescale its tokens.
    return per_token.sum() / (n_seq * max_new_tokens)


def _metrics(m: Tensor, adv: Tensor, ratio: Tensor, lower: float, upper: Tensor, weight: Tensor,
             truncated: Tensor, rejected: Tensor, kl_ref: Tensor | None, sequence_level: bool,
             dual_clip: float = 0.0, extra: dict[str, Tensor] | None = None) -> dict[str, float]:
    """Loss diagnostics over the counted tokens, reduced in float64 and fetched with one device sync."""
    f64 = torch.float64
    n = m.sum().to(f64)
    denom = n.clamp(min=1.0)  # an empty batch reports zeros

    def frac(flags: Tensor) -> Tensor:
        return (flags & m).sum().to(f64) / denom

    def mean(values: Tensor) -> Tensor:
        return _masked_where(m, values.to(f64)).sum() / denom

    w = weight.detach().to(f64)
    if sequence_level:  # one weight per answer that has counted tokens
        rows = m.any(dim=1)
        w_ess, count = _masked_where(rows, w[:, 0]), rows.sum().to(f64)
    else:
        w_ess, count = _masked_where(m, w), n
    sq = (w_ess * w_ess).sum()
    # (Σw)² / (n·Σw²); 0 when every weight is 0 (all rejected) or nothing counts
    ess = torch.where(sq > 0, w_ess.sum() ** 2 / (count * sq).clamp(min=1e-300), torch.zeros_like(sq))
    values = {
        # The clip binds (zero gradient through R) on the high side when A > 0 and R > upper, and on the
        # low side when A < 0 and R < lower.
        "clip/frac_low": frac((adv < 0) & (ratio < lower)),
        "clip/frac_high": frac((adv > 0) & (ratio > upper)),
        "is/weight_mean": mean(w),
        "is/truncated_frac": frac(truncated),
        "is/masked_frac": frac(rejected),
        "is/ess": ess,
        "policy/ratio_mean": mean(ratio),
    }
    if dual_clip > 0:  # the dual clip binds where A < 0 and R > c
        values["clip/frac_dual"] = frac((adv < 0) & (ratio > dual_clip))
    if kl_ref is not None:
        values["policy/kl_ref"] = mean(kl_ref)
    for k, v in (extra or {}).items():
        values[k] = v.detach().to(f64).reshape(())
    return dict(zip(values, torch.stack(list(values.values())).tolist()))


def policy_loss(logprobs: Tensor, proximal_logprobs: Tensor | None, behaviour_logprobs: Tensor,
                advantages: Tensor, mask: Tensor, cfg: LossConfig,
                reference_logprobs: Tensor | None = None, num_sequences: int | None = None,
                num_tokens: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with a rollout-mismatch correction; see the module docstring for formulas.

    Args:
        logprobs: [B, T] float, log π_θ of the sampled tokens, with grad.
        proximal_logprobs: [B, T] float, log π_prox (θ_old in training precision), no grad. May be None only for
            correction "bypass" or "naive" (ignored by both).
        behaviour_logprobs: [B, T] float, log μ recorded at rollout (after temperature / top-k / top-p).
        advantages: [B] (one per answer) or [B, T] float.
        mask: [B, T] bool or 0/1 float; 1 = an answer token that counts (an overlong-masked answer is all zero).
        cfg: the LossConfig (validated here; unknown names raise ValueError).
        reference_logprobs: [B, T] float, log π_ref of a frozen reference; needed when cfg.kl_coef > 0, and
            reported as "policy/kl_ref" whenever given.
        num_sequences / num_tokens: whole-batch answer / counted-token totals for when the caller splits a batch
            into micro-batches: with them, the micro-batch losses sum exactly to the full-batch loss.
            Defaults: this batch's B and mask.sum().

    Returns:
        (loss, metrics): loss a 0-dim tensor (float32, or float64 for float64 inputs) to minimise; metrics python
        floats over this batch's counted tokens: "clip/frac_low", "clip/frac_high", "is/weight_mean",
        "is/truncated_frac", "is/masked_frac", "is/ess", "policy/ratio_mean", "policy/kl_ref" if a reference
        was given, "clip/frac_dual" (A < 0 and R > c) when the dual clip is on, and the correction's own
        diagnostics (ais: "ais/lambda", "ais/ess_seq", "ais/ess_token", "ais/kl"). "is/*" describe the weight actually applied to each token's clipped term (1 for naive and
        bypass, ρ for decoupled, min(ρ, C) for tis/acr, ρ if accepted else 0 for mis); "is/ess" is (Σw)²/(n·Σw²) over
        tokens, or over answers for sequence-level corrections.
    """
    cfg = cfg.validate()
    _check_inputs(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask, cfg, reference_logprobs)
    for name, value in (("num_sequences", num_sequences), ("num_tokens", num_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int (the whole batch's count) or None")

    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 inputs are reduced in fp32
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    correction = get_correction(cfg.correction)
    logprobs = logprobs.to(dtype)
    behaviour = behaviour_logprobs.detach().to(dtype)
    # naive / bypass: μ plays the old policy (no proximal forward needed) and ρ = 1
    anchor = behaviour if correction.anchor_is_behaviour else proximal_logprobs.detach().to(dtype)
    adv = advantages.detach().to(dtype)
    adv = adv.unsqueeze(1).expand_as(logprobs) if adv.dim() == 1 else adv
    adv = _masked_where(m, adv)

    # Trust-region ratio R = π_θ / anchor: per token, or GSPO's s_i = exp(mean_t log R_t) on every token of
    # answer i (the gradient of s_i reaches all of the answer's tokens).
    log_ratio = _masked_where(m, logprobs - anchor)
    if cfg.importance_sampling_level == "sequence":
        log_ratio = _answer_mean(log_ratio, m).expand_as(log_ratio)
    ratio = torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))

    # Mismatch ratio ρ = π_prox / μ in log space (0 where there is no proximal policy, and outside the mask).
    log_rho = _masked_where(m, anchor - behaviour)
    sequence_level = cfg.correction_level == "sequence" and correction.sequence_level
    applied = correction.fn(log_rho, cfg, sequence_level, m) if correction.uses_mask else \
        correction.fn(log_rho, cfg, sequence_level)
    weight = applied.weight
    truncated = applied.truncated if applied.truncated is not None else torch.zeros_like(m)
    rejected = applied.rejected if applied.rejected is not None else torch.zeros_like(m)
    eps_low, eps_high = cfg.epsilon_low, cfg.epsilon_high
    upper = torch.full_like(ratio, 1.0 + eps_high)
    if applied.upper_scale is not None:
        upper = upper * applied.upper_scale

    lower = 1.0 - eps_low
    clipped_ratio = torch.minimum(torch.maximum(ratio, torch.full_like(ratio, lower)), upper)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    if cfg.dual_clip > 0:
        # dual-clip PPO: for A < 0 the objective is bounded below by c·A, so a huge R on a bad answer cannot
        # produce an unbounded loss (no gradient through R where the bound binds)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, cfg.dual_clip * adv), surrogate)
    per_token = -weight.detach() * surrogate

    kl_ref = None
    if reference_logprobs is not None:
        ref_diff = _masked_where(m, reference_logprobs.detach().to(dtype) - logprobs).clamp(max=_MAX_LOG_RATIO)
        kl_ref = torch.exp(ref_diff) - ref_diff - 1.0  # k3 estimator of KL(π_θ‖π_ref): ≥ 0, low variance
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl_ref

    per_token = _masked_where(m, per_token)
    loss = _aggregate(per_token, m, cfg.aggregation, num_sequences, num_tokens, cfg.max_new_tokens)

    with torch.no_grad():
        metrics = _metrics(m, adv, ratio, lower, upper, weight, truncated, rejected, kl_ref,
                           sequence_level or applied.per_sequence, cfg.dual_clip, applied.metrics)
    return loss, metrics
