"""Config loading: YAML + dotted overrides, type checks, unknown keys with suggestions, impossible combinations."""

import pytest

from quarl.config import ConfigError, RunConfig, config_to_dict, load_config, parse_overrides


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
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    flat = {f"{section}.{key}" for section, values in config_to_dict(RunConfig()).items()
            if isinstance(values, dict) for key in values}
    assert {row.split("`")[1] for row in rows} == flat | {"resume"}
    undocumented = [row.split("`")[1] for row in rows if row.rstrip().endswith("|  |")]
    assert not undocumented, f"config keys without a comment in the source: {undocumented}"


def test_quarl_config_prints_a_resolved_config_that_loads_back(tmp_path, capsys):
    from quarl.cli import main

    assert main(["config", "train.steps=3", "precision.flow=unified"]) == 0
    path = tmp_path / "resolved.yaml"
    path.write_text(capsys.readouterr().out)
    cfg = load_config(str(path))
    assert cfg.train.steps == 3 and cfg.precision.flow == "unified"
    assert config_to_dict(cfg) == config_to_dict(load_config(None, ["train.steps=3", "precision.flow=unified"]))
    assert main(["config", "train.stepz=3"]) == 2
    assert "did you mean train.steps" in capsys.readouterr().err
