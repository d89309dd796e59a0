"""load_examples (benchmarks, shipped samples, jsonl/json/parquet, hub) and the synthetic arithmetic task."""

import json
import os
import sys
import types

import pytest

from quarl.tasks.datasets import SAMPLES_DIR, Example, detect_gold_format, load_examples
from quarl.tasks.rewards import extract_gsm8k_gold, math_reward
from quarl.tasks.synthetic import arithmetic_examples, arithmetic_splits


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


# ----------------------------------------------------------------------------------------------------------
# benchmarks


def test_gsm8k_full_splits(shared_data_dir):
    for split, n in (("train", 7473), ("test", 1319)):
        examples = load_examples("gsm8k", split, data_dir=shared_data_dir)
        assert len(examples) == n
        raw = json.loads(_lines(os.path.join(shared_data_dir, "gsm8k", f"{split}.jsonl"))[0])
        first = examples[0]
        assert first.prompt == raw["question"] and first.meta["solution"] == raw["answer"]
        assert first.gold == extract_gsm8k_gold(raw["answer"]) and first.gold_format == "gsm8k"
        assert first.id == f"gsm8k-{split}-0" and len({e.id for e in examples}) == n


def test_math500_and_aime24(shared_data_dir):
    math500 = load_examples("math500", "test", data_dir=shared_data_dir)
    assert len(math500) == 500 and all(e.gold_format == "boxed" for e in math500)
    assert math500[0].id == "test/precalculus/807.json" and "solution" in math500[0].meta
    aime = load_examples("aime24", "test", data_dir=shared_data_dir, limit=5)
    assert len(aime) == 5 and aime[0].gold == "204" and aime[0].gold_format == "plain" and aime[0].id == "60"
    assert aime[0].prompt.startswith("Every morning Aya")
    # golds are consistent with the rewards: the gold scores 1 against itself in boxed form
    assert all(math_reward(f"\\boxed{{{e.gold}}}", e.gold, e.gold_format) == 1.0 for e in math500[:20] + aime)


def test_data_dir_from_environment(shared_data_dir, monkeypatch):
    monkeypatch.setenv("QUARL_DATA_DIR", shared_data_dir)
    assert len(load_examples("math500", "test", limit=3)) == 3


def test_benchmark_errors(tmp_path):
    with pytest.raises(ValueError, match=r"split\(s\) \('test',\)"):
        load_examples("math500", "train", data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="math500/test.jsonl"):
        load_examples("math500", "test", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="gold_format"):
        load_examples("gsm8k", gold_format="latex")
    with pytest.raises(ValueError, match="limit"):
        load_examples("gsm8k", limit=-1)


def test_falls_back_to_shipped_gsm8k_samples_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.delenv("QUARL_DATA_DIR", raising=False)
    with pytest.warns(UserWarning, match="sample shipped with quarl"):
        train = load_examples("gsm8k", "train")
    with pytest.warns(UserWarning, match="not found"):
        test = load_examples("gsm8k", "test", data_dir=str(tmp_path), limit=7)
    assert len(train) == 200 and len(test) == 7
    assert all(isinstance(e, Example) and e.gold_format == "gsm8k" for e in train + test)


def test_shipped_samples_are_verbatim_and_licensed(shared_data_dir):
    for name, n in (("train", 200), ("test", 100)):
        sample = _lines(os.path.join(SAMPLES_DIR, f"gsm8k_{name}_sample.jsonl"))
        full = _lines(os.path.join(shared_data_dir, "gsm8k", f"{name}.jsonl"))
        assert sample == full[:n]
    with open(os.path.join(SAMPLES_DIR, "GSM8K_LICENSE"), encoding="utf-8") as a, \
            open(os.path.join(shared_data_dir, "gsm8k", "LICENSE"), encoding="utf-8") as b:
        assert a.read() == b.read()


# ----------------------------------------------------------------------------------------------------------
# local files


