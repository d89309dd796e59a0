"""`quarl plot RUN_DIR`: one PNG page of a run's curves (small multiples) and a Markdown summary beside it.

RUN_DIR/plots/overview.png holds one panel per group of metrics that the run logged (panels without data are left
out); RUN_DIR/plots/summary.md names the run's setup, tabulates first / last / best values, shows the page and a
few of the last completions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from quarl.rl.run_log import read_metrics


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    keys: tuple[str, ...]
    labels: tuple[str, ...] = ()  # legend entries, one per key (default: the key)
    scale: str = "linear"  # linear | log-if-wide (log when every value is > 0 and they span > 30x) | percent
    ylim: tuple[float | None, float | None] | None = None
    reference: float | None = None  # a dotted horizontal line (e.g. 1.0 for IS weights)
    stacked: bool = False  # stacked bars (parts of a whole, e.g. the time of a step)
    band: dict = field(default_factory=dict)  # key -> key of its standard deviation (a shaded ±1 std band)


PANELS = (
    Panel("Reward", "mean reward per answer", ("reward/mean", "reward/trained_mean"),
          ("all answers", "answers trained on"), band={"reward/mean": "reward/std"}),
    Panel("Held-out accuracy", "accuracy (% correct)", ("eval/accuracy", "eval_full/accuracy"),
          ("rollout precision", "full precision"), scale="percent", ylim=(0, 1)),
    Panel("Policy loss", "loss (per token)", ("train/loss",)),
    Panel("Gradient norm", "L2 norm (before clipping)", ("train/grad_norm",), scale="log-if-wide"),
    Panel("Policy entropy", "entropy (nats / token)", ("policy/entropy",)),
    Panel("Rollout-training mismatch", "KL (nats / token)", ("mismatch/kl", "mismatch/k3_kl"),
          ("k1 estimate of KL(μ‖π)", "k3 estimate"), scale="log-if-wide"),
    Panel("Importance weights", "mean weight π/μ (1 = no mismatch)", ("is/weight_mean", "policy/ratio_mean"),
          ("IS weight", "PPO ratio"), reference=1.0),
    Panel("Tokens corrected or clipped", "% of answer tokens",
          ("is/truncated_frac", "is/masked_frac", "clip/frac_low", "clip/frac_high"),
          ("IS truncated", "IS masked", "clipped low", "clipped high"), scale="percent"),
    Panel("Answer length", "tokens per answer", ("rollout/answer_len_mean",)),
    Panel("Rollout throughput", "tokens / s", ("rollout/tokens_per_s",)),
    Panel("Time per step", "seconds", ("time/sync_s", "time/rollout_s", "time/prox_s", "time/train_s"),
          ("weight sync", "rollout", "π_prox forward", "update"), stacked=True),
)
# Rows of the Markdown summary: key -> (what, "max" | "min" when larger / smaller is better, else "").
SUMMARY = {
    "reward/mean": ("mean reward", "max"),
    "eval/accuracy": ("held-out accuracy (rollout precision)", "max"),
    "eval_full/accuracy": ("held-out accuracy (full precision)", "max"),
    "train/loss": ("policy loss", ""),
    "train/grad_norm": ("gradient norm", ""),
    "policy/entropy": ("entropy (nats / token)", ""),
    "mismatch/kl": ("mismatch KL, k1 estimate (nats / token)", ""),
    "mismatch/k3_kl": ("mismatch KL, k3 estimate (nats / token)", ""),
    "is/weight_mean": ("mean IS weight", ""),
    "rollout/answer_len_mean": ("answer length (tokens)", ""),
    "rollout/tokens_per_s": ("rollout throughput (tokens / s)", "max"),
    "time/step_s": ("time per step (s)", "min"),
}
OVERVIEW = "overview.png"
SUMMARY_MD = "summary.md"


def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of the records holding a finite number for `key`; a later record of a step replaces an
    earlier one (a step can be logged twice: its training metrics, then an eval at the same step)."""
    points: dict[int, float] = {}
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            points[int(r["step"])] = float(v)
    return sorted(points.items())


