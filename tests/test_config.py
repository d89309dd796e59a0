"""Config loading: YAML + dotted overrides, type checks, unknown keys with suggestions, impossible combinations."""

import pathlib
import re
import warnings

import pytest

import yaml

from quarl.config import ConfigError, RunConfig, config_to_dict, effective_config_dict, load_config, parse_overrides


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_are_typed(tmp_path):
    path = write(tmp_path, 'train:\n  steps: 3\n  lr: 1.0e-5\nrollout:\n  stop: ["\\n\\n"]\n')
    cfg = load_config(path, ["train.steps=7", "precision.flow=split", "precision.format=fp8", "rollout.top_p=0.9"])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == pytest.approx(1e-5)
    assert cfg.precision.resolved_format == "fp8"
    assert cfg.rollout.stop == ("\n\n",)
    assert cfg.rollout.top_p == 0.9
    assert cfg.loss.max_new_tokens is None  # derived from rollout.max_new_tokens at use, never frozen into the config


def test_unknown_key_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.num_generation.*did you mean rollout.num_generations"):
        load_config(None, ["rollout.num_generation=4"])
    with pytest.raises(ConfigError, match="unknown config key 'trian'"):
        load_config(write(tmp_path, "trian:\n  steps: 1\n"))


def test_wrong_types_are_named():
    with pytest.raises(ConfigError, match="train.steps must be an integer"):
        load_config(None, ["train.steps=many"])
    with pytest.raises(ConfigError, match="output.tensorboard must be true or false"):
        load_config(None, ["output.tensorboard=3"])


def test_impossible_combinations():
    with pytest.raises(ConfigError, match="qlora.*lora.rank"):
        load_config(None, ["precision.flow=qlora"])
    with pytest.raises(ConfigError, match="not a precision flow"):
        load_config(None, ["precision.flow=int4"])
    with pytest.raises(ConfigError, match="not a known format"):
        load_config(None, ["precision.flow=split", "precision.format=int3"])
    with pytest.raises(ConfigError, match="num_generations must be >= 2"):
        load_config(None, ["rollout.num_generations=1"])
    with pytest.raises(ConfigError, match="mini_batch_size"):
        load_config(None, ["train.mini_batch_size=10000"])
    with pytest.raises(ConfigError, match="aqn"):
        load_config(None, ["aqn.sigma_start=0.01"])
    with pytest.raises(ConfigError, match="rollout.sampler='multinomial'; choose inverse-cdf or gumbel"):
        load_config(None, ["rollout.sampler=multinomial"])


def test_qlora_with_lora_resolves_weight_only_nvfp4():
    cfg = load_config(None, ["precision.flow=qlora", "lora.rank=8"])
    settings = cfg.precision.linear_settings()
    assert settings["rollout_format"] == "nvfp4" and settings["train_format"] == "nvfp4"
    assert settings["frozen_base"] and settings["weight_only"] and settings["lora_rank"] == 8


def test_round_trip_through_dict(tmp_path):
    cfg = load_config(None, ["train.steps=4", "lora.rank=4", "precision.flow=qlora"])
    import yaml

    again = load_config(write(tmp_path, yaml.safe_dump(config_to_dict(cfg))))
    assert config_to_dict(again) == config_to_dict(cfg)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["train.steps"])