RECORDS = [
    {"q": "What is 2+2?", "a": "4", "uid": "x1", "level": 1},
    {"q": "Simplify 2/4.", "a": "\\frac{1}{2}", "uid": "x2", "level": 2},
    {"q": "Tom has 3 apples...", "a": "He has 3+1=4\n#### 4", "uid": "x3", "level": 1},
]


def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_with_custom_fields_and_format_detection(tmp_path):
    path = _write_jsonl(tmp_path / "custom.jsonl", RECORDS)
    examples = load_examples(path, prompt_field="q", answer_field="a")
    assert [e.prompt for e in examples] == [r["q"] for r in RECORDS]
    assert [e.gold for e in examples] == ["4", "\\frac{1}{2}", "4"]
    assert [e.gold_format for e in examples] == ["plain", "boxed", "gsm8k"]
    assert [e.id for e in examples] == ["x1", "x2", "x3"]  # "uid" detected as the id
    assert examples[0].meta == {"uid": "x1", "level": 1}
    assert examples[2].meta["solution"] == RECORDS[2]["a"]
    forced = load_examples(path, prompt_field="q", answer_field="a", gold_format="boxed", limit=2)
    assert len(forced) == 2 and all(e.gold_format == "boxed" for e in forced)


def test_auto_detected_fields_json_and_chat_prompts(tmp_path):
    recs = [{"problem": "P1", "solution": "long text \\boxed{3}", "answer": 3},
            {"problem": "P2", "solution": "...", "answer": 7.0}]
    (tmp_path / "list.json").write_text(json.dumps(recs))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": recs}))
    (tmp_path / "columns.json").write_text(json.dumps({"problem": ["P1", "P2"], "answer": [3, 7]}))
    for name in ("list.json", "wrapped.json", "columns.json"):
        examples = load_examples(str(tmp_path / name))
        assert [(e.prompt, e.gold, e.gold_format) for e in examples] == [("P1", "3", "plain"), ("P2", "7", "plain")]
        assert examples[0].id == f"{name[:-5]}-0"
    chat = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q?"}],
             "answer": "1"}]
    path = _write_jsonl(tmp_path / "chat.jsonl", chat)
    assert load_examples(path)[0].prompt == "Q?"


