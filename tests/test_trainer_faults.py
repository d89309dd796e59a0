"""Faults a training run meets: NaN/Inf rewards, losses, gradients and weights; SIGTERM and a second signal;
two runs into one run directory; a run directory that is not a quarl run; the saved config and resume."""

import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import digit_reward, make_cfg, make_trainer, read_metrics  # noqa: E402

from quarl.cli import main  # noqa: E402
from quarl.config import config_to_dict, load_config  # noqa: E402
from quarl.rl import trainer as trainer_mod  # noqa: E402
from quarl.rl.trainer import NonFiniteError, RunDirError, RunDirInUse, lock_run_dir  # noqa: E402

FAST = ["rollout.max_new_tokens=3"]  # 2 prompts x 4 answers of 3 tokens per step

# ------------------------------------------------------------------------------------------------ helpers

STATE = {"step": None, "calls": 0, "calls_in_step": 0, "nan_steps": (), "nan_groups": None, "signal_at": (),
         "signum": signal.SIGTERM}


def scripted_reward(completion: str, example: dict) -> float:
    """digit_reward, but NaN for the scripted steps/groups, and a signal sent to this process at scripted calls
    (counted over the whole run, like a real Ctrl-C / SIGTERM arriving while a step scores its answers)."""
    STATE["calls"] += 1
    if STATE["calls"] in STATE["signal_at"]:
        os.kill(os.getpid(), STATE["signum"])
    group = STATE["calls_in_step"] // 4  # 4 answers per group, scored group by group
    STATE["calls_in_step"] += 1
    if STATE["step"] in STATE["nan_steps"] and (STATE["nan_groups"] is None or group in STATE["nan_groups"]):
        return float("nan")
    return digit_reward(completion, example)


@pytest.fixture
def scripted():
    STATE.update(step=None, calls=0, calls_in_step=0, nan_steps=(), nan_groups=None, signal_at=(),
                 signum=signal.SIGTERM)
    yield STATE
    STATE.update(step=None, nan_steps=(), signal_at=())


def tracked(trainer):
    """Let scripted_reward know which (0-based) step is rolling out."""
    rollout = trainer.rollout

    def wrapped(step):
        STATE["step"], STATE["calls_in_step"] = step, 0
        return rollout(step)

    trainer.rollout = wrapped
    return trainer


def reward_cfg(tmp_path, *extra, name="run"):
    return make_cfg(tmp_path, *FAST, f"reward.function={__name__}:scripted_reward", *extra, name=name)


def checkpoints(run_dir):
    return sorted((run_dir / "checkpoints").glob("step_*.pt"))


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def assert_all_checkpoints_finite(run_dir):
    found = checkpoints(run_dir)
    assert found
    for path in found:
        for name, t in weights(path).items():
            assert torch.isfinite(t).all(), (path.name, name)


def same_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def survive_sigterm():
    """A SIGTERM the trainer fails to handle is recorded instead of killing pytest (the test then fails)."""
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    yield seen
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def tiny_cli(monkeypatch):
    """`quarl train` through the CLI, on the tiny model of test_trainer (train_from_config builds `Trainer`)."""
    monkeypatch.setattr(trainer_mod, "Trainer", lambda cfg: tracked(make_trainer(cfg)))


def write_config(tmp_path, cfg):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    return path


# ------------------------------------------------------------------------------------------------ non-finite


def test_a_group_with_nan_rewards_at_every_step_stops_the_run(tmp_path, scripted):
    """Other groups still train, but a reward function that returns NaN at every step is broken: the steps that met
    NaN count as consecutive, and the run stops at train.max_nonfinite_steps."""
    scripted.update(nan_steps=(0, 1, 2, 3), nan_groups=(0,))
    cfg = reward_cfg(tmp_path, "train.steps=4", "train.max_nonfinite_steps=2")
    trainer = tracked(make_trainer(cfg))
    with pytest.raises(NonFiniteError, match="2 consecutive steps met NaN/Inf"):
        trainer.train()
    records = read_metrics(tmp_path / "run")
    assert [r["groups/nonfinite_reward"] for r in records] == [1, 1]  # both steps logged, then the stop
    assert all(math.isfinite(r["reward/mean"]) for r in records)


