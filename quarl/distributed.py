"""Many processes on torch.distributed: start-up and teardown, rank helpers, reductions (docs/DISTRIBUTED.md).

A run is distributed when it was started by torchrun (`torch.distributed.run`), which sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process. Without torchrun nothing here starts a process group
and every helper answers for one process (rank 0 of 1), so the single-process trainer runs exactly as before.

Backend: NCCL when the process has a GPU (each process takes GPU LOCAL_RANK), gloo on CPUs.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (its environment variables are all set)."""
    return all(v in os.environ for v in LAUNCH_VARIABLES)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    """Whether this process writes the run's files (metrics, TensorBoard, samples, plots, checkpoint metadata)."""
    return rank() == 0


def local_device(device_name: str) -> torch.device:
    """The device of this process: its own GPU (LOCAL_RANK) when `device_name` resolves to CUDA, else the CPU."""
    if device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available()):
        local, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local >= count:
            raise ValueError(f"local rank {local} needs GPU {local}, but {count} GPU(s) are visible: start at most "
                             f"{count} processes per machine (--nproc / --nproc_per_node)")
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_from_env(device: torch.device, timeout_s: float = 1800.0) -> None:
    """Join the process group torchrun describes in the environment: NCCL for a CUDA device, gloo otherwise.

    timeout_s bounds every collective: a rank that waits longer for the others (one of them died or hangs) fails
    with an error instead of waiting forever; torchrun then stops the remaining ranks.
    """
    if is_initialized():
        return
    if not launched_by_torchrun():
        raise RuntimeError("a distributed run needs torchrun's environment (RANK, WORLD_SIZE, ...); start it with "
                           "`torchrun --nproc_per_node N -m quarl train CONFIG` or `quarl train --nproc N CONFIG`")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def shutdown() -> None:
    """Leave the process group (a no-op without one)."""
    if is_initialized():
        dist.destroy_process_group()


def end_process(code: int) -> None:
    """End a torchrun-launched process with exit status `code` once its work is done (files closed, process group
    left): run the `atexit` handlers (user code's included), shut logging down, flush stdout / stderr, then
    `os._exit`, skipping the interpreter's teardown. FSDP keeps the gloo process group alive past
    `destroy_process_group`, and tearing down its worker threads while the interpreter finalizes can abort a rank
    that finished cleanly ("terminate called without an active exception"), which torchrun reports as a failed
    job."""
    import atexit
    import logging
    import sys

    atexit._run_exitfuncs()  # what a normal exit runs first, while the interpreter is whole
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to save
            pass
    os._exit(code)


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def all_reduce_min(values: list[float], device: torch.device) -> list[float]:
    """The smallest of every rank's values, elementwise (e.g. 1/0 flags: 0 where any rank has 0). `device`: where
    the backend reduces (the rank's GPU for NCCL, the CPU for gloo)."""
    if not is_initialized() or world_size() == 1 or not values:
        return list(values)
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` is true on at least one rank (every rank gets the same answer)."""
    return not all_reduce_min([0.0 if flag else 1.0], device)[0]


def sum_over_ranks(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The sum of every rank's `t` (same shape everywhere), returned on t's device; `t` itself without a group."""
    return _reduced(t, device, dist.ReduceOp.SUM)


def max_over_ranks(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The elementwise maximum of every rank's `t` (same shape everywhere), on t's device; `t` itself without a
    group."""
    return _reduced(t, device, dist.ReduceOp.MAX)


def _reduced(t: torch.Tensor, device: torch.device, op) -> torch.Tensor:
    """all_reduce(op) of a copy of t on `device` (where the backend reduces), returned on t's device."""
    if not is_initialized() or world_size() == 1:
        return t
    moved = t.to(device, copy=True)
    dist.all_reduce(moved, op=op)
    return moved.to(t.device)


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order; [obj] without a group."""
    if not is_initialized() or world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not is_initialized() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another rank is gone (it died, was killed, or hangs
    past the timeout): what a rank sees when the job loses one of its processes."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        word in text for word in ("gloo", "NCCL", "Connection reset", "Connection closed"))


def shard_range(total: int, parts: int, index: int) -> range:
    """Contiguous share `index` of `total` items split into `parts` shares whose sizes differ by at most one
    (the first `total % parts` shares get one more)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def launch(nproc: int, argv: list[str]) -> int:
    """`quarl train --nproc N ...`: run `python -m torch.distributed.run --standalone --nproc_per_node N -m quarl
    argv...` (one node, a free port) and return its exit status. A failed job ends with one line saying so:
    torchrun has then stopped every rank, and only finished checkpoints are in the run directory."""
    import subprocess
    import sys

    if int(nproc) != nproc or nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1 (processes, one per GPU), got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={int(nproc)}",
           "-m", "quarl", *argv]
    print(f"[quarl] launching {nproc} processes: {' '.join(cmd[1:])}", flush=True)
    job = subprocess.Popen(cmd)
    interrupted = False
    while True:
        try:
            rc = job.wait()
            break
        except KeyboardInterrupt:  # the ranks got Ctrl-C too: wait while they stop (the run directory stays whole)
            interrupted = True
    if interrupted:  # torchrun reports its own signal as a failure; the ranks saved and stopped
        print("[quarl] interrupted: the ranks stopped after saving their step (see above)", file=sys.stderr)
        return 130
    if rc not in (0, 130, 143):
        print(f"quarl train: error: the {nproc}-process job stopped (exit status {rc}): a rank failed or was "
              "killed (its error is above) and torchrun ended the others; checkpoints already written are intact "
              "(resume with resume=RUN_DIR, on any number of processes)", file=sys.stderr, flush=True)
    return rc