def _draw(ax, panel: Panel, records: list[dict]) -> bool:
    """Draw `panel` on `ax`; False when the run logged none of its metrics."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    series = {k: _series(records, k) for k in panel.keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return False
    labels = dict(zip(panel.keys, panel.labels or panel.keys))
    if panel.stacked:
        steps = sorted({s for pts in series.values() for s, _ in pts})
        bottom = [0.0] * len(steps)
        for key, pts in series.items():
            values = dict(pts)
            heights = [values.get(s, 0.0) for s in steps]
            ax.bar(steps, heights, bottom=bottom, width=0.8, label=labels[key])
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_ylim(0, max(bottom) * 1.35 or 1.0)  # headroom for the legend above the bars
    else:
        for i, (key, pts) in enumerate(series.items()):
            xs, ys = zip(*pts)
            # a line style per series: series that coincide (e.g. every group trained on) stay distinguishable
            line, = ax.plot(xs, ys, marker="os^D"[i % 4] if len(xs) <= 40 else None, markersize=4 - 0.5 * (i % 4),
                            linewidth=1.5, linestyle=("-", "--", "-.", ":")[i % 4], label=labels[key])
            std_key = panel.band.get(key)
            std = dict(_series(records, std_key)) if std_key else {}
            if std:
                lo = [y - std.get(x, 0.0) for x, y in pts]
                hi = [y + std.get(x, 0.0) for x, y in pts]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0,
                                label=f"{labels[key]} ± 1 std")
    values = [v for pts in series.values() for _, v in pts]
    if panel.reference is not None:
        ax.axhline(panel.reference, color="0.4", linestyle=":", linewidth=1)
    if panel.scale == "percent":
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=None))
        if panel.ylim is None and max(values) <= 0:
            ax.set_ylim(0, 0.01)  # all zero: a flat line at the bottom, not in the middle of [-0.05, 0.05]
        elif panel.ylim is None:
            ax.set_ylim(0, None)
    elif panel.scale == "log-if-wide" and min(values) > 0 and max(values) / min(values) > 30:
        ax.set_yscale("log")
    else:
        # no "+1" offset above the axis: IS weights near 1 read as 0.9998 ... 1.0002
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useMathText=True, useOffset=False)
    if panel.ylim is not None:
        ax.set_ylim(*panel.ylim)
        if panel.scale == "percent":
            ax.set_ylim(-0.03, 1.03)  # a point at 0 or 100 % stays visible
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
    steps = [s for pts in series.values() for s, _ in pts]
    if min(steps) == max(steps):
        ax.set_xlim(min(steps) - 1, max(steps) + 1)
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel("RL step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1 or panel.labels:
        ax.legend(fontsize=8, loc="upper center" if panel.stacked else "best", framealpha=0.8,
                  ncol=min(4, len(series)) if panel.stacked else 1)
    return True


def _run_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    try:
        import yaml

        data = yaml.safe_load(path.read_text())
        return data if isinstance(data, dict) else {}
    except Exception:  # a damaged config must not stop the plot
        return {}


def _setup_line(config: dict) -> str:
    def get(section: str, key: str):
        value = config.get(section, {})
        return value.get(key) if isinstance(value, dict) else None

    parts = []
    for label, section, key in (("model", "model", "name"), ("data", "data", "train"),
                                ("flow", "precision", "flow"), ("format", "precision", "format"),
                                ("loss", "loss", "loss_type"), ("correction", "loss", "correction"),
                                ("LoRA rank", "lora", "rank")):
        value = get(section, key)
        if value not in (None, "", 0):
            parts.append(f"{label} {value}")
    return ", ".join(parts)


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _summary_markdown(run_dir: Path, records: list[dict], config: dict, image: str) -> str:
    trained = [s for s, _ in _series(records, "reward/mean")]
    lines = [f"# Run `{run_dir.name}`", ""]
    setup = _setup_line(config)
    if setup:
        lines += [setup + ".", ""]
    if trained:
        lines += [f"{len(trained)} RL steps logged (steps {trained[0]} to {trained[-1]}).", ""]
    lines += ["| metric | first | last | mean | best (step) |", "|---|---|---|---|---|"]
    for key, (what, better) in SUMMARY.items():
        pts = _series(records, key)
        if not pts:
            continue
        best = (max if better == "max" else min)(pts, key=lambda p: p[1]) if better else None
        mean = sum(v for _, v in pts) / len(pts)
        lines.append(f"| {what} | {_fmt(pts[0][1])} | {_fmt(pts[-1][1])} | {_fmt(mean)} | "
                     f"{f'{_fmt(best[1])} ({best[0]})' if best else '–'} |")
    lines += ["", f"![curves of {run_dir.name}]({image})", ""]
    samples = run_dir / "samples.jsonl"
    if samples.is_file():
        rows = []
        for line in samples.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        last = [r for r in rows if r.get("step") == rows[-1].get("step")][:3] if rows else []
        if last:
            lines += [f"## Completions at step {last[0].get('step')}", ""]
            for r in last:
                text = " ".join(str(r.get("completion", "")).split())
                text = text if len(text) <= 300 else text[:297] + "..."
                lines.append(f"- **{_one_line(r.get('prompt', ''))}** (gold {r.get('gold', '?')}, reward "
                             f"{_fmt(r.get('reward'))}): {text}")
            lines.append("")
    return "\n".join(lines)


def _one_line(text, limit: int = 120) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("quarl plot needs matplotlib: pip install matplotlib") from e
    return plt


def overview_figure(records: list[dict], title: str = "", columns: int = 3):
    """The small-multiples figure of `records` (metrics.jsonl records): one panel per entry of PANELS with data.
    Returns (figure, [(panel, axes), ...]); raises ValueError when no panel has data."""
    plt = _pyplot()
    panels = [p for p in PANELS if any(_series(records, k) for k in p.keys)]
    if not panels:
        raise ValueError("no plottable metrics")
    cols = min(columns, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows + 0.6), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, panel, records)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    return fig, list(zip(panels, axes.flat))


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, columns: int = 3) -> list[Path]:
    """Write OUT/overview.png (one panel per metric group with data) and OUT/summary.md; returns both paths.
    OUT defaults to RUN_DIR/plots. Raises FileNotFoundError without RUN_DIR/metrics.jsonl and ValueError when it
    holds no plottable metric yet."""
    plt = _pyplot()
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    config = _run_config(run_dir)
    setup = _setup_line(config)
    try:
        fig, _ = overview_figure(records, f"quarl run {run_dir.name}" + (f" — {setup}" if setup else ""), columns)
    except ValueError:
        raise ValueError(f"{run_dir}/metrics.jsonl has no plottable metrics yet (run at least one step)") from None
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    image = out / OVERVIEW
    fig.savefig(image, dpi=110)
    plt.close(fig)
    summary = out / SUMMARY_MD
    summary.write_text(_summary_markdown(run_dir, records, config, OVERVIEW))
    return [image, summary]
