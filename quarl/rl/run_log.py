"""Per-step records of a run: metrics.jsonl, TensorBoard events, and a sample of completions."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from quarl.rl.checkpoint import atomic_write_bytes


class RunLog:
    """Appends one JSON record per step to RUN_DIR/metrics.jsonl (flushed each step) and mirrors it to TensorBoard."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "samples.jsonl"
        if resume_step is not None:
            # Records written after the checkpoint belong to steps that will be run again.
            for path in (self.metrics_path, self.samples_path):
                self._truncate_after(path, resume_step)
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
            self.samples_path.unlink(missing_ok=True)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.dir / "tb"))
            except Exception as e:  # tensorboard is an optional extra
                warnings.warn(f"TensorBoard logging is off ({e}); `pip install tensorboard` to enable it")

    @staticmethod
    def _truncate_after(path: Path, step: int) -> None:
        """Keep the records of steps <= step (a torn last line from a crash is dropped), rewritten atomically."""
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step}
        record.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()})
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def samples(self, step: int, rows: list[dict]) -> None:
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def close(self) -> None:
        """Close the TensorBoard writer (metrics.jsonl and samples.jsonl are closed after every write); idempotent."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a quarl run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
