"""B6 harness (`quarl bench quality`): every setting is a valid run config, and the report's numbers (means and
spreads over seeds, time to the bf16 accuracy, targets) are computed from the run folders."""

import argparse
import json
import statistics
import warnings

import pytest

from quarl.bench import quality
from quarl.config import load_config


def _args(**kw):
    base = dict(steps=100, eval_every=25, runs_dir="runs/quality", overrides=[])
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("setting", list(quality.SETTINGS))
def test_every_setting_is_a_valid_run_config(setting):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a clip setting that cannot bind
        cfg = load_config(None, quality.run_overrides(setting, 2, _args()))
    assert cfg.train.seed == 2 and cfg.train.steps == 100 and cfg.eval.every == 25
    assert cfg.output.dir.endswith(f"{setting}-s2")
    assert cfg.rollout.stop == ("\n",) and cfg.data.ops == ("+", "-") and cfg.data.eval_limit == 256
    assert cfg.rollout.prompts_per_step * cfg.rollout.num_generations == 128
    # a setting names its adapters' start: only the base-error ones start away from B = 0
    assert cfg.precision.resolved_lora_init == ("base_error" if "base-error" in setting else "zeros")


def test_unknown_setting_and_bad_seeds_are_refused():
    with pytest.raises(ValueError, match="unknown B6 setting"):
        quality.parse_settings("bf16,fp3")
    with pytest.raises(ValueError, match="comma list of integers"):
        quality.parse_seeds("0,x")


def _write_run(root, name, seed, evals, full, step_s, kl):
    run = root / f"{name}-s{seed}"
    run.mkdir(parents=True)
    rows = []
    for step in range(1, 5):
        rows.append({"step": step, "time/step_s": step_s, "time/sync_s": 0.01, "time/rollout_s": 0.5,
                     "time/prox_s": 0.0, "time/train_s": step_s - 0.51, "mismatch/kl": kl})
    for step, acc in evals.items():
        row = {"step": step, "eval/accuracy": acc}
        if full is not None:
            row["eval_full/accuracy"] = full[step]
        rows.append(row)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in sorted(rows, key=lambda r: r["step"])))


def test_summary_means_reach_and_targets(tmp_path):
    ref = {0: [0.2, 0.3], 2: [0.5, 0.6], 4: [0.7, 0.8]}
    fast = {0: [0.2, 0.2], 2: [0.76, 0.74], 4: [0.74, 0.76]}
    for seed in range(2):
        _write_run(tmp_path, "bf16", seed, {s: v[seed] for s, v in ref.items()}, None, 1.0, 0.001)
        _write_run(tmp_path, "split-int8-tis", seed, {s: v[seed] for s, v in fast.items()},
                   {s: v[seed] + 0.01 for s, v in fast.items()}, 1.5, 0.04)
    table, verdicts = quality.summarize(str(tmp_path))
    bf16_row = next(line for line in table.splitlines() if line.startswith("| bf16 |"))
    assert f"0.750 ± {statistics.stdev([0.7, 0.8]):.3f}" in bf16_row
    int8_row = next(line for line in table.splitlines() if line.startswith("| split-int8-tis |"))
    assert "0.210 -> 0.760" in int8_row and "0.0400" in int8_row
    # bf16's final mean 0.75 is first reached by int8 at step 2, after 2 steps of 1.5 s
    timing = [line for line in table.splitlines() if line.startswith("| split-int8-tis |")][1]
    assert timing.split("|")[2].strip() == "2" and timing.split("|")[3].strip() == "3"
    assert "1.50x" in timing
    assert "split-int8-tis within 2 points of bf16 at step 4: 0.750 vs 0.750 -> met" in verdicts
    assert "sync <= 1 % of every step: met" in verdicts  # 0.01 s of 1.0 / 1.5 s steps
    assert any(v.startswith("every median step <= 1.1x bf16's: missed (split-int8-tis 1.50x") for v in verdicts)


def test_summary_without_runs_says_where_it_looked(tmp_path):
    with pytest.raises(ValueError, match="no B6 run folders"):
        quality.summarize(str(tmp_path))


def test_an_out_of_memory_death_is_retried_and_other_errors_are_not(tmp_path):
    _write_run(tmp_path, "bf16", 0, {0: 0.2}, None, 1.0, 0.0)  # made steps before it died
    (tmp_path / "bf16-s0.log").write_text("torch.OutOfMemoryError: CUDA out of memory")
    (tmp_path / "bf16-s1.log").write_text("torch.OutOfMemoryError: CUDA out of memory")
    (tmp_path / "bf16-s2.log").write_text("ValueError: something else")
    assert quality._out_of_memory(str(tmp_path), "bf16", 0)
    assert quality._out_of_memory(str(tmp_path), "bf16", 1)
    assert not quality._out_of_memory(str(tmp_path), "bf16", 2)
    assert not quality._out_of_memory(str(tmp_path), "bf16", 3)  # no log


