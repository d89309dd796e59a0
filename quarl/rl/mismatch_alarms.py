"""Mismatch alarms: one warning, with what to try, when a mismatch metric drifts past its threshold.

The metrics users watch (BRIEF §6) drift slowly before a low-precision run collapses (QuRL saw KL(μ‖π_prox) grow
from 0.002 to 0.025 over 1000+ steps), while a single step's value is noisy (a run averaging 0.010 logged steps of
0.001 to 0.026). So what is compared with a metric's threshold is its mean over the last `window` steps, from the
step that fills the window on; an alarm fires when that mean stays above the threshold for `patience` consecutive
steps, once per metric and run, naming the mean, the threshold and the remedies that fit the run's config (a
rejecting correction, a finer format, the unified flow, the error-token guard).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass


@dataclass
class AlarmConfig:
    """`alarms.*` config keys: thresholds per metric (0 = that alarm off) and the steps a drift must last."""

    enabled: bool = True  # false: no mismatch alarm at all
    # mismatch/kl (k1 KL(μ‖π_prox) per token). On B6 the smoothed INT8 default averaged 0.014 and kept level with
    # bf16; the settings averaging 0.022 or more ended over 2 points behind in all but one entry (qlora with AQN,
    # whose noise is the point, averaged 0.0185). QuRL's collapse began near 0.01-0.025.
    kl: float = 0.02
    truncated_frac: float = 0.1  # is/truncated_frac: share of tokens whose weight was truncated (ρ > is_cap)
    masked_frac: float = 0.3  # is/masked_frac: share of tokens a rejecting correction dropped
    error_frac: float = 0.05  # error/flagged_frac: share of answers flagged as loops / log-ratio spikes
    window: int = 20  # steps whose mean is compared with each threshold, once that many (1: each step's value)
    patience: int = 3  # consecutive steps with that mean above the threshold before the warning

    def validate(self) -> "AlarmConfig":
        """ValueError naming the key when a threshold is negative or not finite, or patience or window < 1."""
        for key in ("kl", "truncated_frac", "masked_frac", "error_frac"):
            value = getattr(self, key)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"alarms.{key}={value} must be a finite number >= 0 (0 turns this alarm off)")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"alarms.patience={self.patience!r} must be an int >= 1 (steps above the threshold)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"alarms.window={self.window!r} must be an int >= 1 (steps averaged; 1: no averaging)")
        return self


ALARM_METRICS = {"kl": "mismatch/kl", "truncated_frac": "is/truncated_frac", "masked_frac": "is/masked_frac",
                 "error_frac": "error/flagged_frac"}


# The keys that widen each rejecting correction's acceptance band (docs/CORRECTIONS.md).
BAND_KEYS = {"geo_mask": "loss.geo_high / loss.geo_low", "seq_mask_tis": "loss.geo_high / loss.geo_low",
             "tbpo": "loss.tbpo_band", "mis": "loss.mis_high / loss.mis_low",
             "icepop": "loss.icepop_high / loss.icepop_low"}


# A finer rollout format than each, where one is (bench/results/mismatch.md, SmolLM2-135M): FP8 with per-channel or
# per-tensor scales -> FP8-block (the same elements, scales per 128-block); FP4 -> INT8 (smoothed by default).
# INT8 and FP8-block have none: smoothed INT8 W8A8 is below FP8-block's mismatch, FP8-block below unsmoothed INT8's.
FINER_FORMAT = {"fp8": "fp8-block", "fp8-tensor": "fp8-block", "nvfp4": "int8", "mxfp4": "int8"}


def _advice(key: str, run_cfg, hidden_size: int | None = None) -> str:
    """What to try, given the run config (a RunConfig, or None for generic advice) and the model's hidden size (None
    = unknown), which decides whether the unified flow quantizes activations by default."""
    precision = getattr(run_cfg, "precision", None)
    flow = getattr(precision, "flow", None)
    fmt = getattr(precision, "resolved_format", None) or getattr(precision, "format", None)
    # 'precision.format=X instead of Y' where a finer rollout format than the configured one exists
    finer = f"precision.format={FINER_FORMAT[fmt]} instead of {fmt}" if fmt in FINER_FORMAT else None
    loss = getattr(run_cfg, "loss", None)
    correction = getattr(loss, "correction", None)
    tips = []
    if key in ("kl", "truncated_frac"):
        if correction not in ("mis", "tbpo", "icepop", "geo_mask", "seq_mask_tis"):
            tips.append("a correction that rejects the off-policy answers instead of truncating them "
                        "(loss.correction=tbpo, mis or icepop)")
        if key == "truncated_frac" and correction in ("tis", "acr", "ais", "seq_mask_tis"):
            tips.append(f"a larger loss.is_cap (now {getattr(loss, 'is_cap', '?')})")
        if flow == "split" and finer:
            tips.append(f"a finer rollout format ({finer})")
        if flow == "split" and fmt == "int8" \
                and not getattr(precision, "resolved_smooth_alpha", getattr(precision, "smooth_alpha", 1.0)) \
                and getattr(precision, "resolved_weight_only", True) is False:
            tips.append("smoothing the activations' outlier channels (precision.smooth_alpha=0.5, SmoothQuant)")
        weight_only = getattr(precision, "resolved_weight_only_at", None)
        if flow in ("split", "unified") and weight_only is not None and not weight_only(hidden_size):
            tips.append("weight-only quantization (precision.weight_only=true: activations stay in the compute "
                        "dtype; `quarl bench mismatch` measures each format both ways on your model)")
        if flow in ("split", None):
            tips.append("the unified flow (precision.flow=unified: training sees the rollout's quantizer, so the "
                        "mismatch is kernels only)")
    elif key == "masked_frac":
        band = BAND_KEYS.get(correction, "loss.geo_high, loss.tbpo_band, loss.mis_high or loss.icepop_high")
        tips.append(f"a wider acceptance band ({band}, for loss.correction={correction})")
        if flow in ("split", None):
            tips.append(f"less mismatch ({finer + ', or ' if finer else ''}precision.flow=unified)")
    else:  # error_frac
        if getattr(loss, "error_token_guard", "off") == "off":
            tips.append("loss.error_token_guard=mask (or drop) so flagged answers are not trained on")
        if flow in ("split", None):
            tips.append(f"{'a finer rollout format (' + finer + ') or ' if finer else ''}the unified flow (loops "
                        "are a symptom of a lossy rollout model)")
    if not tips:  # already rejecting, already unified: the mismatch should be kernels only
        tips.append("checking that rollout and training quantize every linear (and the KV cache) the same way: a "
                    "layer left in another precision on one side raises the mismatch")
    return "; or ".join(tips)


class MismatchAlarms:
    """Tracks the step metrics and warns once per metric when it drifts past its threshold.

    Call `check(step, metrics)` after each step with the step's metrics dict (python floats); it returns the
    messages warned at this step (also issued as UserWarning). A missing or NaN metric breaks the streak and empties
    its window, which must fill again before the metric is compared.
    """

    def __init__(self, cfg: AlarmConfig | None = None, run_cfg=None, hidden_size: int | None = None):
        self.cfg = (cfg or AlarmConfig()).validate()
        self.run_cfg = run_cfg
        self.hidden_size = hidden_size  # the model's: the unified flow's default weight_only depends on it
        self.streak = {key: 0 for key in ALARM_METRICS}
        self.recent = {key: deque(maxlen=self.cfg.window) for key in ALARM_METRICS}  # the metric's last values
        self.fired: set[str] = set()

    def check(self, step: int, metrics: dict) -> list[str]:
        if not self.cfg.enabled:
            return []
        messages = []
        for key, name in ALARM_METRICS.items():
            threshold = getattr(self.cfg, key)
            value, recent = metrics.get(name), self.recent[key]
            if isinstance(value, (int, float)) and not math.isnan(value):  # +inf counts: it is above any threshold
                recent.append(float(value))
            else:
                recent.clear()
            full = len(recent) == self.cfg.window
            mean = sum(recent) / len(recent) if full else 0.0
            above = threshold > 0 and full and mean > threshold
            self.streak[key] = self.streak[key] + 1 if above else 0
            if above and self.streak[key] >= self.cfg.patience and key not in self.fired:
                self.fired.add(key)
                what = f"{name}={mean:.4g}" if self.cfg.window == 1 else \
                    f"{name}'s mean over the last {self.cfg.window} steps ({mean:.4g})"
                msg = (f"step {step}: {what} has been above alarms.{key}={threshold:g} for "
                       f"{self.streak[key]} steps; try {_advice(key, self.run_cfg, self.hidden_size)} "
                       "(docs/CORRECTIONS.md)")
                warnings.warn(msg, UserWarning, stacklevel=2)
                messages.append(msg)
        return messages
