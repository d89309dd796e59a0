"""Rollout batches: left-padded layout, answer columns, and answer log-probs equal to the model's own scoring."""

import torch

from quarl.model.decoder import QuarlForCausalLM
from quarl.model.tiny import tiny_config
from quarl.rl.batch import answer_logprobs, build_batch


def test_layout_and_logprobs_match_a_per_row_float64_reference():
    torch.manual_seed(0)
    model = QuarlForCausalLM(tiny_config("qwen3")).double()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    answers = [[20, 21], [22, 23, 24, 25], [26]]
    behaviour = [[-0.5, -0.25], [-1.0, 0.0, -2.0, -3.0], [-0.75]]  # 0.0 is a legal log-prob
    batch = build_batch(prompts, answers, behaviour, counts=[True, True, False],
                        advantages=torch.tensor([1.0, -1.0, 0.5]), rewards=torch.tensor([1.0, 0.0, 0.5]),
                        group_index=[0, 0, 1], pad_id=0)
    T = 9  # longest row: 5 + 4
    assert batch.input_ids.shape == (3, T) and batch.answer_width == 4
    assert batch.input_ids[0].tolist() == [0, 0, 0, 0, 5, 6, 7, 20, 21]  # left padding, rows end together
    assert batch.attention_mask.sum(1).tolist() == [5, 9, 2]
    assert batch.behaviour_logprobs[1, -4:].tolist() == behaviour[1]
    assert batch.answer_mask.sum(1).tolist() == [2.0, 4.0, 0.0]  # row 2 does not count (counts=False)
    sub = batch.select([0, 2])  # trimmed on the left to the longest selected row
    assert sub.input_ids.shape == (2, 5) and sub.answer_width == 2

    temperature = 0.7
    got, entropy = answer_logprobs(model, batch.input_ids, batch.attention_mask, temperature, batch.answer_width,
                                   with_entropy=True)
    assert got.shape == (3, 4) and entropy.shape == (3, 4)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids = torch.tensor([p + a])
        logp = torch.log_softmax(model(ids)[0, :-1] / temperature, dim=-1)
        ref = logp[torch.arange(len(p) + len(a) - 1), ids[0, 1:]][-len(a):]
        torch.testing.assert_close(got[i, -len(a):], ref, atol=1e-10, rtol=0)