def test_a_failed_run_is_left_out_of_the_summary_and_named(tmp_path):
    for seed, acc in ((0, 0.7), (1, 0.8)):
        _write_run(tmp_path, "bf16", seed, {0: 0.2, 4: acc}, None, 1.0, 0.0)
    _write_run(tmp_path, "bf16", 2, {0: 0.2}, None, 9.0, 0.0)  # died after its first eval
    quality._failed_marker(str(tmp_path), "bf16", 2).write_text("exit 1\n")
    table, _ = quality.summarize(str(tmp_path))
    bf16_row = next(line for line in table.splitlines() if line.startswith("| bf16 |"))
    assert bf16_row.split("|")[2].strip() == "2" and "0.750 ±" in bf16_row
    timing = [line for line in table.splitlines() if line.startswith("| bf16 |")][1]
    assert timing.split("|")[4].strip() == "1.00"  # the failed run's 9 s steps are not in the median
    assert "Left out (stopped with an error; see each one's .log): bf16 seed 2" in table


def test_launch_all_retries_out_of_memory_deaths_and_marks_other_failures(tmp_path, monkeypatch, capsys):
    """Fake `quarl train` processes: seed 0 succeeds, seed 1 runs out of GPU memory once while others run and
    succeeds when run again, seed 2 fails with another error (marked, left out), seed 3 runs out of memory while
    alone on the GPU (marked, not retried forever)."""
    import sys
    from types import SimpleNamespace

    def fake(setting, seed, args):
        flag = tmp_path / f"tried-{seed}"
        script = {
            0: "import time; time.sleep(1.5)",
            1: f"import os, sys, pathlib; p = pathlib.Path({str(flag)!r})\n"
               "if not p.exists():\n    p.touch(); print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(1)",
            2: "import sys; print('ValueError: bad'); sys.exit(1)",
            3: "import sys, time; time.sleep(4); print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(1)",
        }[seed]
        return [sys.executable, "-c", script]

    monkeypatch.setattr(quality, "train_command", fake)
    args = SimpleNamespace(runs_dir=str(tmp_path), parallel=0, time_budget=None)
    quality.launch_all([("bf16", s) for s in range(4)], args)
    out = capsys.readouterr().out
    assert "bf16 seed 1: out of GPU memory after 0 steps; queued again" in out and "bf16 seed 1: done" in out
    assert (tmp_path / "tried-1").exists()
    assert not quality._failed_marker(str(tmp_path), "bf16", 0).exists()
    assert not quality._failed_marker(str(tmp_path), "bf16", 1).exists()  # the retry succeeded
    assert quality._failed_marker(str(tmp_path), "bf16", 2).exists() and "bf16 seed 2: FAILED" in out
    assert quality._failed_marker(str(tmp_path), "bf16", 3).exists() and "bf16 seed 3: FAILED" in out


def test_launch_all_reports_runs_the_time_budget_stopped_as_stopped_not_failed(tmp_path, monkeypatch, capsys):
    """Fake runs that write two steps and wait: the budget's SIGINT stops them. Seed 0 exits 130 as `quarl train`
    does: its line names the budget and the step it reached, and it gets no failure marker (the summary keeps its
    curve). Seed 1 fails with exit 1 while stopping: it is reported FAILED and marked, budget or not."""
    import json
    import sys
    from types import SimpleNamespace

    def fake(setting, seed, args):
        metrics = tmp_path / f"{setting}-s{seed}" / "metrics.jsonl"
        metrics.parent.mkdir(exist_ok=True)
        return [sys.executable, "-c",
                f"import json, signal, sys, time, pathlib; p = pathlib.Path({str(metrics)!r})\n"
                f"signal.signal(signal.SIGINT, lambda *a: sys.exit({130 if seed == 0 else 1}))\n"
                "p.write_text(''.join(json.dumps({'step': s, 'time/step_s': 1.0}) + '\\n' for s in (1, 2)))\n"
                "time.sleep(60)"]

    monkeypatch.setattr(quality, "train_command", fake)
    args = SimpleNamespace(runs_dir=str(tmp_path), parallel=0, time_budget=3.0)
    quality.launch_all([("bf16", 0), ("bf16", 1)], args)
    out = capsys.readouterr().out
    assert "bf16 seed 0: stopped by the time budget at step 2" in out, out
    assert not quality._failed_marker(str(tmp_path), "bf16", 0).exists()
    assert json.loads((tmp_path / "bf16-s0" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
    assert "bf16 seed 1: FAILED (exit 1" in out, out
    assert quality._failed_marker(str(tmp_path), "bf16", 1).exists()
