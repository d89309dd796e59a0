"""Fallbacks from a fast path to a slower correct one, reported once and collected for the run's metrics.

A fast path that cannot run (a CUDA graph that fails to capture, a kernel that fails its self-check) falls back
to a correct slower path instead of stopping the run. That must never happen silently: `report_fallback` warns
once per `what` (on stderr, as a UserWarning), and the trainer copies each fallback in effect into the `metrics.jsonl` record
of the first step it applies to (key `fallbacks`), so a slow run can be explained from its files.

    report_fallback("cuda_graphs", "capture failed (RuntimeError: ...); decoding without graphs")
    reported_fallbacks()   # {"cuda_graphs": "capture failed ..."}
"""

from __future__ import annotations

import threading
import warnings

_lock = threading.Lock()
_reported: dict[str, str] = {}  # what -> reason, every fallback of this process (first reason kept)


def report_fallback(what: str, reason: str) -> bool:
    """Record that `what` (a short name, e.g. "cuda_graphs") fell back, and why. Warns and logs the first report
    of each `what` only; returns True when this report was the first."""
    with _lock:
        if what in _reported:
            return False
        _reported[what] = reason
    warnings.warn(f"{what}: {reason}", UserWarning, stacklevel=2)
    return True


def reported_fallbacks() -> dict[str, str]:
    """Every fallback this process reported so far ({what: reason})."""
    with _lock:
        return dict(_reported)
