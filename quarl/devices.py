"""Device selection shared by the trainer and the command line."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N (N = GPU index)"
_CUDA = re.compile(r"^cuda(?::(\d+))?$")
# Where Linux states a container's CPU quota (cgroup v2, else v1).
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"


def resolve_device(name: str | torch.device) -> torch.device:
    """"auto" -> cuda when a GPU is visible, else cpu; "cpu"; "cuda" / "cuda:N" when that GPU is visible.

    Raises ValueError (one line, naming the value and the accepted ones) for anything else (e.g. "tpu", "gpu"),
    for cuda without a visible GPU and for a GPU index beyond the visible GPUs.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise ValueError(f"device {name!r} is not a device name; use {DEVICE_CHOICES}")
    text = name.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    m = _CUDA.match(text)
    if m is None:
        hint = " (write cuda for a GPU)" if text in ("gpu", "nvidia") or text.startswith("gpu:") else ""
        raise ValueError(f"device {name!r} is not supported{hint}; use {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asks for a GPU but none is visible (torch.cuda.is_available() is "
                         "False: no GPU, no driver, or a CPU-only PyTorch build); use device cpu or auto")
    if m.group(1) is not None:
        index, count = int(m.group(1)), torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"device {name!r} asks for GPU {index} but {count} GPU(s) are visible "
                             f"(cuda:0 .. cuda:{count - 1}); check CUDA_VISIBLE_DEVICES or pick another index")
        return torch.device("cuda", index)
    return torch.device("cuda")


def available_cpus() -> int:
    """CPU cores this process may use: its affinity mask (taskset, cpusets), capped by a cgroup CPU quota
    (containers started with --cpus), which os.cpu_count() and torch's default both ignore."""
    import math
    import os

    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        count = os.cpu_count() or 1
    quota = None
    try:  # cgroup v2: "max 100000" (no quota) or "200000 100000" (2 cores)
        limit, period = Path(CGROUP_CPU_MAX).read_text().split()[:2]
        if limit != "max":
            quota = int(limit) / int(period)
    except (OSError, ValueError):
        try:  # cgroup v1: -1 = no quota
            limit = int(Path(CGROUP_V1_CPU, "cpu.cfs_quota_us").read_text())
            period = int(Path(CGROUP_V1_CPU, "cpu.cfs_period_us").read_text())
            if limit > 0 and period > 0:
                quota = limit / period
        except (OSError, ValueError):
            pass
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def set_cpu_threads(device: torch.device) -> int | None:
    """On a CPU run, lower torch's thread pool to the cores available to this process (`available_cpus`) where it
    is larger: more threads than cores makes every matmul wait on descheduled threads. OMP_NUM_THREADS, when set, is the user's
    choice and is left alone, as are GPU runs. Returns the thread count in use, or None when it was left alone."""
    import os

    if torch.device(device).type != "cpu" or os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    # never raised: torch's default is the physical cores, and the affinity mask also counts hyperthreads
    threads = min(available_cpus(), torch.get_num_threads())
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
