"""Error answers (QaRL): repetition loops over token ids and per-token log-ratio spikes, the metrics, and the
mask / drop guard acting on a deliberately corrupted rollout."""

import pytest
import torch

from quarl.rl.batch import build_batch
from quarl.rl.error_tokens import (
    flag_error_answers, guard_error_answers, log_ratio_spikes, repetition_loops,
)
from quarl.rl.objectives import LossConfig, policy_loss


def _loop_by_brute_force(ids, max_ngram, min_repeats, min_tokens):
    """Any start s and n-gram length n whose periodic stretch (ids[j] == ids[j - n] from s + n on, a trailing
    partial copy included) holds ≥ min_repeats whole copies and covers ≥ min_tokens tokens."""
    for n in range(1, max_ngram + 1):
        for s in range(len(ids)):
            end = s + n
            while end < len(ids) and ids[end] == ids[end - n]:
                end += 1
            if end > len(ids):
                continue
            if (end - s) // n >= min_repeats and end - s >= min_tokens:
                return True
    return False


def test_repetition_loops_match_brute_force_on_random_answers():
    g = torch.Generator().manual_seed(0)
    rows, agree = [], 0
    for i in range(200):
        vocab = int(torch.randint(2, 6, (1,), generator=g))  # tiny vocabularies make repeats common
        length = int(torch.randint(1, 30, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        if i % 4 == 0:  # plant a loop
            period = int(torch.randint(1, 5, (1,), generator=g))
            ids = ids[:3] + ids[3:3 + period] * 8
        rows.append(ids)
    width = max(len(r) for r in rows)
    tok = torch.full((len(rows), width), -1, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):  # answers right-aligned like a RolloutBatch
        tok[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = True
    for params in [(4, 4, 8), (3, 3, 6), (1, 6, 6), (5, 2, 7), (16, 4, 16)]:
        got = repetition_loops(tok, mask, *params)
        want = torch.tensor([_loop_by_brute_force(r, *params) for r in rows])
        assert torch.equal(got, want), params
        agree += int(want.sum())
    assert agree > 20  # the planted loops were found (the comparison is not vacuous)


def test_short_legitimate_repetition_is_not_a_loop():
    ids = torch.tensor([[5, 1, 0, 0, 0, 2, 7, 7, 9, 3, 4, 3, 4, 8]])
    assert not repetition_loops(ids, torch.ones_like(ids, dtype=torch.bool)).item()
    # padding (outside the mask) repeating the pad id never counts
    pad = torch.cat([torch.zeros(1, 40, dtype=torch.long), ids], dim=1)
    m = torch.cat([torch.zeros(1, 40, dtype=torch.bool), torch.ones_like(ids, dtype=torch.bool)], dim=1)
    assert not repetition_loops(pad, m).item()
    assert repetition_loops(pad, torch.ones_like(m)).item()


def test_log_ratio_spikes():
    beh = torch.zeros(3, 4)
    prox = torch.zeros(3, 4)
    prox[1, 2] = -6.5  # π_prox 665x below μ
    prox[2, 0] = -9.0  # outside the mask: ignored
    mask = torch.ones(3, 4)
    mask[2, 0] = 0
    assert log_ratio_spikes(beh, prox, mask, 6.0).tolist() == [False, True, False]
    assert log_ratio_spikes(beh, prox, mask, 7.0).tolist() == [False, False, False]
    prox[0, 1] = float("nan")
    assert log_ratio_spikes(beh, prox, mask, 7.0).tolist() == [True, False, False]


def _corrupted_rollout():
    """8 answers to 2 prompts; answer 1 is a garbled loop ("12 34 56" x 8), answer 5 has one token that the
    training policy finds e^8 times less likely than the quantized rollout did."""
    g = torch.Generator().manual_seed(1)
    prompts = [[1, 2, 3]] * 4 + [[4, 5]] * 4
    answers = [torch.randint(100, 200, (int(n),), generator=g).tolist() for n in (5, 24, 7, 6, 9, 4, 8, 3)]
    answers[1] = [12, 34, 56] * 8
    beh = [(-torch.rand(len(a), generator=g)).tolist() for a in answers]
    batch = build_batch(prompts, answers, beh, [True] * 8, torch.randn(8, generator=g), torch.zeros(8),
                        [0] * 4 + [1] * 4, pad_id=0)
    prox = batch.behaviour_logprobs + 0.01 * torch.randn(batch.behaviour_logprobs.shape, generator=g)
    prox = prox * batch.answer_mask
    prox[5, -2] = batch.behaviour_logprobs[5, -2] - 8.0
    return batch, prox


def test_flags_and_metrics_on_a_corrupted_rollout():
    batch, prox = _corrupted_rollout()
    cfg = LossConfig().validate()
    flags = flag_error_answers(batch.input_ids[:, 1:], batch.answer_mask, batch.behaviour_logprobs, prox, cfg)
    assert flags.loop.tolist() == [i == 1 for i in range(8)]
    assert flags.spike.tolist() == [i == 5 for i in range(8)]
    _, _, metrics = guard_error_answers(batch, cfg, prox)
    assert metrics == {"error/flagged_frac": 2 / 8, "error/loop_frac": 1 / 8, "error/spike_frac": 1 / 8}
    # without π_prox (bypass) only the loop test runs
    _, _, metrics = guard_error_answers(batch, cfg, None)
    assert metrics == {"error/flagged_frac": 1 / 8, "error/loop_frac": 1 / 8}


def test_guard_off_mask_drop():
    batch, prox = _corrupted_rollout()
    ent = torch.rand(batch.behaviour_logprobs.shape)
    off = guard_error_answers(batch, LossConfig().validate(), prox, ent)
    assert off[0] is batch and off[1] is prox and off[2] is ent
    new, p, e, _ = guard_error_answers(batch, LossConfig(error_token_guard="mask").validate(), prox, ent)
    assert len(new) == 8 and new.answer_mask[[1, 5]].sum() == 0
    torch.testing.assert_close(new.answer_mask[[0, 2, 3, 4, 6, 7]], batch.answer_mask[[0, 2, 3, 4, 6, 7]])
    new, p, e, _ = guard_error_answers(batch, LossConfig(error_token_guard="drop").validate(), prox, ent)
    keep = [0, 2, 3, 4, 6, 7]
    assert len(new) == 6 and new.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    w = new.answer_mask.shape[1]
    assert w < batch.answer_mask.shape[1]  # the 24-token loop was the longest row: the batch got narrower
    torch.testing.assert_close(p, prox[keep][:, -w:])
    torch.testing.assert_close(e, ent[keep][:, -w:])
    torch.testing.assert_close(new.behaviour_logprobs, batch.behaviour_logprobs[keep][:, -w:])


@pytest.mark.parametrize("guard", ["mask", "drop"])
def test_guard_changes_the_loss_like_removing_the_answers(guard):
    """The guarded loss equals the loss with the flagged answers' tokens removed by hand (token-mean: both guards;
    seq-mean: drop shrinks the answer count, mask keeps it)."""
    batch, prox = _corrupted_rollout()
    cfg = LossConfig(loss_type="dapo", correction="tis", error_token_guard=guard).validate()
    lp = prox + 0.05
    full, _ = policy_loss(lp, prox, batch.behaviour_logprobs, batch.advantages, batch.answer_mask, cfg)
    new, p, lp_new, _ = guard_error_answers(batch, cfg, prox, lp)
    got, _ = policy_loss(lp_new, p, new.behaviour_logprobs, new.advantages, new.answer_mask, cfg)
    m = batch.answer_mask.clone()
    m[[1, 5]] = 0
    want, _ = policy_loss(lp, prox, batch.behaviour_logprobs, batch.advantages, m, cfg)
    torch.testing.assert_close(got, want)
    assert abs(got.item() - full.item()) > 1e-4  # the corrupted answers did move the loss


def test_drop_with_every_answer_flagged_masks_instead():
    batch, prox = _corrupted_rollout()
    cfg = LossConfig(error_token_guard="drop", error_max_abs_log_ratio=1e-9).validate()  # every token spikes
    new, _, metrics = guard_error_answers(batch, cfg, prox)
    assert len(new) == 8 and new.answer_mask.sum() == 0 and metrics["error/flagged_frac"] == 1.0