@pytest.mark.parametrize("case", ["one-group", "all-groups"])
def test_nan_rewards_drop_their_groups_and_the_run_finishes(tmp_path, scripted, capsys, case):
    run = tmp_path / "run"
    if case == "one-group":  # step 2's first group: dropped, the other group is trained on
        scripted.update(nan_steps=(1,), nan_groups=(0,))
    else:  # every group of steps 1 and 3: no update there, but not consecutive, so the run goes on (limit 2)
        scripted.update(nan_steps=(0, 2))
    cfg = reward_cfg(tmp_path, "train.steps=3", "output.checkpoint_every=1", "output.keep_checkpoints=3",
                     "train.max_nonfinite_steps=2")
    trainer = tracked(make_trainer(cfg))
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    summary = trainer.train()
    assert summary["step"] == 3 and not summary.get("interrupted")
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert_all_checkpoints_finite(run)
    ck = [weights(p) for p in checkpoints(run)]
    assert len(ck) == 3
    err = capsys.readouterr().err
    if case == "one-group":
        assert [r["groups/nonfinite_reward"] for r in records] == [0, 1, 0]
        assert [r["train/skipped_updates"] for r in records] == [0, 0, 0]
        assert [r["train/nonfinite_total"] for r in records] == [0, 1, 1]
        assert [r["groups/kept"] for r in records] == [2, 1, 2]
        assert records[1]["train/optimizer_steps"] == 1 and math.isfinite(records[1]["reward/mean"])
        assert math.isfinite(records[1]["train/loss"])
        assert not same_weights(ck[0], ck[1])  # step 2 trained on the group left
        assert "[quarl] step 2: the reward function returned NaN/Inf in 1 of 2 groups" in err
    else:
        assert [r["groups/nonfinite_reward"] for r in records] == [2, 0, 2]
        assert [r["train/skipped_updates"] for r in records] == [1, 0, 1]
        assert [r["train/nonfinite_total"] for r in records] == [1, 1, 2]
        assert same_weights(initial, ck[0])  # step 1: no update at all
        assert not same_weights(ck[0], ck[1])
        assert same_weights(ck[1], ck[2])  # step 3: no update either
        assert "[quarl] step 1: the reward function returned NaN/Inf in 2 of 2 groups" in err
        assert "step 3:" in err and "update skipped" in err


def test_nan_rewards_at_every_step_stop_the_run(tmp_path, scripted, capsys):
    scripted.update(nan_steps=range(100))
    run = tmp_path / "run"
    trainer = tracked(make_trainer(reward_cfg(tmp_path, "train.steps=5", "train.max_nonfinite_steps=2")))
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("step 2: the reward function returned NaN/Inf in 2 of 2 groups")
    assert "train.max_nonfinite_steps=2" in message
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert not checkpoints(run)
    lock_run_dir(run).close()  # the lock was released although train() raised


