"""Bad inputs fail with one clear line: an exception the CLI prints as `quarl CMD: error: ...` (ValueError,
FileNotFoundError, ImportError) whose message names the culprit (file, key, record, function, device) and says
what is wrong. Plus the built-in tiny random models (model.name=tiny-random-llama / -qwen2 / -qwen3 / -qwen3-moe).
"""

import json
import math
import os

import pytest
import torch

from quarl.config import DataSection, RewardSection, load_config
from quarl.devices import resolve_device
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.loading import TINY_RANDOM_MODELS, export_state_dict, load_model, save_pretrained
from quarl.model.tiny import tiny_config, tiny_tokenizer
from quarl.tasks.datasets import load_examples
from quarl.tasks.rewards import load_reward_function, validate_reward_function
from quarl.tasks.task import load_task

CLI_ERRORS = (ValueError, FileNotFoundError, ImportError)  # what `quarl CMD` prints as one line


def one_line_error(excinfo, *needles):
    """The message of a caught error: one line, of a type the CLI reports, containing every needle."""
    err = excinfo.value
    msg = str(err)
    assert isinstance(err, CLI_ERRORS), f"{type(err).__name__} is not reported as one line by the CLI: {msg}"
    assert msg and "\n" not in msg, f"not a single line: {msg!r}"
    assert "Traceback" not in msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny llama saved with quarl's own save_pretrained (config.json, model.safetensors, tokenizer files)."""
    torch.manual_seed(0)
    model = QuarlForCausalLM(tiny_config("llama"))
    out = save_pretrained(model, tiny_tokenizer(), tmp_path_factory.mktemp("ckpt") / "m")
    return out, model


def copy_checkpoint(src, dst):
    os.makedirs(dst)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    return str(dst)


