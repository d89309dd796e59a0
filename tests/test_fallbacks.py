"""A fast path that falls back says so: once in the process log (a warning) and once in the run's metrics.jsonl."""

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import make_cfg, make_trainer, read_metrics  # noqa: E402

import quarl.fallbacks as fallbacks  # noqa: E402
from quarl import kernels  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch):
    monkeypatch.setattr(fallbacks, "_reported", {})


def test_a_fallback_warns_once_and_is_listed():
    with pytest.warns(UserWarning, match="cuda_graphs: capture failed"):
        assert fallbacks.report_fallback("cuda_graphs", "capture failed (boom); decoding without graphs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second report of the same path must stay quiet
        assert not fallbacks.report_fallback("cuda_graphs", "capture failed again")
    assert fallbacks.reported_fallbacks() == {"cuda_graphs": "capture failed (boom); decoding without graphs"}


def test_a_kernel_that_fails_its_check_is_reported():
    def crash():
        raise RuntimeError("no compiler here\nsecond line of a long traceback")

    with pytest.warns(UserWarning, match="probe kernel: failed its check"):
        assert not kernels.kernel_passes_check("probe kernel", crash)
    reason = fallbacks.reported_fallbacks()["probe kernel"]
    assert "RuntimeError: no compiler here" in reason and "second line" not in reason
    with pytest.warns(UserWarning, match="wrong kernel: disagrees"):
        assert not kernels.kernel_passes_check("wrong kernel", lambda: False)
    assert kernels.kernel_passes_check("good kernel", lambda: True)
    assert "good kernel" not in fallbacks.reported_fallbacks()


def test_the_run_records_each_fallback_in_the_step_it_happened(tmp_path):
    """A fallback met in step 2's rollout appears in step 2's record only; one from before the run (a kernel
    check of an earlier run in this process still applies) appears in step 1's."""
    fallbacks.report_fallback("kernel X", "failed its check (RuntimeError: earlier); using torch")
    cfg = make_cfg(tmp_path, "train.steps=3", "rollout.max_new_tokens=3")
    trainer = make_trainer(cfg)
    generate = trainer.engine.generate
    calls = []

    def generate_with_a_fallback(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            fallbacks.report_fallback("cuda_graphs", "CUDA graph capture failed (RuntimeError: x); eager decode")
        return generate(*args, **kwargs)

    trainer.engine.generate = generate_with_a_fallback
    with pytest.warns(UserWarning, match="cuda_graphs"):
        trainer.train()
    records = read_metrics(cfg.output.dir if isinstance(cfg.output.dir, Path) else Path(cfg.output.dir))
    steps = {r["step"]: r for r in records if "step" in r and "time/step_s" in r}
    assert steps[1]["fallbacks"] == {"kernel X": "failed its check (RuntimeError: earlier); using torch"}
    assert steps[2]["fallbacks"] == {"cuda_graphs": "CUDA graph capture failed (RuntimeError: x); eager decode"}
    assert "fallbacks" not in steps[3]
    assert torch.isfinite(torch.tensor(steps[3]["time/step_s"]))