def test_parquet_with_custom_fields(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "data.parquet"
    pd.DataFrame(RECORDS).to_parquet(path)
    examples = load_examples(str(path), prompt_field="q", answer_field="a")
    assert [e.gold for e in examples] == ["4", "\\frac{1}{2}", "4"]
    assert examples[0].meta == {"uid": "x1", "level": 1} and isinstance(examples[0].meta["level"], int)


def test_local_file_errors_name_the_problem(tmp_path):
    path = _write_jsonl(tmp_path / "custom.jsonl", RECORDS)
    with pytest.raises(ValueError, match=r"available fields: \['a', 'level', 'q', 'uid'\]"):
        load_examples(path)  # neither field auto-detectable
    with pytest.raises(ValueError, match=r"'question' is not in the records; available fields"):
        load_examples(path, prompt_field="question", answer_field="a")
    uneven = _write_jsonl(tmp_path / "uneven.jsonl", [{"question": "a", "answer": "1"}, {"question": "b"}])
    with pytest.raises(ValueError, match=r"record 1 .* lacks field\(s\) \['answer'\]"):
        load_examples(uneven)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        load_examples(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_examples(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="is a folder"):
        load_examples(str(tmp_path))
    with pytest.raises(ValueError, match="not a benchmark name"):
        load_examples("not a dataset")
    nulls = _write_jsonl(tmp_path / "nulls.jsonl", [{"question": "a", "answer": None}])
    with pytest.raises(ValueError, match="answer field 'answer' is None"):
        load_examples(nulls)


def test_detect_gold_format():
    assert detect_gold_format("#### 5") == "gsm8k"
    assert detect_gold_format(" -1,234.5 ") == "plain"
    assert detect_gold_format("\\frac{1}{2}") == "boxed"
    assert detect_gold_format("x = 3") == "boxed"


# ----------------------------------------------------------------------------------------------------------
# hub datasets (no network in tests: `datasets` is replaced by a stand-in)


class _FakeDataset(list):
    def select(self, indices):
        return _FakeDataset(self[i] for i in indices)


def test_hub_dataset(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        if name == "org/offline":
            raise ConnectionError("no network")
        return _FakeDataset([{"question": f"q{i}", "answer": f"w\n#### {i}"} for i in range(5)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    examples = load_examples("openai/gsm8k:main", "test", limit=3)
    assert calls[-1] == ("openai/gsm8k", "main", "test")
    assert [(e.gold, e.gold_format, e.id) for e in examples] == [
        ("0", "gsm8k", "openai-gsm8k-main-0"), ("1", "gsm8k", "openai-gsm8k-main-1"),
        ("2", "gsm8k", "openai-gsm8k-main-2")]
    load_examples("org/name", "train")
    assert calls[-1] == ("org/name", None, "train")
    with pytest.raises(RuntimeError, match="could not load hub dataset 'org/offline'.*local file path"):
        load_examples("org/offline")


def test_hub_dataset_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(ImportError, match="needs the 'datasets' package"):
        load_examples("org/name")


# ----------------------------------------------------------------------------------------------------------
# synthetic arithmetic


def test_arithmetic_is_deterministic_correct_and_distinct():
    a = arithmetic_examples(300, seed=7, ops=("+", "-", "*"), num_operands=3, max_operand=30)
    b = arithmetic_examples(300, seed=7, ops=("+", "-", "*"), num_operands=3, max_operand=30)
    assert [(e.prompt, e.gold, e.id) for e in a] == [(e.prompt, e.gold, e.id) for e in b]
    assert a != arithmetic_examples(300, seed=8, ops=("+", "-", "*"), num_operands=3, max_operand=30)
    exprs = [e.meta["expression"] for e in a]
    assert len(set(exprs)) == 300
    for e in a:
        # Python's own evaluation is the reference (same precedence rules)
        assert int(e.gold) == eval(e.meta["expression"]) and int(e.gold) >= 0
        assert e.prompt == f"What is {e.meta['expression']}?" and e.gold_format == "plain"
        assert all(0 <= v <= 30 for v in e.meta["operands"]) and len(e.meta["ops"]) == 2
        assert math_reward(f"The answer is {e.gold}.", e.gold, "plain") == 1.0


def test_arithmetic_difficulty_knobs_and_negatives():
    neg = arithmetic_examples(200, seed=1, min_operand=-20, max_operand=20, ops=("-",), allow_negative=True,
                              template="Compute {expression}.")
    assert any(int(e.gold) < 0 for e in neg) and all(int(e.gold) == eval(e.meta["expression"]) for e in neg)
    assert all(e.prompt.startswith("Compute ") for e in neg)
    assert any("(-" in e.meta["expression"] for e in neg)  # negative operands are parenthesised


def test_arithmetic_splits_are_disjoint():
    train, test = arithmetic_splits(400, 100, seed=3, max_operand=25)
    assert len(train) == 400 and len(test) == 100
    assert not {e.meta["expression"] for e in train} & {e.meta["expression"] for e in test}
    assert train[0].id.startswith("arith-train-") and test[0].id.startswith("arith-test-")
    again = arithmetic_splits(400, 100, seed=3, max_operand=25)
    assert [e.prompt for e in again[1]] == [e.prompt for e in test]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n=10, seed=0, ops=("/",)), "ops"),
    (dict(n=10, seed=0, ops="+-"), "not the string"),
    (dict(n=10, seed=0, num_operands=1), "num_operands"),
    (dict(n=10, seed=0, min_operand=5, max_operand=1), "min_operand"),
    (dict(n=10, seed=0, template="no slot"), "expression"),
    (dict(n=-1, seed=0), "n="),
    (dict(n=50, seed=0, min_operand=0, max_operand=2, ops=("+",)), "distinct problems"),  # only 9 exist
])
def test_arithmetic_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        arithmetic_examples(**kwargs)
