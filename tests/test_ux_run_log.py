"""The run log's trackers: TensorBoard gets the config, hyperparameters and completions; W&B (offline) gets
metrics, config and tables; output.report_to is read from the config with a clear error for unknown names."""

import json
import re
import sys
import time
import types
from pathlib import Path

import pytest

from quarl.config import ConfigError, load_config
from quarl.rl.run_log import RunLog, flatten_config, parse_report_to, samples_markdown

CONFIG = {"model": {"name": "tiny-random-llama"}, "train": {"lr": 0.00123, "steps": 3},
          "data": {"ops": ["+", "-"], "eval": None}}


def _tb_events(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def _text(acc, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def test_tensorboard_gets_config_hparams_scalars_and_completions(tmp_path):
    log = RunLog(tmp_path / "run", report_to=["tensorboard"], config=CONFIG)
    log.log(1, {"reward/mean": 0.25, "train/loss": float("nan"), "fallbacks": {"gemm": "eager"}})
    log.samples(1, [{"prompt": "2 + 3", "gold": "5", "completion": "it is 5 | done\nyes", "reward": 1.0}])
    log.eval_samples(1, [{"id": "e1", "prompt": "9 + 1", "completions": ["10"], "scores": [1.0]}])
    log.close()
    acc = _tb_events(tmp_path / "run" / "tb")
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25)]
    assert "train/loss" not in acc.Tags()["scalars"]  # NaN stays out of TensorBoard (metrics.jsonl has null)
    config_text = _text(acc, "config")[0][1]
    assert "lr: 0.00123" in config_text and "tiny-random-llama" in config_text
    (step, samples), = _text(acc, "samples")
    assert step == 1 and "it is 5 \\| done<br>yes" in samples and "| prompt | gold | completion | reward |" in samples
    assert "9 + 1" in _text(acc, "eval_samples")[0][1]
    # the HParams tab: the flattened config as this run's hyperparameters
    hparams = acc.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams
    assert b"train.lr" in hparams["_hparams_/session_start_info"]
    records = [json.loads(x) for x in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "id": "e1", "prompt": "9 + 1", "completions": ["10"], "scores": [1.0]}]


def test_flatten_and_markdown_helpers():
    assert flatten_config(CONFIG) == {"model.name": "tiny-random-llama", "train.lr": 0.00123, "train.steps": 3,
                                      "data.ops": "['+', '-']", "data.eval": "none"}
    table = samples_markdown([{"a": 1}, {"b": "x|y"}])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 |  |", "|  | x\\|y |"]


def test_report_to_names():
    assert parse_report_to(["TensorBoard", "wandb", "wandb"]) == ["tensorboard", "wandb"]
    assert parse_report_to("tensorboard,wandb") == ["tensorboard", "wandb"]
    assert parse_report_to("none") == [] and parse_report_to([]) == []
    with pytest.raises(ValueError, match=r"unknown tracker 'mlflow'; choose from tensorboard, wandb"):
        parse_report_to(["tensorboard", "mlflow"])


def test_from_config_reads_report_to_with_defaults(tmp_path):
    cfg = load_config(None, [f"output.dir={tmp_path}"])
    log = RunLog.from_config(tmp_path / "a", cfg)
    assert log.trackers == ["tensorboard"] and log.writer is not None
    log.close()
    cfg = load_config(None, ["output.tensorboard=false"])
    log = RunLog.from_config(tmp_path / "b", cfg)
    assert log.trackers == [] and log.writer is None
    log.close()


def test_wandb_missing_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'quarl\[wandb\]'"):
        RunLog(tmp_path / "run", report_to=["wandb"])


class _FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged = []
        self.finished = False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1]
    fake.Table = lambda columns, data: ("table", columns, data)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = tmp_path / "run"
    log = RunLog(run_dir, report_to=["wandb"], config=CONFIG, wandb_project="proj")
    log.log(1, {"reward/mean": 0.5, "note": "text", "bad": float("inf")})
    log.samples(1, [{"prompt": "p", "completion": "c", "reward": 0.0}])
    log.log(2, {"reward/mean": 0.75})
    log.close()
    first = runs[0]
    assert first.finished and first.init["project"] == "proj" and first.init["name"] == "run"
    assert first.init["config"] == CONFIG and first.init["dir"] == str(run_dir)
    assert first.logged[0] == (1, {"reward/mean": 0.5})
    assert first.logged[1] == (1, {"samples": ("table", ["prompt", "completion", "reward"], [["p", "c", 0.0]])})
    log = RunLog(run_dir, report_to=["wandb"], resume_step=1)
    log.close()
    assert runs[1].init["id"] == first.init["id"] and runs[1].init["resume"] == "allow"
    log = RunLog(run_dir, report_to=["wandb"])  # a fresh run in the same folder is a new W&B run
    log.close()
    assert runs[2].init["id"] != first.init["id"]


