"""`quarl bench mismatch`: the per-token KL between a rollout copy and the full-precision model, checked against a
float64 computation, the answer positions it is taken at, and the command end to end on a tiny random model."""

import math

import pytest
import torch

from quarl.bench import mismatch
from quarl.cli import main


def test_token_kl_matches_a_float64_sum_over_the_vocabulary():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    mu = torch.log_softmax(torch.randn(7, 49152 // 64, generator=g) * 3, -1)
    pi = torch.log_softmax(torch.randn(7, 49152 // 64, generator=g) * 3, -1)
    got = mismatch.token_kl(mu, pi)
    p, q = mu.double().exp(), pi.double().exp()
    want = [sum(p[i, v].item() * math.log(p[i, v].item() / q[i, v].item()) for v in range(p.shape[1]))
            for i in range(p.shape[0])]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-6)
    assert (mismatch.token_kl(mu, mu).abs() < 1e-6).all()  # KL of a distribution to itself


def test_zero_probability_under_the_rollout_adds_nothing():
    mu = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    pi = torch.log(torch.tensor([[0.25, 0.25, 0.5]]))
    assert mismatch.token_kl(mu, pi).item() == pytest.approx(math.log(2), rel=1e-6)


def test_answer_positions_are_the_ones_that_predict_answer_tokens():
    ids, mask, predicts = mismatch.answer_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7, 1, 2], [0, 8, 3, 4, 9]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    # row 0: positions 2 (-> 1) and 3 (-> 2); row 1: positions 1, 2, 3 (-> 3, 4, 9)
    assert predicts.tolist() == [[False, False, True, True, False], [False, True, True, True, False]]


def test_settings_and_bad_formats():
    assert mismatch.settings_to_measure(["int8", "nvfp4"], "both") == [("int8", False), ("int8", True),
                                                                      ("nvfp4", True)]
    assert mismatch.settings_to_measure(["nvfp4"], "quantized") == [("nvfp4", True)]  # W4A16 is all fp4 has
    with pytest.raises(ValueError, match="choose a comma list"):
        mismatch.parse_formats("int8,int4")


def test_the_command_scores_every_format_and_writes_its_entry(tmp_path, monkeypatch):
    rows = {}
    real_measure = mismatch.measure

    def spy(cfg, pairs, problems, seed=0, log=print, smooth_alpha=0.0):
        result = real_measure(cfg, pairs, problems, seed, log, smooth_alpha=smooth_alpha)
        rows["result"] = result
        return result

    monkeypatch.setattr(mismatch, "measure", spy)
    out = tmp_path / "mismatch.md"
    rc = main(["bench", "mismatch", "model.name=tiny-random-llama", "data.num_eval=6", "rollout.max_new_tokens=6",
               "--problems", "6", "--formats", "int8,fp8-block", "--smooth-alpha", "0.5", "--out", str(out)])
    assert rc == 0
    result = rows["result"]
    assert [(r["format"], r["weight_only"], r["smooth_alpha"]) for r in result["rows"]] == [
        ("int8", False, 0.0), ("int8", True, 0.0), ("fp8-block", False, 0.0), ("fp8-block", True, 0.0),
        ("int8", False, 0.5), ("fp8-block", False, 0.5)]  # the W8A8 settings again, smoothed
    kl = {(r["format"], r["weight_only"], r["smooth_alpha"]): r["kl_mean"] for r in result["rows"]}
    assert kl[("int8", False, 0.5)] != kl[("int8", False, 0.0)]  # the smoothed rows measured a smoothed copy
    for r in result["rows"]:
        assert r["kl_mean"] >= 0 and r["kl_p90"] <= r["kl_max"] + 1e-12 and 0 <= r["top1_agree"] <= 1
    text = out.read_text()
    assert "| int8 | quantized |" in text and "| fp8-block | weight-only |" in text and "model tiny-random-llama" in text
    assert "| int8 | quantized, smoothed (alpha 0.5) |" in text


def test_measure_equals_a_hand_built_comparison():
    """The KL the bench reports for int8 W8A8 equals one computed here from a second copy of the model."""
    from quarl.config import load_config
    from quarl.model.loading import load_model
    from quarl.model.precision_apply import apply_precision, rollout_mode
    from quarl.precision import PrecisionConfig
    from quarl.rollout.engine import RolloutEngine
    from quarl.tasks.task import load_task

    cfg = load_config(None, ["model.name=tiny-random-llama", "data.num_eval=4", "rollout.max_new_tokens=5",
                             "model.device=cpu"])
    torch.manual_seed(0)
    got = mismatch.measure(cfg, [("int8", False)], problems=4, seed=3, log=lambda *_: None)["rows"][0]

    torch.manual_seed(0)
    task = load_task(cfg.data, cfg.reward, None, seed=cfg.train.seed)
    model, tok = load_model("tiny-random-llama", device="cpu", dtype=torch.float32)
    task.set_tokenizer(tok)
    outs = RolloutEngine(model.eval(), tok).generate([task.render(e) for e in task.eval_examples[:4]], n=1,
                                                     max_new_tokens=5, temperature=cfg.rollout.temperature, seed=3)
    kl_sum, count = 0.0, 0
    q_model = load_model("tiny-random-llama", device="cpu", dtype=torch.float32)[0].eval()
    apply_precision(q_model, PrecisionConfig(flow="split", format="int8").validate())
    for o in outs:
        seq = torch.tensor([o.prompt_token_ids + o.completions[0].token_ids])
        n = len(o.completions[0].token_ids)
        with torch.no_grad():
            pi = torch.log_softmax(model(seq).double()[0, -n - 1:-1] / cfg.rollout.temperature, -1)
            with rollout_mode(q_model):
                mu = torch.log_softmax(q_model(seq).double()[0, -n - 1:-1] / cfg.rollout.temperature, -1)
        kl_sum += (mu.exp() * (mu - pi)).sum().item()
        count += n
    assert got["kl_mean"] == pytest.approx(kl_sum / count, rel=2e-3, abs=1e-7)
