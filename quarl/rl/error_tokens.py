"""Error answers of a low-precision rollout: garbled repetition loops and extreme per-token log-ratios (QaRL).

A quantized rollout model sometimes falls into a loop ("the the the ...", a phrase repeated to the length limit)
or samples a token the training-precision policy finds hundreds of times less likely. Such answers carry a
reward signal about the quantization error, not about the task; QaRL calls their tokens error tokens. Two pure
tests flag an answer:

* loop: some n-gram (1 ≤ n ≤ max_ngram) repeats back to back at least `min_repeats` times, and the repeated
  stretch covers at least `min_tokens` tokens. With e_n[t] = (y_t == y_{t+n}) over counted tokens, a stretch of
  k copies of an n-gram is a run of n·(k − 1) consecutive true e_n; the stretch is that run + n tokens long.
* spike: some counted token has |log μ_t − log π_prox,t| > max_abs_log_ratio.

`loss.error_token_guard` (off | mask | drop) decides what the trainer does with flagged answers: off reports the
metrics only, mask gives them loss weight 0 (they still count as answers in the per-answer denominators, like
an overlong-masked answer), drop removes them from the batch before the update.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

ERROR_KEYS = ("error/flagged_frac", "error/loop_frac", "error/spike_frac")


@dataclass
class ErrorFlags:
    """Per-answer flags, bool [B] each: loop, spike (None when no π_prox was available), flagged = either."""

    loop: Tensor
    spike: Tensor | None
    flagged: Tensor


def _longest_true_run(x: Tensor) -> Tensor:
    """[B] int64: the longest run of consecutive True along dim 1 of a bool [B, T] tensor (0 for none)."""
    if x.shape[1] == 0:
        return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    idx = torch.arange(x.shape[1], device=x.device).expand_as(x)
    last_false = torch.cummax(torch.where(x, torch.full_like(idx, -1), idx), dim=1).values
    return torch.where(x, idx - last_false, torch.zeros_like(idx)).amax(dim=1)


def repetition_loops(token_ids: Tensor, mask: Tensor, max_ngram: int = 16, min_repeats: int = 4,
                     min_tokens: int = 16) -> Tensor:
    """Answers that contain a back-to-back repeated n-gram loop.

    Args:
        token_ids: [B, T] int, the sampled token ids, aligned with `mask`.
        mask: [B, T] bool or 0/1 float; 1 = a counted answer token (an answer's tokens are contiguous).
        max_ngram: longest n-gram length tested (n = 1 .. max_ngram).
        min_repeats: copies of the n-gram needed (≥ 2).
        min_tokens: tokens the repeated stretch must cover, so a short legitimate repetition ("1000") passes.
    Returns:
        [B] bool, True where some n satisfies run_n ≥ n·(min_repeats − 1) and run_n + n ≥ min_tokens, run_n being
        the longest run of t with y_t == y_{t+n}, both counted.
    """
    if token_ids.shape != mask.shape or token_ids.dim() != 2:
        raise ValueError(f"token_ids and mask must share one [B, T] shape; got {tuple(token_ids.shape)} and "
                         f"{tuple(mask.shape)}")
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    flagged = torch.zeros(token_ids.shape[0], dtype=torch.bool, device=token_ids.device)
    for n in range(1, min(max_ngram, token_ids.shape[1] - 1) + 1):
        same = (token_ids[:, :-n] == token_ids[:, n:]) & m[:, :-n] & m[:, n:]
        run = _longest_true_run(same)
        flagged |= (run >= n * (min_repeats - 1)) & (run + n >= min_tokens)
    return flagged


def log_ratio_spikes(behaviour_logprobs: Tensor, proximal_logprobs: Tensor, mask: Tensor,
                     max_abs_log_ratio: float) -> Tensor:
    """[B] bool: answers with a counted token where |log μ − log π_prox| > max_abs_log_ratio (inputs [B, T] float,
    mask [B, T] bool or 0/1). NaN/Inf differences count as spikes: such a token is an error by any measure."""
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    d = (behaviour_logprobs.detach().double() - proximal_logprobs.detach().double()).abs()
    bad = (d > max_abs_log_ratio) | ~torch.isfinite(d)
    return (bad & m).any(dim=1)


def flag_error_answers(token_ids: Tensor, mask: Tensor, behaviour_logprobs: Tensor | None,
                       proximal_logprobs: Tensor | None, cfg) -> ErrorFlags:
    """Both tests with the thresholds of a LossConfig (`error_loop_*`, `error_max_abs_log_ratio`; 0 = no spike
    test). The spike test needs π_prox: without it (bypass) only loops are flagged. Shapes as in the tests above."""
    loop = repetition_loops(token_ids, mask, cfg.error_loop_max_ngram, cfg.error_loop_min_repeats,
                            cfg.error_loop_min_tokens)
    spike = None
    if proximal_logprobs is not None and behaviour_logprobs is not None and cfg.error_max_abs_log_ratio > 0:
        spike = log_ratio_spikes(behaviour_logprobs, proximal_logprobs, mask, cfg.error_max_abs_log_ratio)
    return ErrorFlags(loop, spike, loop | spike if spike is not None else loop)


def error_metrics(flags: ErrorFlags, mask: Tensor) -> dict[str, float]:
    """Fractions of the answers with counted tokens that are flagged (loop, spike, either); "error/spike_frac" only
    when the spike test ran. Empty batches report 0."""
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    rows = m.any(dim=1)
    n = max(int(rows.sum()), 1)
    out = {"error/flagged_frac": float((flags.flagged & rows).sum()) / n,
           "error/loop_frac": float((flags.loop & rows).sum()) / n}
    if flags.spike is not None:
        out["error/spike_frac"] = float((flags.spike & rows).sum()) / n
    return out


def guard_error_answers(batch, cfg, proximal: Tensor | None = None, *aligned: Tensor | None):
    """Apply loss.error_token_guard to a RolloutBatch (quarl.rl.batch) before the update.

    Args:
        batch: the step's RolloutBatch; its answer token ids are input_ids[:, 1:] (column t of the [B, T-1]
            tensors scores token t+1).
        cfg: the LossConfig (error_token_guard and the thresholds).
        proximal: [B, T-1] float log π_prox or None (then only loops are tested).
        aligned: more [B, T-1] tensors (or None) laid out like the batch (reference log-probs, entropy) that must
            follow a drop.
    Returns:
        (batch, proximal, *aligned, metrics): unchanged for guard "off"; for "mask" the flagged rows' answer_mask
        is zeroed; for "drop" the flagged rows are removed (every tensor trimmed like RolloutBatch.select); when
        every answer is flagged, "drop" masks instead (an empty batch has no layout). metrics: `error_metrics`.
    """
    flags = flag_error_answers(batch.input_ids[:, 1:], batch.answer_mask, batch.behaviour_logprobs, proximal, cfg)
    metrics = error_metrics(flags, batch.answer_mask)
    flagged = flags.flagged.cpu()
    guard = cfg.error_token_guard
    if guard == "off" or not bool(flagged.any()):
        return (batch, proximal, *aligned, metrics)
    if guard == "drop" and not bool(flagged.all()):
        keep = torch.nonzero(~flagged).flatten()
        new = batch.select(keep)
        width = new.answer_mask.shape[1]
        trim = lambda t: None if t is None else t[keep.to(t.device)][:, -width:]  # noqa: E731
        return (new, trim(proximal), *(trim(t) for t in aligned), metrics)
    answer_mask = batch.answer_mask.clone()
    answer_mask[flagged] = 0
    return (dataclasses.replace(batch, answer_mask=answer_mask), proximal, *aligned, metrics)
