"""`quarl eval`: each dataset's usual instruction by default, the result and the per-problem completions saved;
`evaluate` reports per-problem records and a progress bar only when asked."""

import json
from types import SimpleNamespace

import pytest
import torch

from quarl.cli import EVAL_TEMPLATES, default_eval_template, main
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.loading import save_pretrained
from quarl.model.tiny import tiny_config, tiny_tokenizer
from quarl.rl.evaluate import evaluate
from quarl.tasks.datasets import Example
from quarl.tasks.rewards import math_reward


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny") / "model"
    save_pretrained(QuarlForCausalLM(tiny_config("llama")), tiny_tokenizer(), out)
    return out


@pytest.mark.parametrize("data,gold_format,answer,gold", [
    ("gsm8k", "gsm8k", "She sells 9 eggs at $2 each, 9 * 2 = 18.\n#### 18", "Janet ... = 18\n#### 18"),
    ("math500", "boxed", "So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("aime24", "plain", "Adding up gives 2 + 202 = 204, so \\boxed{204}", "204"),
])
def test_default_templates_ask_for_the_answer_the_reward_reads(data, gold_format, answer, gold):
    template = default_eval_template(data, gold_format)
    prompt = template.format(prompt="QUESTION")
    assert prompt.startswith("QUESTION\n") and "step by step" in prompt
    assert ("####" in prompt) == (gold_format == "gsm8k")
    assert ("\\boxed{}" in prompt) == (gold_format != "gsm8k")  # literal braces after format()
    assert math_reward(answer, gold, gold_format) == 1.0  # an answer in the instructed form scores


def test_arithmetic_asks_for_just_the_number():
    assert default_eval_template("arithmetic", "plain").format(prompt="3 + 4") == \
        "What is 3 + 4? Answer with just the number."


SHORT_GSM8K = [("Tom has 3 apples and buys 4 more. How many apples?", "3 + 4 = 7\n#### 7"),
               ("A box holds 6 pens. How many pens in 2 boxes?", "6 * 2 = 12\n#### 12"),
               ("Sam had 10 cards and gave away 1. How many are left?", "10 - 1 = 9\n#### 9")]


def test_eval_gsm8k_saves_result_and_completions(tiny_dir, tmp_path, capsys):
    # GSM8K in --data-dir's layout, with questions short enough for the tiny model's 256-token context
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    (tmp_path / "data" / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in SHORT_GSM8K))
    out = tmp_path / "res" / "gsm8k.json"
    rc = main(["eval", "--model", str(tiny_dir), "--data", "gsm8k", "--data-dir", str(tmp_path / "data"),
               "--limit", "3", "--max-new-tokens", "3", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out[captured.out.index("{"):])
    saved = json.loads(out.read_text())
    assert printed == saved
    assert saved["prompt_template"] == EVAL_TEMPLATES["gsm8k"] and saved["num_examples"] == 3.0
    samples = out.with_name("gsm8k.samples.jsonl")
    assert saved["samples"] == str(samples)
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(records) == 3
    for record, (question, answer) in zip(records, SHORT_GSM8K):
        assert question in record["prompt"] and 'output the final answer after "####"' in record["prompt"]
        assert record["gold"] == answer.rsplit("#### ", 1)[1]
        assert len(record["completions"]) == 1 and len(record["scores"]) == 1
        assert record["correct"] == (record["scores"][0] == 1.0)
        assert record["scores"][0] == math_reward(record["completions"][0], record["gold"], "gsm8k")
    assert saved["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / 3)
    assert "[quarl] loading" in captured.err and str(samples) in captured.err


def test_eval_quiet_and_an_explicit_template(tiny_dir, tmp_path, capsys):
    out = tmp_path / "plain"  # ".json" is added
    rc = main(["eval", "--model", str(tiny_dir), "--data", "arithmetic", "--limit", "2", "--max-new-tokens", "2",
               "--device", "cpu", "--out", str(out), "--prompt-template", "Q: {prompt} =", "--quiet"])
    assert rc == 0
    assert capsys.readouterr().err == ""
    saved = json.loads((tmp_path / "plain.json").read_text())
    assert saved["prompt_template"] == "Q: {prompt} ="
    first = json.loads((tmp_path / "plain.samples.jsonl").read_text().splitlines()[0])
    assert "Q: " in first["prompt"] and " =" in first["prompt"]


def test_eval_out_must_be_a_file(tiny_dir, tmp_path, capsys):
    rc = main(["eval", "--model", str(tiny_dir), "--data", "arithmetic", "--limit", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "is a folder" in err and "result.json" in err and len(err.strip().splitlines()) == 1


class _Engine:
    """Answers "N" for the k-th problem (the gold of even problems), a wrong number for odd ones."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, max_new_tokens, temperature, stop, progress=None, *, seeds):
        assert len(seeds) == len(prompts)
        self.calls.append(len(prompts))
        if progress is not None:
            progress(len(prompts))
        outs = []
        for p in prompts:
            k = int(p.split()[-1])
            text = str(k) if k % 2 == 0 else str(k + 100)
            outs.append(SimpleNamespace(completions=[SimpleNamespace(text=text)] * n))
        return outs


def _task():
    from quarl.config import DataSection, RewardSection
    from quarl.tasks.task import TaskData, make_renderer, make_reward

    examples = [Example(id=f"e{k}", prompt=f"number {k}", gold=str(k), gold_format="plain") for k in range(5)]
    reward, correct = make_reward(RewardSection())
    data = DataSection(chat_template=False)
    return TaskData(examples, examples, make_renderer(data, None), reward, correct), examples


def test_evaluate_records_and_progress(capsys):
    task, examples = _task()
    records = []
    engine = _Engine()
    result = evaluate(engine, task, examples, batch_prompts=2, records=records, progress=True, desc="held-out")
    assert engine.calls == [2, 2, 1]
    assert result["accuracy"] == pytest.approx(3 / 5)
    assert [r["id"] for r in records] == [f"e{k}" for k in range(5)]
    assert [r["correct"] for r in records] == [True, False, True, False, True]
    assert records[1] == {"id": "e1", "prompt": "number 1", "gold": "1", "completions": ["101"],
                          "scores": [0.0], "correct": False}
    err = capsys.readouterr().err
    assert "held-out" in err and "0/5 [" in err  # tqdm draws the start at once, later states when 0.1 s passed
    evaluate(_Engine(), task, examples, progress=False)
    assert capsys.readouterr().err == ""
