"""Pieces shared by the GEMM kernels: the tile configuration, the tile order, the split-K reduction.

Imports Triton: load it only through `quarl.kernels` (which checks that Triton and a GPU are present).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.kernels.tuning import Cfg


# One tile-configuration type for the planner (Triton-free) and the kernels.
GemmConfig = Cfg

_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of a CUDA device (the current one for None), cached per device index."""
    idx = torch.cuda.current_device() if device is None or device.index is None else device.index
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


@triton.jit
def pid_to_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), GROUP_M tile rows per column sweep (grouped order for L2 reuse)."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def splitk_reduce(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] (contiguous) = sum over s of partials [S, M, N] float32 (+ bias [N]), cast to out.dtype."""
    split, m, n = partials.shape
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        partials, bias if bias is not None else out, out, m * n, n,
        SPLIT=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
    )