# ---------------------------------------------------------------------------------------------------- model files
def test_good_checkpoint_loads(checkpoint):  # the baseline the corrupted copies below differ from
    d, model = checkpoint
    loaded, tok = load_model(d)
    ids = torch.tensor([tok("12 + 3").input_ids])
    torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_bad_safetensors_file(checkpoint, tmp_path, damage):
    d = copy_checkpoint(checkpoint[0], tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    data = open(path, "rb").read()
    blob = {"truncated": data[: len(data) // 2], "garbage": b"this is not a checkpoint " * 40, "empty": b""}[damage]
    open(path, "wb").write(blob)
    with pytest.raises(ValueError) as e:
        load_model(d)
    one_line_error(e, f"{path} is not a valid safetensors file (truncated or corrupt)")


def test_corrupt_config_json_names_the_file_and_the_position(checkpoint, tmp_path):
    d = copy_checkpoint(checkpoint[0], tmp_path / "m")
    path = os.path.join(d, "config.json")
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 2])  # cut in the middle, as an interrupted download leaves it
    with pytest.raises(ValueError) as e:
        load_model(d)
    msg = one_line_error(e, path, "is not valid JSON", "line ", "column ")
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(text[: len(text) // 2])
    assert f"line {ref.value.lineno} column {ref.value.colno}" in msg

    open(path, "wb").write(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError) as e:
        load_model(d)
    one_line_error(e, path, "is not valid JSON")


def test_config_json_lacking_a_key(checkpoint, tmp_path):
    d = copy_checkpoint(checkpoint[0], tmp_path / "m")
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    del cfg["hidden_size"]
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ValueError) as e:
        load_model(d)
    one_line_error(e, path, "'hidden_size'")


@pytest.mark.parametrize("blob", ["magic-only", "header-cut", "data-cut", "garbage"])
def test_bad_gguf_file(tmp_path, blob):
    from test_loading import random_model, write_tiny_gguf

    path = str(tmp_path / "m.gguf")
    if blob == "data-cut":
        write_tiny_gguf(random_model("llama"), path)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) * 2 // 3])
    else:
        open(path, "wb").write({"magic-only": b"GGUF", "header-cut": b"GGUF\x03\x00\x00\x00\x01\x00",
                                "garbage": b"\x00" * 64}[blob])
    with pytest.raises(ValueError) as e:
        load_model(path)
    one_line_error(e, f"{path} is not a valid GGUF file")


def test_missing_tensor(checkpoint, tmp_path):
    from safetensors.torch import save_file

    d = copy_checkpoint(checkpoint[0], tmp_path / "m")
    sd = export_state_dict(checkpoint[1])
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_model(d)
    one_line_error(e, d, "lacks 1 weights", "model.layers.1.mlp.down_proj.weight")


def test_corrupt_tokenizer_file(checkpoint, tmp_path):
    d = copy_checkpoint(checkpoint[0], tmp_path / "m")
    open(os.path.join(d, "tokenizer.json"), "w").write('{"version": "1.0", "model": ')
    with pytest.raises(ValueError) as e:
        load_model(d)
    one_line_error(e, f"could not load the tokenizer from {d}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_is_a_corrupt_checkpoint(checkpoint, tmp_path, dtype, bad):
    model = checkpoint[1]
    poisoned = QuarlForCausalLM(model.config)
    poisoned.load_state_dict(model.state_dict())
    with torch.no_grad():
        poisoned.model.layers[0].self_attn.q_proj.weight[3, 5] = bad
        poisoned.model.layers[0].self_attn.q_proj.weight[7, 1] = bad
    d = save_pretrained(poisoned, tiny_tokenizer(), tmp_path / "m")
    with pytest.raises(ValueError) as e:
        load_model(d, dtype=dtype)
    one_line_error(e, f"{d} has 2 non-finite values", "in model.layers.0.self_attn.q_proj.weight",
                   "the checkpoint is corrupt")


# ---------------------------------------------------------------------------------------------------- reward functions
USER_REWARDS = '''
import math

def good(completion, example):
    return 1.0 if completion.strip() == example["gold"] else 0.0

def as_bool(completion, example):
    return completion == example["gold"]

def as_int(completion, example):
    return 1

def nan_reward(completion, example):
    return math.nan

def numpy_scalar(completion, example):
    import numpy as np
    return np.float32(0.5)

def wrong_signature(completion):
    return 0.0

def raises(completion, example):
    return 1 / 0

def returns_text(completion, example):
    return "1.0"

def returns_none(completion, example):
    pass

def returns_list(completion, example):
    return [1.0]

def mutates(completion, example):
    example["gold"] = "changed"
    return 0.0

NOT_CALLABLE = {"reward": 1}
'''


@pytest.fixture
def rewards_file(tmp_path, monkeypatch):
    (tmp_path / "bad_input_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "bad_input_rewards.py"


def arithmetic_task(function):
    return load_task(DataSection(train="arithmetic", num_train=4, num_eval=2), RewardSection(function=function),
                     tokenizer=None)


@pytest.mark.parametrize("name", ["good", "as_bool", "as_int", "nan_reward", "numpy_scalar"])
def test_valid_reward_functions_pass_the_check(rewards_file, name):
    task = arithmetic_task(f"bad_input_rewards:{name}")
    ex = task.train_examples[0]
    value = task.reward(ex.gold, ex)
    assert isinstance(value, float)
    assert math.isnan(value) if name == "nan_reward" else value in (0.5, 1.0)


@pytest.mark.parametrize("spec,needles", [
    ("no_such_module_xyz:fn", ["'no_such_module_xyz:fn'", "cannot import module 'no_such_module_xyz'"]),
    ("bad_input_rewards:missing", ["'bad_input_rewards:missing'", "has no attribute 'missing'", "good"]),
    ("bad_input_rewards:NOT_CALLABLE", ["'bad_input_rewards:NOT_CALLABLE'", "is a dict, not a function"]),
    ("bad_input_rewards:wrong_signature", ["'bad_input_rewards:wrong_signature'",
                                          "must accept (completion: str, example: dict)",
                                          "wrong_signature(completion)"]),
    ("bad_input_rewards:raises", ["'bad_input_rewards:raises'", "raised ZeroDivisionError: division by zero",
                                 "bad_input_rewards.py:", "in raises", "first training example"]),
    ("bad_input_rewards:returns_text", ["'bad_input_rewards:returns_text'", "returned '1.0' (a str)",
                                       "must return a number"]),
    ("bad_input_rewards:returns_none", ["'bad_input_rewards:returns_none'", "returned None",
                                       "must return a number"]),
    ("bad_input_rewards:returns_list", ["'bad_input_rewards:returns_list'", "returned [1.0] (a list)",
                                       "must return a number"]),
])
def test_broken_reward_function_fails_when_the_task_loads(rewards_file, spec, needles):
    with pytest.raises(CLI_ERRORS) as e:
        arithmetic_task(spec)
    one_line_error(e, *needles)


def test_reward_function_from_a_file_path(rewards_file):
    with pytest.raises(CLI_ERRORS) as e:
        arithmetic_task(f"{rewards_file}:returns_none")
    one_line_error(e, str(rewards_file), "returned None")
    missing = rewards_file.parent / "nope.py"
    with pytest.raises(FileNotFoundError) as e:
        arithmetic_task(f"{missing}:good")
    one_line_error(e, str(missing))
    broken = rewards_file.parent / "broken_rewards.py"
    broken.write_text("def f(completion, example):\n    return 1.0\n\nraise RuntimeError('oops at import')\n")
    with pytest.raises(ValueError) as e:
        arithmetic_task(f"{broken}:f")
    one_line_error(e, str(broken), "RuntimeError: oops at import", "broken_rewards.py:4")


def test_validate_reward_function_helper(rewards_file):
    task = arithmetic_task(None)
    example = task.train_examples[0]
    fn = validate_reward_function("bad_input_rewards:good", example)
    assert fn(example.gold, dict(vars(example))) == 1.0
    validate_reward_function("bad_input_rewards:mutates", example)
    assert example.gold == task.train_examples[0].gold != "changed"  # the check runs on a copy
    with pytest.raises(ValueError) as e:
        validate_reward_function("bad_input_rewards:returns_text", {"id": "x1", "gold": "7"})
    one_line_error(e, "returns_text", "'x1'")


def test_reward_function_raising_during_training_is_one_line(rewards_file):
    fn = load_reward_function("bad_input_rewards:good")
    with pytest.raises(ValueError) as e:
        fn("7", {})  # KeyError 'gold' inside the user's function
    one_line_error(e, "'bad_input_rewards:good'", "raised KeyError", "bad_input_rewards.py:", "in good")
    assert isinstance(e.value.__cause__, KeyError)  # the original traceback stays attached


# ---------------------------------------------------------------------------------------------------- gold answers
def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("fmt,answers,shown", [
    ("plain", ["12", "7", "banana"], "'banana'"),
    ("gsm8k", ["so 12\n#### 12", "#### 7", "he ate it\n#### banana"], "(final answer 'banana')"),
])
def test_non_numeric_gold_names_file_record_and_field(tmp_path, fmt, answers, shown):
    path = write_jsonl(tmp_path / "data.jsonl", [{"question": f"q{i}", "solution": a} for i, a in enumerate(answers)])
    with open(path, "a") as f:
        f.write("\n")  # a blank line: record numbers follow the file's lines
    good = load_examples(path, answer_field="solution", gold_format=fmt, limit=2)
    assert [e.gold for e in good] == ["12", "7"]
    with pytest.raises(ValueError) as e:
        load_examples(path, answer_field="solution", gold_format=fmt)
    one_line_error(e, f"{path}, line 3", "answer field 'solution'", shown, "not numeric", f"gold_format={fmt}")


def test_non_numeric_gold_fails_when_the_task_loads(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl",
                       [{"question": "1+1", "answer": "2"}, {"question": "?", "answer": "banana"}])
    data = DataSection(train=path, eval=path, gold_format="plain")
    with pytest.raises(ValueError) as e:
        load_task(data, RewardSection(), tokenizer=None)
    one_line_error(e, f"{path}, line 2", "'answer'", "'banana'")
    data = DataSection(train=path, eval=path, gold_format="boxed")  # text answers are fine as LaTeX
    assert [e.gold for e in load_task(data, RewardSection(), tokenizer=None).train_examples] == ["2", "banana"]


# ---------------------------------------------------------------------------------------------------- devices
@pytest.mark.parametrize("name", ["tpu", "gpu:0", "cuda:x", "mps", ""])
def test_unknown_device(name):
    with pytest.raises(ValueError) as e:
        resolve_device(name)
    one_line_error(e, repr(name), "auto", "cpu", "cuda", "cuda:N")


def test_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ValueError) as e:
            resolve_device(name)
        one_line_error(e, repr(name), "none is visible", "cpu or auto")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device(" CPU ")


def test_cuda_index_beyond_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError) as e:
        resolve_device("cuda:2")
    one_line_error(e, "'cuda:2'", "2 GPU(s) are visible", "cuda:0 .. cuda:1")


# ---------------------------------------------------------------------------------------------------- tiny models
def digit_reward(completion: str, example: dict) -> float:
    return sum(ch.isdigit() for ch in completion[:6]) / 6.0


@pytest.mark.parametrize("name", sorted(TINY_RANDOM_MODELS))
def test_tiny_random_model_loads_forwards_and_trains(tmp_path, name):
    from quarl.rl.trainer import Trainer

    assert name in ("tiny-random-llama", "tiny-random-qwen2", "tiny-random-qwen3", "tiny-random-qwen3-moe")
    rng_state = torch.random.get_rng_state()
    model, tok = load_model(name, device="cpu", dtype=torch.float32)
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # seeded privately
    assert model.config.architecture == name.removeprefix("tiny-random-").replace("-", "_")
    assert model.config.num_layers >= 2
    again, _ = load_model(name.upper(), device="cpu", dtype="bfloat16")  # deterministic, any dtype
    assert all(torch.equal(p.to(torch.bfloat16), q) for p, q in zip(model.parameters(), again.parameters()))
    ids = torch.tensor([tok("What is 3 + 4?").input_ids])
    assert tok.decode(ids[0]) == "What is 3 + 4?"
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0

    cfg = load_config(None, [
        f"model.name={name}", "model.device=cpu", "train.steps=1", "data.train=arithmetic", "data.num_train=8",
        "data.num_eval=2", f"reward.function={__name__}:digit_reward", "rollout.prompts_per_step=2",
        "rollout.num_generations=2", "rollout.max_new_tokens=4", "train.micro_batch_size=4",
        "eval.before=false", "eval.after=false", "output.tensorboard=false", "output.progress=false",
        f"output.dir={tmp_path / 'run'}",
    ])
    summary = Trainer(cfg).train()
    assert summary["step"] == 1
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and math.isfinite(records[0]["reward/mean"])


def test_tiny_random_model_takes_no_gguf_file():
    with pytest.raises(ValueError) as e:
        load_model("tiny-random-llama", gguf_file="x.gguf")
    one_line_error(e, "tiny-random-llama", "gguf_file")
