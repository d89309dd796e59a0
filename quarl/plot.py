"""`quarl plot RUN_DIR`: PNG curves of the per-step metrics of a run."""

from __future__ import annotations

from pathlib import Path

from quarl.rl.run_log import read_metrics

PANELS = {
    "reward": ["reward/mean"],
    "heldout_accuracy": ["eval/accuracy", "eval_full/accuracy"],
    "mismatch_kl": ["mismatch/kl", "mismatch/k3_kl"],
    "is_weights": ["is/weight_mean", "is/truncated_frac", "is/masked_frac"],
    "clip": ["clip/frac_low", "clip/frac_high"],
    "step_time": ["time/sync_s", "time/rollout_s", "time/prox_s", "time/train_s"],
}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per panel that has data; returns the written paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("quarl plot needs matplotlib: pip install matplotlib") from e
    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in PANELS.items():
        series = {k: [(r["step"], r[k]) for r in records if r.get(k) is not None] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set_xlabel("step")
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if not written:
        raise ValueError(f"{run_dir}/metrics.jsonl has no plottable metrics yet")
    return written
