"""Per-step records of a run: metrics.jsonl, samples of completions, and the experiment trackers.

RUN_DIR/metrics.jsonl (one record per step) and RUN_DIR/samples.jsonl are always written: `quarl plot` and the
tests read them. The trackers named in `report_to` mirror them:

  * "tensorboard": scalars, the run's config (as text and in the HParams tab) and the completions as text, in
    RUN_DIR/tb (`tensorboard --logdir RUN_DIR/tb`);
  * "wandb": Weights & Biases (`pip install 'quarl[wandb]'`): scalars, the config, and the completions as tables.
    Its files go to RUN_DIR/wandb; WANDB_MODE=offline keeps the run on disk (`wandb sync` uploads it later). The
    run id is kept in RUN_DIR/wandb_run_id so that a resumed run continues the same W&B run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import sys
import warnings
from pathlib import Path

from quarl.rl.checkpoint import atomic_write_bytes

TRACKERS = ("tensorboard", "wandb")
# Scalars the TensorBoard HParams tab lists next to each run's hyperparameters.
HPARAM_METRICS = ("reward/mean", "eval/accuracy")
SAMPLES_IN_TEXT = 8  # completions per step shown in TensorBoard text / W&B tables (all go to the JSONL files)
WANDB_ID_FILE = "wandb_run_id"
WANDB_MISSING = ("output.report_to names wandb, which is not installed: pip install 'quarl[wandb]' (or drop wandb "
                 "from output.report_to)")


def parse_report_to(report_to) -> list[str]:
    """The trackers of `output.report_to`: a list, or one string ("wandb", "tensorboard,wandb"); "none" or an empty
    list turns them all off. An unknown name raises ValueError saying which names exist."""
    if report_to is None:
        return []
    items = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names: list[str] = []
    for item in items:
        name = str(item).strip().lower()
        if name in ("", "none", "jsonl"):  # metrics.jsonl is always written
            continue
        if name not in TRACKERS:
            raise ValueError(f"output.report_to: unknown tracker {item!r}; choose from {', '.join(TRACKERS)} "
                             "(e.g. output.report_to=[tensorboard,wandb]) or none")
        if name not in names:
            names.append(name)
    return names


def flatten_config(config: dict, prefix: str = "") -> dict:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; values that are not int/float/str/bool become strings."""
    flat: dict = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:  # None, lists, tuples
            flat[name] = "none" if value is None else str(value)
    return flat


