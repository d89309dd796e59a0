"""`quarl plot`: one labelled small-multiples page (integer steps, fractions in percent apart from IS weights,
loss / grad norm / entropy included) and a Markdown summary beside it."""

import json

import pytest

pytest.importorskip("matplotlib")

from matplotlib.ticker import PercentFormatter  # noqa: E402

from quarl.cli import main  # noqa: E402
from quarl.plot import overview_figure  # noqa: E402


def _records(steps=5):
    out = [{"step": 0, "eval/accuracy": 0.25}]
    for s in range(1, steps + 1):
        out.append({"step": s, "reward/mean": 0.1 * s, "reward/std": 0.05, "train/loss": 0.01 / s,
                    "train/grad_norm": 10.0 ** (2 - s), "policy/entropy": 1.5 - 0.1 * s,
                    "mismatch/kl": 1e-4, "mismatch/k3_kl": 2e-6, "is/weight_mean": 1.0 + 1e-4 * s,
                    "is/truncated_frac": 0.01, "clip/frac_high": 0.002 * s, "time/rollout_s": 1.0,
                    "time/train_s": 0.5, "time/step_s": 1.6, "rollout/answer_len_mean": 12.0,
                    "fallbacks": {"gemm": "eager"}, "train/skipped_updates": None})
    out.append({"step": steps, "eval/accuracy": 0.75})
    return out


def _write_run(run, records, torn=False):
    run.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_text(text + ('{"step": 9, "reward/m' if torn else ""))
    (run / "config.yaml").write_text("model:\n  name: tiny-random-llama\nprecision:\n  flow: split\n  format: int8\n"
                                     "loss:\n  loss_type: grpo\n  correction: tis\nlora:\n  rank: 0\n")
    (run / "samples.jsonl").write_text("".join(
        json.dumps({"step": s, "prompt": f"{s} + 1", "gold": str(s + 1), "completion": f"answer {s + 1}",
                    "reward": 1.0}) + "\n" for s in (4, 5)))


def test_panels_are_labelled_with_integer_steps_and_separate_scales():
    import matplotlib.pyplot as plt

    fig, panels = overview_figure(_records(), "title")
    by_title = {panel.title: ax for panel, ax in panels}
    assert {"Reward", "Held-out accuracy", "Policy loss", "Gradient norm", "Policy entropy",
            "Rollout-training mismatch", "Importance weights", "Tokens corrected or clipped", "Answer length",
            "Time per step"} == set(by_title)  # no panel for metrics the run did not log (throughput)
    fig.canvas.draw()
    for title, ax in by_title.items():
        assert ax.get_xlabel() == "RL step" and ax.get_ylabel(), title
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), (title, ticks)
    # fractions in percent on their own axis; IS weights (~1) on theirs, read without an offset
    fractions = by_title["Tokens corrected or clipped"]
    assert isinstance(fractions.yaxis.get_major_formatter(), PercentFormatter)
    weights = by_title["Importance weights"]
    assert not isinstance(weights.yaxis.get_major_formatter(), PercentFormatter)
    assert weights.yaxis.get_offset_text().get_text() == ""
    assert {line.get_label() for line in weights.get_lines() if not line.get_label().startswith("_")} == {"IS weight"}
    assert by_title["Gradient norm"].get_yscale() == "log"  # 100 down to 0.001
    assert by_title["Policy loss"].get_yscale() == "linear"
    assert by_title["Held-out accuracy"].get_ylim()[1] > 1.0  # a full 0-100 % axis
    accuracy = by_title["Held-out accuracy"].get_lines()[0]
    assert list(accuracy.get_xdata()) == [0, 5] and list(accuracy.get_ydata()) == [0.25, 0.75]
    plt.close(fig)


def test_plot_writes_the_page_and_a_markdown_summary(tmp_path, capsys):
    run = tmp_path / "myrun"
    _write_run(run, _records(), torn=True)  # a line torn by a crash is skipped
    assert main(["plot", str(run)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(run / "plots" / "overview.png"), str(run / "plots" / "summary.md")]
    png = (run / "plots" / "overview.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
    md = (run / "plots" / "summary.md").read_text()
    assert md.startswith("# Run `myrun`")
    assert "model tiny-random-llama, flow split, format int8, loss grpo, correction tis." in md
    assert "5 RL steps logged (steps 1 to 5)." in md
    assert "| mean reward | 0.1 | 0.5 | 0.3 | 0.5 (5) |" in md
    assert "| held-out accuracy (rollout precision) | 0.25 | 0.75 | 0.5 | 0.75 (5) |" in md
    assert "![curves of myrun](overview.png)" in md
    assert "## Completions at step 5" in md and "answer 6" in md and "answer 5" not in md


def test_plot_of_an_empty_run_says_what_is_missing(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run, [{"step": 1, "fallbacks": {"x": "y"}}])
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert "no plottable metrics yet" in err and len(err.strip().splitlines()) == 1