def test_cli_reports_a_nonfinite_stop_in_one_line(tmp_path, scripted, tiny_cli, capsys):
    scripted.update(nan_steps=range(100))
    path = write_config(tmp_path, reward_cfg(tmp_path, "train.steps=5", "train.max_nonfinite_steps=1"))
    capsys.readouterr()
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("quarl train: error:")]
    assert len(errors) == 1 and "step 1:" in errors[0] and "train.max_nonfinite_steps=1" in errors[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("where", ["loss", "grad_norm"])
def test_a_nonfinite_loss_or_gradient_norm_skips_that_update(tmp_path, monkeypatch, capsys, where):
    run = tmp_path / "run"
    cfg = make_cfg(tmp_path, *FAST, "output.checkpoint_every=1", "output.keep_checkpoints=2")
    trainer = make_trainer(cfg)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    calls = {"n": 0}
    if where == "loss":
        real = trainer_mod.policy_loss

        def nan_once(*args, **kwargs):
            loss, metrics = real(*args, **kwargs)
            calls["n"] += 1
            return (loss * float("nan") if calls["n"] == 1 else loss), metrics

        monkeypatch.setattr(trainer_mod, "policy_loss", nan_once)
    else:
        real = trainer.optimizer.clip_grad_norm_

        def inf_once(max_norm):
            norm = real(max_norm)
            calls["n"] += 1
            return torch.tensor(float("inf")) if calls["n"] == 1 else norm

        trainer.optimizer.clip_grad_norm_ = inf_once
    summary = trainer.train()
    assert summary["step"] == 2
    records = read_metrics(run)
    assert [r["train/skipped_updates"] for r in records] == [1, 0]
    assert [r["train/optimizer_steps"] for r in records] == [0, 1]
    assert [r["train/nonfinite_total"] for r in records] == [1, 1]
    assert math.isfinite(records[1]["train/loss"]) and math.isfinite(records[1]["train/grad_norm"])
    ck = [weights(p) for p in checkpoints(run)]
    assert same_weights(initial, ck[0]) and not same_weights(ck[0], ck[1])
    assert_all_checkpoints_finite(run)
    cause = "non-finite loss (nan)" if where == "loss" else "non-finite gradient norm (inf)"
    assert f"[quarl] step 1: {cause}; update skipped" in capsys.readouterr().err


def test_weights_that_explode_stop_the_run_without_a_nonfinite_checkpoint(tmp_path):
    """train.lr=1e6: the tiny model's weights grow huge but stay finite in float32, so the optimizer step that
    turns them into NaN is simulated (a NaN written into a weight after the second step)."""
    run = tmp_path / "run"
    trainer = make_trainer(make_cfg(tmp_path, *FAST, "train.lr=1e6", "train.steps=3", "output.checkpoint_every=1"))
    real_step, calls = trainer.optimizer.step, {"n": 0}

    def exploding_step():
        real_step()
        calls["n"] += 1
        if calls["n"] == 2:
            with torch.no_grad():
                trainer.optimizer.masters[0].view(-1)[0] = float("nan")
                trainer.optimizer.params[0].view(-1)[0] = float("nan")

    trainer.optimizer.step = exploding_step
    with pytest.raises(NonFiniteError, match=r"^step 2: the weights are non-finite after the optimizer step "
                                             r"\(NaN/Inf in .*train.lr=1e\+06\).*lower train.lr") as info:
        trainer.train()
    assert "\n" not in str(info.value)
    assert [p.name for p in checkpoints(run)] == ["step_000001.pt"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000001.pt"
    assert_all_checkpoints_finite(run)
    lock_run_dir(run).close()


def test_a_checkpoint_is_never_written_from_nonfinite_weights(tmp_path):
    run = tmp_path / "run"
    trainer = make_trainer(make_cfg(tmp_path, *FAST))
    trainer.prepare_run_dir()
    try:
        with torch.no_grad():
            trainer.params[-1].view(-1)[0] = float("inf")
        with pytest.raises(NonFiniteError, match="step 1: the weights are non-finite at the checkpoint"):
            trainer.checkpoint(1)
    finally:
        trainer.close()
    assert not checkpoints(run)


# ------------------------------------------------------------------------------------------------ signals


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path, scripted, survive_sigterm, tiny_cli, capsys):
    run = tmp_path / "run"
    scripted.update(signal_at=(12,))  # 8 answers per step: the 12th reward is scored during step 2
    cfg = reward_cfg(tmp_path, "train.steps=4", "output.checkpoint_every=1", "output.keep_checkpoints=1")
    before = signal.getsignal(signal.SIGTERM)
    assert main(["train", str(write_config(tmp_path, cfg))]) == 143
    assert signal.getsignal(signal.SIGTERM) is before  # the trainer's handler is removed again
    assert not survive_sigterm, "SIGTERM reached the process's own handler, not the trainer's"
    assert [p.name for p in checkpoints(run)] == ["step_000002.pt"]  # output.keep_checkpoints=1
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    out = capsys.readouterr().out
    assert "[quarl] SIGTERM: finishing this step" in out and f"resume={run}" in out
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert "resume" not in saved and load_config(run / "config.yaml").resume is None

    assert main(["train", str(run / "config.yaml"), f"resume={run}"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert [p.name for p in checkpoints(run)] == ["step_000004.pt"]
    assert "resume" not in yaml.safe_load((run / "config.yaml").read_text())


def test_a_second_signal_stops_at_once_in_one_line(tmp_path, scripted, survive_sigterm, tiny_cli, capsys):
    run = tmp_path / "run"
    scripted.update(signal_at=(12, 13))
    cfg = reward_cfg(tmp_path, "train.steps=4", "output.checkpoint_every=1")
    assert main(["train", str(write_config(tmp_path, cfg))]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "[quarl] interrupted" and "Traceback" not in err
    assert [p.name for p in checkpoints(run)] == ["step_000001.pt"]  # nothing of the unfinished step 2
    lock_run_dir(run).close()  # released


def test_ctrl_c_while_loading_the_model_exits_in_one_line(tmp_path, monkeypatch, capsys):
    import quarl.model.loading

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(quarl.model.loading, "load_model", interrupted)
    assert main(["train", str(write_config(tmp_path, make_cfg(tmp_path)))]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "[quarl] interrupted"
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ run directory


@pytest.mark.parametrize("second", ["fresh", "resume"])
def test_two_runs_into_one_run_dir(tmp_path, second, tiny_cli, capsys):
    run = tmp_path / "run"
    first = make_trainer(make_cfg(tmp_path, *FAST))
    first.prepare_run_dir()
    try:
        extra = [f"resume={run}"] if second == "resume" else []
        other = make_trainer(make_cfg(tmp_path, *FAST, *extra))
        with pytest.raises(RunDirInUse) as info:
            other.train()
        assert str(info.value).startswith(f"{run} is in use by another quarl run (pid {os.getpid()})")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # not moved aside
        assert (run / "config.yaml").is_file()
        cfg_path = tmp_path / "other.yaml"
        cfg_path.write_text(yaml.safe_dump(config_to_dict(make_cfg(tmp_path, *FAST))))
        assert main(["train", str(cfg_path)]) == 1
        assert "is in use by another quarl run" in capsys.readouterr().err
    finally:
        first.close()
    lock_run_dir(run).close()  # free again once the first run closed


def test_a_folder_that_is_not_a_quarl_run_is_refused_and_left_untouched(tmp_path, tiny_cli, capsys):
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / "config.yaml").write_text("not: a run\n")  # a config.yaml alone does not make a run directory
    (repo / "main.py").write_text("print('hello')\n")

    def snapshot():
        return {str(p.relative_to(tmp_path)): p.read_text() if p.is_file() else None for p in tmp_path.rglob("*")}

    before = snapshot()
    with pytest.raises(RunDirError, match=r"output.dir=.*repo is a non-empty folder that is not a quarl run"):
        make_trainer(make_cfg(tmp_path, *FAST, name="repo")).train()
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(config_to_dict(make_cfg(tmp_path, *FAST, name="repo"))))
    before[str(cfg_path.relative_to(tmp_path))] = cfg_path.read_text()
    assert main(["train", str(cfg_path)]) == 2
    assert "not a quarl run" in capsys.readouterr().err
    assert snapshot() == before


def test_an_earlier_run_without_a_lock_file_is_still_moved_aside(tmp_path):
    old = tmp_path / "run"
    (old / "checkpoints").mkdir(parents=True)
    (old / "config.yaml").write_text("train:\n  steps: 1\n")
    make_trainer(make_cfg(tmp_path, *FAST, "train.steps=1")).train()
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.prev-")]
    assert len(moved) == 1 and (moved[0] / "config.yaml").read_text() == "train:\n  steps: 1\n"


def test_output_dir_under_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    cfg = make_cfg(tmp_path, *FAST, name="afile/run")
    with pytest.raises(RunDirError, match=r"output.dir=.*afile/run lies under .*afile, which is a file"):
        make_trainer(cfg).train()
    cfg = make_cfg(tmp_path, *FAST, name="afile")
    with pytest.raises(RunDirError, match=r"output.dir=.*afile is a file"):
        make_trainer(cfg).train()
    assert (tmp_path / "afile").read_text() == "x"


def test_the_saved_config_has_no_resume_and_names_the_reward_function(tmp_path, capsys):
    run = tmp_path / "run"
    make_trainer(make_cfg(tmp_path, *FAST, "train.steps=1")).train()
    out = capsys.readouterr().out
    assert f"[quarl] reward function: test_trainer:digit_reward (from {Path(__file__).parent / 'test_trainer.py'})" \
        in out
    cfg = make_cfg(tmp_path, *FAST, "train.steps=2", f"resume={run}")
    make_trainer(cfg).train()
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert "resume" not in saved and saved["train"]["steps"] == 2
    # used as a template for a new run, it starts fresh instead of resuming (or failing to) from `run`
    again = load_config(run / "config.yaml", [f"output.dir={tmp_path / 'new'}"])
    assert again.resume is None


# ------------------------------------------------------------------------------------------------ export


@pytest.mark.parametrize("flag", [[], ["--overwrite"]])
def test_quarl_export_passes_overwrite(tmp_path, monkeypatch, capsys, flag):
    import quarl.export

    seen = {}

    def fake_export(run_dir, out_dir=None, overwrite=False, dtype=None, verbose=True):
        seen.update(run_dir=run_dir, out_dir=out_dir, overwrite=overwrite, dtype=dtype, verbose=verbose)
        return tmp_path / "export"

    monkeypatch.setattr(quarl.export, "export_from_run", fake_export)
    assert main(["export", str(tmp_path), *flag]) == 0
    assert seen == {"run_dir": str(tmp_path), "out_dir": None, "overwrite": bool(flag), "dtype": "bfloat16",
                    "verbose": True}