def _markdown_cell(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def samples_markdown(rows: list[dict]) -> str:
    """A Markdown table of sample rows (TensorBoard's text tab renders it); columns: the union of the rows' keys."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_markdown_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class RunLog:
    """Appends one JSON record per step to RUN_DIR/metrics.jsonl (flushed each step) and mirrors it to the trackers.

    Args:
        run_dir: the run directory.
        tensorboard: shorthand for report_to=["tensorboard"] (used when report_to is None).
        resume_step: records after this step are dropped (a resumed run repeats those steps).
        report_to: trackers, see `parse_report_to` ("tensorboard", "wandb"; "none").
        config: the run's resolved configuration (nested dict): TensorBoard text + HParams, W&B config.
        wandb_project / wandb_name: the W&B project (default $WANDB_PROJECT, else "quarl") and run name (default
            the run directory's name).
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None, *,
                 report_to=None, config: dict | None = None, wandb_project: str | None = None,
                 wandb_name: str | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trackers = parse_report_to(report_to) if report_to is not None else (
            ["tensorboard"] if tensorboard else [])
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "samples.jsonl"
        self.eval_samples_path = self.dir / "eval_samples.jsonl"
        paths = (self.metrics_path, self.samples_path, self.eval_samples_path)
        if resume_step is not None:
            # Records written after the checkpoint belong to steps that will be run again.
            for path in paths:
                self._truncate_after(path, resume_step)
        elif self.metrics_path.exists():
            for path in paths:
                path.unlink(missing_ok=True)
        self.writer = None
        self.wandb_run = None
        if "wandb" in self.trackers:  # first: a missing package fails before anything else is opened
            self.wandb_run = self._start_wandb(config, wandb_project, wandb_name, resume_step is not None)
        if "tensorboard" in self.trackers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.dir / "tb"))
            except Exception as e:  # a broken tensorboard install must not stop training
                warnings.warn(f"TensorBoard logging is off ({e}); `pip install tensorboard` to enable it")
        if self.writer is not None and config:
            self._tensorboard_config(config)

    @classmethod
    def from_config(cls, run_dir: str | Path, cfg, resume_step: int | None = None) -> "RunLog":
        """The run log a run config asks for: output.report_to (validated, with output.tensorboard=false folded
        in), output.wandb_project, output.wandb_name; the effective config (null defaults resolved) goes to the
        trackers."""
        from quarl.config import effective_config_dict

        out = cfg.output
        config = effective_config_dict(cfg)
        config.pop("resume", None)
        return cls(run_dir, resume_step=resume_step, report_to=list(out.report_to), config=config,
                   wandb_project=out.wandb_project, wandb_name=out.wandb_name)

    @staticmethod
    def check_installed(report_to) -> None:
        """Raise ImportError (one line: what to install) when a tracker of `report_to` is missing; cheap, without
        importing it, so that a run fails before its model loads."""
        if "wandb" in parse_report_to(list(report_to)) and not _installed("wandb"):
            raise ImportError(WANDB_MISSING)

    # ------------------------------------------------------------------------------------------- trackers
    def _start_wandb(self, config, project, name, resuming: bool):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(WANDB_MISSING) from e
        id_path = self.dir / WANDB_ID_FILE
        run_id = id_path.read_text().strip() if resuming and id_path.is_file() else None
        if not run_id:
            run_id = secrets.token_hex(6)  # W&B run ids: letters and digits
            atomic_write_bytes(id_path, run_id.encode())
        return wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "quarl", name=name or self.dir.name,
                          id=run_id, resume="allow", dir=str(self.dir), config=config or {})

    def _tensorboard_config(self, config: dict) -> None:
        import yaml

        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)
        try:
            from torch.utils.tensorboard.summary import hparams

            # Written into this run's own event file (SummaryWriter.add_hparams would open a second run folder).
            exp, start, end = hparams(flatten_config(config), {k: float("nan") for k in HPARAM_METRICS})
            for summary in (exp, start, end):
                self.writer.file_writer.add_summary(summary)
        except Exception as e:  # the text above already carries the config
            warnings.warn(f"TensorBoard hyperparameters were not written ({e})")
        self.writer.flush()

    # ------------------------------------------------------------------------------------------- records
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
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def _append(self, path: Path, step: int, rows: list[dict]) -> None:
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def _mirror_text(self, tag: str, step: int, rows: list[dict]) -> None:
        rows = rows[:SAMPLES_IN_TEXT]
        if not rows:
            return
        if self.writer is not None:
            self.writer.add_text(tag, samples_markdown(rows), step)
            self.writer.flush()
        if self.wandb_run is not None:
            import wandb

            columns = list(dict.fromkeys(k for row in rows for k in row))
            table = wandb.Table(columns=columns, data=[[_table_value(row.get(c)) for c in columns] for row in rows])
            self.wandb_run.log({tag: table}, step=step)

    def samples(self, step: int, rows: list[dict]) -> None:
        """Training completions of a step: RUN_DIR/samples.jsonl, and text / tables in the trackers."""
        self._append(self.samples_path, step, rows)
        self._mirror_text("samples", step, rows)

    def eval_samples(self, step: int, rows: list[dict]) -> None:
        """Held-out completions and their scores (`evaluate(..., records=...)`): RUN_DIR/eval_samples.jsonl, and
        the first few as text / tables in the trackers."""
        self._append(self.eval_samples_path, step, rows)
        self._mirror_text("eval_samples", step, rows)

    def close(self) -> None:
        """Close the TensorBoard writer and finish the W&B run (the JSONL files are closed after every write);
        idempotent."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _installed(module: str) -> bool:
    if module in sys.modules:  # None there means "import fails"
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _table_value(value):
    return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value)


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a quarl run directory?")
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a crash mid-write
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records