def test_shipped_configs_are_valid():
    import pathlib

    configs = sorted((pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(configs) >= 5
    for path in configs:
        cfg = load_config(path)
        assert cfg.output.dir.startswith("runs/"), path
    assert load_config(configs[0].parent / "demo.yaml").model.name == "smollm2-135m-instruct"


def test_settings_that_would_fail_later_fail_now(tmp_path):
    with pytest.raises(ConfigError, match="top-level `lora:`"):
        load_config(None, ["precision.lora.rank=16"])
    with pytest.raises(ConfigError, match="eval.n=4 needs eval.temperature"):
        load_config(None, ["eval.n=4"])
    with pytest.raises(ConfigError, match="output.checkpoint_every=0"):
        load_config(None, ["output.checkpoint_every=0"])
    with pytest.raises(ConfigError, match="needs sampling"):
        load_config(None, ["rollout.temperature=0"])


def test_config_reference_doc_matches_the_code_and_explains_every_key():
    from pathlib import Path

    from quarl.config_reference import config_reference

    text = config_reference()
    doc = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"
    assert doc.read_text() == text, "docs/CONFIG.md is stale: run `quarl config --reference > docs/CONFIG.md`"
    keys, trl = text.split("## TRL names")
    rows = [line for line in keys.splitlines() if line.startswith("| `")]
    # every TRL name listed sets a key of the reference
    assert {row.split("`")[3] for row in trl.splitlines() if row.startswith("| `")} <= {r.split("`")[1] for r in rows}
    flat = {f"{section}.{key}" for section, values in config_to_dict(RunConfig()).items()
            if isinstance(values, dict) for key in values}
    assert {row.split("`")[1] for row in rows} == flat | {"resume"}
    undocumented = [row.split("`")[1] for row in rows if row.rstrip().endswith("|  |")]
    assert not undocumented, f"config keys without a comment in the source: {undocumented}"


def test_quarl_config_prints_effective_values_that_load_back(tmp_path, capsys):
    from quarl.cli import main

    overrides = ["train.steps=3", "precision.flow=unified", "rollout.max_new_tokens=40", "rollout.prompts_per_step=2",
                 "rollout.num_generations=3"]
    assert main(["config", *overrides]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    # keys left null in the config are printed as the values the run uses
    # weight_only stays null: the unified flow resolves it by the model's hidden size
    assert printed["precision"]["format"] == "fp8-block" and printed["precision"]["weight_only"] is None
    assert printed["loss"]["aggregation"] == "seq-mean-token-mean" and printed["loss"]["epsilon_high"] == 0.2
    assert printed["loss"]["max_new_tokens"] == 40 and printed["eval"]["max_new_tokens"] == 40
    assert printed["train"]["mini_batch_size"] == 6
    assert printed["data"]["eval"] == "arithmetic"
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(printed))
    cfg = load_config(str(path))
    assert cfg.train.steps == 3 and cfg.precision.flow == "unified"
    assert effective_config_dict(cfg) == effective_config_dict(load_config(None, overrides))
    assert main(["config", str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")]) == 0
    demo = yaml.safe_load(capsys.readouterr().out)
    assert demo["precision"]["format"] == "int8" and demo["loss"]["epsilon_high"] == 0.2
    assert main(["config", "train.stepz=3"]) == 2
    assert "did you mean train.steps" in capsys.readouterr().err


INERT_CLIP = "several optimizer steps per batch"  # the text of RunConfig.validate's inert-clip warning


def inert_clip_warnings(overrides=(), path=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(path, list(overrides))
    return cfg, [w for w in caught if issubclass(w.category, UserWarning) and INERT_CLIP in str(w.message)]


@pytest.mark.parametrize("overrides,needle", [
    (["loss.correction=acr"], "loss.correction=acr only differs from tis"),
    (["loss.loss_type=dapo"], r"loss.epsilon_high=0.28 \(loss_type=dapo's default"),
    (["loss.epsilon_high=0.3"], r"loss.epsilon_high=0.3 \(set"),
    (["loss.loss_type=dapo", "loss.correction=acr", "train.mini_batch_size=64"], "correction=acr"),  # 64 = batch
])
def test_clip_settings_that_one_optimizer_step_cannot_use_warn(overrides, needle):
    # defaults: 8 prompts x 8 answers = a batch of 64, one epoch, one minibatch -> one optimizer step per batch
    with pytest.warns(UserWarning, match=INERT_CLIP) as record:
        load_config(None, overrides)
    message = next(str(w.message) for w in record if INERT_CLIP in str(w.message))
    assert "\n" not in message
    assert "train.mini_batch_size below prompts_per_step x num_generations = 64" in message
    assert "train.epochs > 1" in message
    assert re.search(needle, message), message


@pytest.mark.parametrize("overrides", [
    [],  # tis with epsilon_high = epsilon_low: nothing inert
    ["loss.correction=acr", "train.mini_batch_size=16"],
    ["loss.correction=acr", "train.epochs=2"],
    ["loss.loss_type=dapo", "train.mini_batch_size=32"],
    ["loss.loss_type=dapo", "loss.epsilon_high=0.2"],
    ["loss.loss_type=dapo", "loss.correction=bypass"],  # R = π_θ/μ ≠ 1 from the start: the clip binds anyway
    ["loss.loss_type=dapo", "loss.correction=naive"],
])
def test_no_inert_clip_warning_when_the_clip_can_bind(overrides):
    _, caught = inert_clip_warnings(overrides)
    assert not caught, [str(w.message) for w in caught]


def test_shipped_configs_take_several_optimizer_steps_where_the_clip_matters():
    from pathlib import Path

    paths = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(paths) >= 5
    clip_users = 0
    for path in paths:
        cfg, caught = inert_clip_warnings(path=path)
        assert not caught, f"{path.name}: {[str(w.message) for w in caught]}"
        mini = cfg.train.mini_batch_size
        if cfg.loss.correction == "acr" or cfg.loss.resolved_epsilon_high != cfg.loss.epsilon_low:
            clip_users += 1
            batch = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
            assert mini is not None and mini < batch and batch % mini == 0, path.name
        if mini is not None:
            assert cfg.train.micro_batch_size <= mini, path.name
    assert clip_users >= 2  # gsm8k-split-fp8-acr-uaq (acr + dapo) and math-unified-fp8-dapo
