"""Bad values fail at load time with one line that names the key and says how to fix it."""

import pytest

from quarl.config import ConfigError, RunConfig, load_config


@pytest.mark.parametrize("override,needle", [
    ("train.max_grad_norm=-1", r"train.max_grad_norm=-1.0 must be > 0 .*reverse the gradient"),
    ("train.max_grad_norm=0", r"train.max_grad_norm=0.0 must be > 0"),
    ("train.max_grad_norm=.nan", r"train.max_grad_norm=nan must be > 0"),
    ("train.warmup_steps=-1", r"train.warmup_steps=-1 must be >= 0"),
    ("train.max_nonfinite_steps=-1", r"train.max_nonfinite_steps=-1 must be >= 0"),
    ("eval.every=-5", r"eval.every=-5 must be >= 0"),
    ("output.samples_per_step=-1", r"output.samples_per_step=-1 must be >= 0"),
    ("eval.max_new_tokens=0", r"eval.max_new_tokens=0 must be >= 1, or null"),
    ("output.dir=''", r"output.dir is empty"),
    ("output.dir='  '", r"output.dir is empty"),
    ("model.device=tpu", r"model.device='tpu'; choose auto, cpu, cuda or cuda:N"),
    ("model.device=gpu", r"model.device='gpu'; choose"),
    ("model.device=cuda:x", r"model.device='cuda:x'; choose"),
    ("train.lr=0", r"train.lr=0.0 must be a finite number > 0"),
    ("train.lr=-1e-5", r"train.lr=-1e-05 must be a finite number > 0"),
    ("train.lr=.inf", r"train.lr=inf must be a finite number > 0"),
    ("train.lr=.nan", r"train.lr=nan must be a finite number > 0"),
    ("output.keep_checkpoints=0", r"output.keep_checkpoints=0 must be >= 1"),
])
def test_bad_values_name_their_key(override, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        load_config(None, [override])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides", [
    ["train.max_nonfinite_steps=0"],  # never stop for NaN/Inf
    ["eval.every=0", "output.samples_per_step=0", "train.warmup_steps=0"],
    ["eval.max_new_tokens=null"],
    ["eval.max_new_tokens=1"],
    ["model.device=cuda:1"],  # checked for being visible when the run starts, not here
    ["model.device=CUDA"],
    ["model.device=cpu", "output.keep_checkpoints=1", "train.max_grad_norm=0.5", "train.lr=1e6"],
])
def test_edge_values_that_are_fine(overrides):
    load_config(None, overrides)


def test_new_keys_and_their_defaults():
    cfg = RunConfig()
    assert cfg.train.max_nonfinite_steps == 3 and cfg.output.keep_checkpoints == 2


@pytest.mark.parametrize("text,kind", [("- model\n- train\n", "a list"), ("just text\n", "a string"),
                                       ("42\n", "a number")])
def test_a_yaml_file_whose_top_level_is_not_a_mapping(tmp_path, text, kind):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}: the top level must be a mapping of sections (model:, train:, ...), "
                               f"got {kind}")


def test_an_empty_yaml_file_means_the_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# nothing set\n")
    assert load_config(path).train.steps == RunConfig().train.steps


def test_a_section_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: 5\n")
    with pytest.raises(ConfigError, match=r"^train must be a section \(a mapping of train.KEY: value\), got 5$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^train must be a section"):
        load_config(None, ["train=[1, 2]"])


def test_invalid_yaml_is_one_line_with_its_position(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML at line \d+, column \d+") as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_cli_exits_2_on_a_bad_value(capsys):
    from quarl.cli import main

    assert main(["config", "train.max_grad_norm=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quarl config: error: train.max_grad_norm=-1.0 must be > 0") and err.count("\n") == 1
