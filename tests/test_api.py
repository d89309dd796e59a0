"""The Python API (quarl.train), reward callables, in-memory datasets, chat prompts with a system turn, TRL names in
the config and the effective config."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

import quarl
from quarl.config import ConfigError, DataSection, RewardSection, effective_config_dict, load_config
from quarl.model.tiny import tiny_tokenizer
from quarl.tasks.rewards import RewardFunctionError
from quarl.tasks.task import load_task

ROOT = Path(__file__).resolve().parents[1]

CHAT = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + 1?"}],
         "answer": str(i + 1), "level": i % 3} for i in range(6)]
TINY = {"model": {"name": "tiny-random-llama", "device": "cpu"},
        "output": {"progress": False, "tensorboard": False}, "eval": {"before": False, "after": False}}


def task_of(records, reward_fns=None, reward_weights=None, tokenizer=None, **data):
    return load_task(DataSection(**data), RewardSection(), tokenizer, reward_fns=reward_fns,
                     reward_weights=reward_weights, dataset=records)


# ------------------------------------------------------------------------------------------------ chat prompts


def test_conversational_records_keep_their_system_turn():
    task = task_of(CHAT, reward_fns=[lambda completions, prompts, **kw: [0.0] * len(completions)],
                   tokenizer=tiny_tokenizer(), prompt_template="Q: {prompt}")
    text = task.render(task.train_examples[0])
    # the tiny tokenizer's template writes "<s>role: content\n" per message
    assert text == "<s>system: Be brief.\n<s>user: Q: What is 0 + 1?\n<s>assistant: "
    plain = task_of(CHAT, chat_template=False, system_prompt="ignored: the record has its own")
    assert plain.render(plain.train_examples[0]) == "Be brief.\n\nWhat is 0 + 1?"


def test_system_prompt_is_added_to_chats_without_a_system_turn():
    records = [{"prompt": [{"role": "user", "content": "Hi?"}], "answer": "1"}]
    task = task_of(records, tokenizer=tiny_tokenizer(), system_prompt="Sys.")
    assert task.render(task.train_examples[0]) == "<s>system: Sys.\n<s>user: Hi?\n<s>assistant: "


def test_chat_without_a_user_turn_is_refused():
    with pytest.raises(ValueError, match=r"record 0: the chat messages of field 'prompt' have no user turn"):
        task_of([{"prompt": [{"role": "system", "content": "x"}], "answer": "1"}])


# ------------------------------------------------------------------------------------------------ reward callables


def test_batched_and_per_sample_rewards_get_trl_arguments_and_are_weighted():
    calls = []

    def batched(completions, prompts, answer, level, **kwargs):
        calls.append((list(completions), prompts, list(answer), list(level)))
        return [float(len(c)) for c in completions]

    @quarl.per_sample
    def sample(completion, prompt, answer, **kwargs):
        return 1.0 if completion == answer else None  # None: does not apply

    task = task_of(CHAT, reward_fns=[batched, sample], reward_weights=[0.5, 2.0])
    calls.clear()  # the functions are tried once on the first example when the task loads
    examples = task.train_examples[:2]
    scores = task.rewards(["1", "xyz", "2"], [examples[0], examples[0], examples[1]])
    assert scores == [0.5 * 1 + 2.0, 0.5 * 3, 0.5 * 1 + 2.0]
    completions, prompts, answer, level = calls[0]
    assert len(calls) == 1 and completions == ["1", "xyz", "2"] and answer == ["1", "1", "2"] and level == [0, 0, 1]
    assert prompts[2] == CHAT[1]["prompt"]  # the chat messages as the dataset gave them
    # held-out correctness: the weighted sum without the format bonus reaches 1
    assert task.correct("1", examples[0]) and not task.correct("", examples[0])


@pytest.mark.parametrize("fn,weights,message", [
    (lambda completions, prompts, **kw: [1.0], None, r"returned 1 values for 2 completions; it must return one per"),
    (lambda completions, prompts, **kw: ["good"] * len(completions), None, r"returned 'good' \(a str\); it must "
     r"return a number"),
    (lambda completions, prompts, **kw: 1.0, None, r"\(a float\), not a list of one score per completion; a "
     r"function that scores a single completion must be wrapped with quarl.per_sample"),
    (quarl.per_sample(lambda completion, prompt, **kw: [1.0]), None, r"returned \[1.0\] \(a list\); it must return"),
    (lambda completions, prompts, **kw: 1 / 0, None, r"raised ZeroDivisionError: division by zero \(at test_api.py"),
    (lambda completions, prompts: [1.0], None, r"signature is .*\(completions, prompts\); add \*\*kwargs"),
    ("module:function", None, r"reward_fns\[0\] is a str, not a function; in Python pass the function itself"),
    (lambda completions, prompts, **kw: [1.0] * len(completions), [1.0, 2.0],
     r"reward_weights must be a list with one weight per reward function \(1\)"),
    (lambda completions, prompts, **kw: [1.0] * len(completions), [float("nan")], r"reward_weights\[0\]=nan must"),
])
def test_bad_reward_functions_fail_with_one_line(fn, weights, message):
    task = None
    with pytest.raises(ValueError, match=message) as info:
        task = task_of(CHAT, reward_fns=[fn], reward_weights=weights)
        task.rewards(["a", "b"], task.train_examples[:2])
    assert "\n" not in str(info.value)


def test_reward_errors_at_load_name_the_first_example():
    with pytest.raises(RewardFunctionError, match=r"raised KeyError.*checked when the task loads, on the first "
                                                  r"training example, id 'dataset-0'"):
        task_of(CHAT, reward_fns=[lambda completions, prompts, **kw: [kw["missing"]]])


# ------------------------------------------------------------------------------------------------ datasets


def test_dataset_forms_and_bad_datasets():
    fn = [lambda completions, prompts, **kw: [0.0] * len(completions)]
    columns = {"question": ["a?", "b?"], "label": ["x", "y"]}  # no answer column: fine with reward callables
    assert [e.prompt for e in task_of(columns, reward_fns=fn).train_examples] == ["a?", "b?"]
    assert task_of(columns, reward_fns=fn).train_examples[1].reward_columns() == {"label": "y"}
    with pytest.raises(ValueError, match=r"could not find the prompt \(question\) field .* available fields: "
                                         r"\['label', 'text'\]; pass prompt_field= \(data.prompt_field"):
        task_of([{"text": "a", "label": 1}], reward_fns=fn)
    assert task_of([{"text": "a", "label": 1}], reward_fns=fn, prompt_field="text").train_examples[0].prompt == "a"
    with pytest.raises(ValueError, match=r"could not find the answer field"):
        task_of([{"prompt": "a"}])  # the built-in math reward needs gold answers
    with pytest.raises(ValueError, match=r"dataset is empty"):
        task_of([], reward_fns=fn)
    with pytest.raises(ValueError, match=r"dataset: record 1 is a str; every record must be a dict"):
        task_of([{"prompt": "a"}, "b"], reward_fns=fn)
    with pytest.raises(ValueError, match=r"dataset is a int; give a datasets.Dataset, a list of dicts"):
        task_of(3, reward_fns=fn)
    with pytest.raises(ValueError, match=r"the columns have different lengths"):
        task_of({"prompt": ["a", "b"], "answer": ["1"]}, reward_fns=fn)


def test_a_hugging_face_dataset_is_accepted():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(CHAT)
    task = task_of(ds, reward_fns=[lambda completions, prompts, answer, **kw: [float(a) for a in answer]])
    assert [e.prompt for e in task.train_examples] == [r["prompt"][1]["content"] for r in CHAT]
    with pytest.raises(ValueError, match=r"DatasetDict with the splits \['train'\]; pass one split"):
        task_of(datasets.DatasetDict({"train": ds}))


def test_reward_fns_and_reward_function_together_are_refused():
    with pytest.raises(ValueError, match=r"both reward_fns and reward.function='m:f' are set"):
        load_task(DataSection(), RewardSection(function="m:f"), reward_fns=[lambda completions, prompts: []])


# ------------------------------------------------------------------------------------------------ TRL names


def test_trl_names_resolve_to_quarl_keys_and_are_saved_under_them():
    cfg = load_config(None, ["beta=0.04", "epsilon=0.3", "learning_rate=3e-5", "loss.epsilon_high=0.35",
                             "rollout.max_completion_length=12", "num_generations=3", "max_steps=7",
                             "train.epochs=2"])
    assert (cfg.loss.kl_coef, cfg.loss.epsilon_low, cfg.loss.epsilon_high) == (0.04, 0.3, 0.35)
    assert (cfg.train.lr, cfg.rollout.max_new_tokens, cfg.rollout.num_generations, cfg.train.steps) == \
        (3e-5, 12, 3, 7)
    # an override wins over the file's value of the same key, whichever name either uses
    assert load_config(ROOT / "configs" / "demo.yaml", ["learning_rate=2e-5"]).train.lr == 2e-5
    with pytest.raises(ConfigError, match=r"beta=0.1 and loss.kl_coef=0.2 set the same key"):
        quarl.make_config({"beta": 0.1, "loss": {"kl_coef": 0.2}})


@pytest.mark.parametrize("override,message", [
    ("train.beta=0.1", r"unknown config key 'train.beta'; did you mean loss.kl_coef \(TRL's beta\)\?"),
    ("learning_rat=1", r"unknown config key 'learning_rat'; did you mean train.lr \(TRL's learning_rate\)\?"),
    ("per_device_train_batch_size=8", r"TRL's per_device_train_batch_size counts completions .* set "
                                      r"rollout.prompts_per_step"),
    ("rollout.num_generation=3", r"did you mean rollout.num_generations\?"),
])
def test_unknown_keys_suggest_the_quarl_name(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


# ------------------------------------------------------------------------------------------------ effective config


def test_effective_config_fills_in_resolved_values():
    cfg = load_config(None, ["precision.flow=unified", "loss.loss_type=dapo", "rollout.max_new_tokens=24",
                             "rollout.prompts_per_step=3", "rollout.num_generations=4", "train.epochs=2"])
    eff = effective_config_dict(cfg)
    # the unified flow resolves weight_only by the model's hidden size (weight-only below 2048): left null
    assert eff["precision"]["format"] == "fp8-block" and eff["precision"]["weight_only"] is None
    for fixed in ("precision.kernel_forward=true", "precision.kernel_forward=false", "precision.quantized_backward=true",
                  "precision.unified_weight_only_on_bf16=false"):
        pinned = effective_config_dict(load_config(None, ["precision.flow=unified", fixed]))
        assert pinned["precision"]["weight_only"] is False, fixed
    assert effective_config_dict(load_config(None, ["precision.flow=split"]))["precision"]["weight_only"] is False
    assert eff["loss"]["aggregation"] == "token-mean" and eff["loss"]["epsilon_high"] == 0.28
    assert eff["loss"]["max_new_tokens"] == 24 and eff["eval"]["max_new_tokens"] == 24
    assert eff["train"]["mini_batch_size"] == 12
    assert cfg.loss.aggregation is None  # the config itself is left as given
    plain = effective_config_dict(load_config(None, ["loss.loss_type=dr_grpo", "lora.rank=8"]))
    assert plain["precision"]["format"] == "bf16" and plain["loss"]["aggregation"] == "seq-mean-token-sum-norm"
    assert plain["loss"]["epsilon_high"] == 0.2 and plain["lora"]["alpha"] == 8.0


def test_example_configs_have_their_own_run_directory():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    dirs = {p.stem: load_config(p).output.dir for p in configs}
    assert dirs == {stem: f"runs/{stem}" for stem in dirs}


# ------------------------------------------------------------------------------------------------ quarl.train


def test_train_runs_with_python_rewards_and_data(tmp_path, capsys):
    calls = {"batched": 0, "sample": 0}

    def constant(completions, prompts, answer, **kwargs):
        calls["batched"] += 1
        return [0.25] * len(completions)

    @quarl.per_sample
    def one(completion, prompt, **kwargs):
        calls["sample"] += 1
        return 1.0

    result = quarl.train(TINY, reward_fns=[constant, one], reward_weights=[2.0, 1.0], dataset=CHAT,
                         num_generations=2, max_completion_length=3, max_steps=2, rollout={"prompts_per_step": 2},
                         save_steps=1, **{"output.dir": str(tmp_path / "run")})
    assert result.run_dir == tmp_path / "run" and result.step == 2 and not result.interrupted
    assert result.metrics["reward/mean"] == pytest.approx(2.0 * 0.25 + 1.0)
    # one batched call per rollout round (+ one check at load); per-sample: each of 2 x 2 answers per step
    assert calls == {"batched": 2 + 1, "sample": 2 * 4 + 1}
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["rollout"]["num_generations"] == 2 and saved["rollout"]["max_new_tokens"] == 3
    assert saved["data"]["train"] == "<list of 6 records given to quarl.train(dataset=...)>"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    out = capsys.readouterr().out
    assert f"[quarl] run directory: {tmp_path / 'run'}" in out
    for step in (1, 2):
        assert f"[quarl] step {step}: checkpoint saved to {tmp_path / 'run' / 'checkpoints'}" in out


def test_train_refuses_bad_input_before_the_run_starts(tmp_path):
    with pytest.raises(ValueError, match=r"returned 2 values for 1 completions"):
        quarl.train(TINY, reward_fns=[lambda completions, prompts, **kw: [1.0, 2.0]], dataset=CHAT,
                    output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"config is a int; pass a YAML path"):
        quarl.train(3)
    with pytest.raises(ConfigError, match=r"config='nope.txt' is not a YAML file"):
        quarl.train("nope.txt")
    assert not (tmp_path / "run").exists()


def test_python_api_example_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("python_api_example", ROOT / "examples" / "python_api.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--model", "tiny-random-llama", "--steps", "1", "--out", str(tmp_path / "ex")])
    assert result.step == 1 and (tmp_path / "ex" / "checkpoints").is_dir()
    assert result.eval_after is not None and result.eval_after["eval/num_examples"] == 16
    assert example.correct(["12 apples", "x"], [None, None], answer=["12", "3"]) == [1.0, 0.0]


def _readme_python_api_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the README's Python API section should hold one ```python block"
    return blocks[0]


def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The README's code, executed as it stands; only the model (the built-in tiny one, for speed), the device, the
    run directory and the progress bar are changed, through a wrapper around quarl.train."""
    code = _readme_python_api_block()
    real_train, calls = quarl.train, []

    def train(config, **kwargs):
        calls.append(dict(kwargs))
        kwargs["output_dir"] = str(tmp_path / "run")
        return real_train(config, model={"name": "tiny-random-llama", "device": "cpu"}, output={"progress": False},
                          **kwargs)

    monkeypatch.setattr(quarl, "train", train)
    monkeypatch.chdir(ROOT)  # the example runs from the repository root
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    assert len(calls) == 1 and len(calls[0]["reward_fns"]) == 2 and calls[0]["output_dir"] == "runs/python-api"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == f"{tmp_path / 'run'} {records[-1]['reward/mean']}"
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["rollout"]["num_generations"] == 4 and saved["rollout"]["prompts_per_step"] == 4
    assert saved["data"]["train"] == "<list of 100 records given to quarl.train(dataset=...)>"
    # the reward functions as written score what they say: exact answers, and brevity
    fns = dict(zip(("correct", "short"), calls[0]["reward_fns"]))
    assert fns["correct"](["12", " 7\n", "12 apples"], [None] * 3, answer=["12", "7", "12"]) == [1.0, 1.0, 0.0]
    assert fns["short"](["abc", "abcd"], [None, None]) == [1.0, 0.0]
