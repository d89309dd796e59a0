"""The Python API: `quarl.train(config, reward_fns=..., dataset=..., **overrides)` runs what `quarl train` runs.

    import quarl

    def brevity(completions, prompts, **columns):          # TRL's reward signature: one score per completion
        return [-len(c) / 100 for c in completions]

    result = quarl.train("configs/demo.yaml", reward_fns=[brevity], dataset=[{"prompt": "Say hi", "answer": "hi"}],
                         train={"steps": 2}, learning_rate=1e-5)
    print(result.run_dir, result.metrics["reward/mean"])

The run is the same as on the command line: config.yaml, metrics.jsonl, samples.jsonl and checkpoints are
written to the run directory. Python callables and in-memory datasets are not stored in config.yaml: to resume
such a run, call `quarl.train` again with the same functions and data and `resume=RUN_DIR`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from quarl.config import (
    ConfigError,
    RunConfig,
    _merge,
    _set_dotted,
    config_from_dict,
    config_to_dict,
    read_config_file,
    resolve_aliases,
    saved_run,
)


@dataclass
class TrainResult:
    """What `quarl.train` returns.

    run_dir: the run directory (config.yaml, metrics.jsonl, samples.jsonl, checkpoints/); step: RL steps done;
    metrics: the last step's metrics ("reward/mean", "train/loss", ...); eval_before / eval_after: held-out scores
    before and after training ("eval/accuracy", ...; None when not evaluated); interrupted: stopped by Ctrl-C or
    SIGTERM (a checkpoint was saved); config: the RunConfig that ran.
    """

    run_dir: Path
    step: int
    metrics: dict[str, Any]
    eval_before: dict[str, float] | None
    eval_after: dict[str, float] | None
    interrupted: bool
    config: RunConfig


def _overrides_dict(overrides: dict[str, Any]) -> dict:
    """{"train.steps": 2, "loss": {"kl_coef": 0.1}, "learning_rate": 1e-5} -> a nested config mapping."""
    data: dict = {}
    for key, value in overrides.items():
        if isinstance(value, RunConfig) or dataclasses.is_dataclass(value):
            raise ConfigError(f"override {key}= is a {type(value).__name__}; give sections as dicts, e.g. "
                              "train={'steps': 2}")
        node: dict = {}
        _set_dotted(node, key, value)
        data = _merge(data, node)
    return data


def make_config(config: str | os.PathLike | dict | RunConfig | None = None, **overrides: Any) -> RunConfig:
    """A validated RunConfig from a YAML path, a nested dict or a RunConfig (None = the defaults), with overrides.

    Overrides are keyword arguments: a dotted key (`**{"train.steps": 2}`), a section given as a dict
    (`train={"steps": 2}`) or a TRL name (`learning_rate=1e-5`, `beta=0.04`; see quarl.config.TRL_ALIASES).
    Raises ConfigError (one line) for unknown keys, bad values and impossible combinations.
    """
    extra = _overrides_dict(overrides)
    if config is None:
        data: dict = {}
    elif isinstance(config, (str, os.PathLike)):
        if Path(config).suffix not in (".yaml", ".yml") and not Path(config).is_file():
            raise ConfigError(f"config={os.fspath(config)!r} is not a YAML file; pass a .yaml path, a dict of "
                              "sections or a RunConfig")
        data = read_config_file(config)
    elif isinstance(config, RunConfig):
        data = config_to_dict(config)
    elif isinstance(config, dict):
        data = config
    else:
        raise ConfigError(f"config is a {type(config).__name__}; pass a YAML path, a dict of sections or a RunConfig")
    # TRL names resolve in each source apart, so that an override wins over the config's value of the same key
    return config_from_dict(_merge(resolve_aliases(data), resolve_aliases(extra)))


def _source_name(data: Any, what: str) -> str:
    """The path of a dataset given as a path, else a description of the in-memory object."""
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    size = f" of {len(data)} records" if hasattr(data, "__len__") and not isinstance(data, dict) else ""
    return f"<{type(data).__name__}{size} given to quarl.train({what}=...)>"


def _resumed(config, overrides: dict) -> tuple[Any, dict]:
    """resume=RUN_DIR continues that run with its saved config.yaml (as `quarl train ... resume=RUN_DIR`)."""
    run_dir = overrides.get("resume")
    if not run_dir:
        return config, overrides
    saved, earlier = saved_run(run_dir)
    if config is None:  # the saved config, with the values an earlier quarl used for keys added since
        return saved, {**earlier, **overrides, "output.dir": str(run_dir)}
    return config, {**overrides, "output.dir": str(run_dir)}


def train(config: str | os.PathLike | dict | RunConfig | None = None, *,
          reward_fns: Callable | list[Callable] | None = None, reward_weights: list[float] | None = None,
          dataset: Any = None, eval_dataset: Any = None, **overrides: Any) -> TrainResult:
    """Train with RL, as `quarl train` does, from Python.

    Args:
        config: a YAML path, a nested dict of sections ({"train": {"steps": 5}}, TRL names accepted), a RunConfig,
            or None for the defaults.
        reward_fns: a callable or a list of them, replacing the built-in math check (and reward.function). Each is
            called with keywords as in TRL, `fn(completions=list[str], prompts=list, **columns) -> list[float]`,
            where `prompts` are the dataset's prompts (text, or chat messages for conversational records) and
            `columns` the dataset's other columns as lists (e.g. `answer`); accept **kwargs to ignore the rest.
            A function marked with `quarl.per_sample` (attribute `batched = False`) is called once per completion:
            `fn(completion=str, prompt=..., **columns) -> float`. A score may be None (does not apply: adds
            nothing). The training reward is the weighted sum; a held-out answer counts as correct when its
            weighted sum (without the reward.format_weight bonus) is >= 1.
        reward_weights: one weight per reward function (default 1.0 each).
        dataset: training examples instead of data.train: a `datasets.Dataset`, a list of dicts, a dict of columns,
            a pandas DataFrame, or a .jsonl/.json/.parquet path / benchmark name / hub id. Each record needs a
            prompt column (data.prompt_field, or one of prompt/question/problem/...); an answer column is needed
            only by the built-in math reward. Conversational prompts ([{"role": "system", ...}, {"role": "user",
            ...}]) are rendered with every turn through the tokenizer's chat template.
        eval_dataset: held-out examples in the same forms; with `dataset` and no eval_dataset (and no data.eval)
            there is no held-out evaluation.
        **overrides: config keys: dotted (`**{"train.steps": 2}`), sections as dicts (`train={"steps": 2}`), TRL
            names (`learning_rate=1e-5`), or resume="RUN_DIR" to continue a run.
    Returns:
        TrainResult (run_dir, step, metrics of the last step, eval_before / eval_after, interrupted, config).
    Raises:
        ConfigError / ValueError / FileNotFoundError (one line) for bad config, data or reward functions, before
        the model loads; quarl.rl.trainer.RunStopped when the run stops on an error it names (NaN/Inf, run
        directory in use).
    """
    from quarl.rl.trainer import Trainer

    config, overrides = _resumed(config, overrides)
    cfg = make_config(config, **overrides)
    # config.yaml names where the data came from; in-memory data cannot be saved there (give it again to resume)
    if dataset is not None:
        cfg.data.train = _source_name(dataset, "dataset")
    if eval_dataset is not None:
        cfg.data.eval = _source_name(eval_dataset, "eval_dataset")
    trainer = Trainer(cfg, reward_fns=reward_fns, reward_weights=reward_weights, dataset=dataset,
                      eval_dataset=eval_dataset)
    summary = trainer.train()
    return TrainResult(run_dir=trainer.run_dir, step=summary["step"], metrics=summary.get("last", {}),
                       eval_before=summary.get("before"), eval_after=summary.get("after"),
                       interrupted=bool(summary.get("interrupted")), config=cfg)