def _wandb_run_file(offline_dir: Path, expected: bytes) -> bytes:
    """The bytes of an offline W&B run's transaction log once it holds `expected`. finish() hands the records to
    W&B's service process, which writes the file on its own schedule: its teardown (what a process exit runs)
    flushes it, and a loaded machine may still need a moment after that."""
    import wandb

    wandb.teardown()
    run_file = next(offline_dir.glob("run-*.wandb"))
    deadline = time.monotonic() + 30
    while expected not in run_file.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    return run_file.read_bytes()


def test_wandb_offline_run_holds_metrics_config_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    log = RunLog(tmp_path / "run", report_to=["wandb"], config=CONFIG, wandb_project="quarl-test")
    log.log(1, {"reward/mean": 0.5})
    log.samples(1, [{"prompt": "2 + 3", "completion": "five", "reward": 0.0}])
    log.log(2, {"reward/mean": 0.8125})
    log.close()
    offline = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    data = _wandb_run_file(offline[0], b"0.8125")
    assert b"reward/mean" in data and b"0.8125" in data and b'"lr":0.00123' in data
    table = next(offline[0].glob("files/media/table/samples_1_*.table.json"))
    assert json.loads(table.read_text()) == {"columns": ["prompt", "completion", "reward"],
                                             "data": [["2 + 3", "five", 0.0]]}


# ------------------------------------------------------------------------------------------------ from the config


def test_report_to_is_a_validated_config_key_with_trl_names():
    cfg = load_config(None, ["output.report_to=tensorboard,WandB", "output.wandb_project=p", "run_name=r"])
    assert cfg.output.report_to == ("tensorboard", "wandb") and cfg.output.wandb_name == "r"
    assert load_config(None, ["report_to=none"]).output.report_to == ()
    assert load_config(None, []).output.report_to == ("tensorboard",)
    # the older key still turns TensorBoard off
    assert load_config(None, ["output.tensorboard=false", "output.report_to=[tensorboard,wandb]"]).output.report_to \
        == ("wandb",)
    with pytest.raises(ConfigError, match=r"output.report_to: unknown tracker 'mlflow'; choose from tensorboard"):
        load_config(None, ["output.report_to=[mlflow]"])


def _tiny_trainer(tmp_path, *overrides):
    import torch

    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.tiny import tiny_config, tiny_tokenizer
    from quarl.rl.trainer import Trainer

    cfg = load_config(None, [
        "data.train=arithmetic", "data.max_operand=9", "data.num_train=20", "data.num_eval=3",
        "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=3", "train.steps=1",
        "model.device=cpu", "eval.full_precision=false", f"output.dir={tmp_path / 'run'}", *overrides])
    torch.manual_seed(0)
    return Trainer(cfg, model=QuarlForCausalLM(tiny_config("llama")), tokenizer=tiny_tokenizer())


def test_a_run_reports_to_wandb_and_saves_its_evals(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer = _tiny_trainer(tmp_path, "output.report_to=[wandb]", "output.wandb_project=quarl-test",
                            "output.progress=true", "precision.flow=split")
    trainer.train()
    run = tmp_path / "run"
    assert not (run / "tb").exists()  # report_to=[wandb] alone: no TensorBoard
    offline, = (run / "wandb").glob("offline-run-*")
    data = _wandb_run_file(offline, b"eval/accuracy")
    # metrics, and the effective config (the null precision.format resolved to split's int8)
    assert b"reward/mean" in data and b"eval/accuracy" in data and b'"format":"int8"' in data
    assert next(offline.glob("files/media/table/eval_samples_0_*.table.json"))
    # held-out completions and per-problem scores before (step 0) and after (step 1) training
    rows = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval"]) for r in rows] == [(0, "eval")] * 3 + [(1, "eval")] * 3
    for row in rows:
        a, b = map(int, re.search(r"(\d+) \+ (\d+)", row["prompt"]).groups())
        assert row["gold"] == str(a + b) and len(row["completions"]) == 1 and row["scores"] in ([0.0], [1.0])
    err = capsys.readouterr().err
    assert "held-out eval (step 0)" in err and "held-out eval (step 1)" in err  # the progress bars


def test_evals_are_silent_without_progress_and_a_missing_tracker_fails_before_loading(tmp_path, monkeypatch,
                                                                                    capsys):
    trainer = _tiny_trainer(tmp_path, "output.progress=false", "output.report_to=[tensorboard]")
    trainer.train()
    assert "held-out eval" not in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [0, 1]
    assert (tmp_path / "run" / "tb").is_dir()
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'quarl\[wandb\]'"):
        _tiny_trainer(tmp_path / "b", "output.report_to=[wandb]")
