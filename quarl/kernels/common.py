"""Pieces shared by the GEMM kernels: the tile configuration, the tile order, the split-K reductions (a second
kernel, or tickets: the last of a tile's split programs sums the partials, in one launch).

Imports Triton: load it only through `quarl.kernels` (which checks that Triton and a GPU are present).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.kernels.tuning import Cfg


# One tile-configuration type for the planner (Triton-free) and the kernels.
GemmConfig = Cfg


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


_TICKETS: dict[tuple, torch.Tensor] = {}


def split_tickets(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros [>= n], one counter per output tile, cached per (device, stream); kernels leave them at 0.

    The first call for a device/stream (or a larger n) allocates: make it outside CUDA-graph capture (a warm-up
    call, which also compiles the kernel)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    t = _TICKETS.get(key)
    if t is None or t.numel() < n:
        t = _TICKETS[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return t


@triton.jit
def ticket_reduce(acc, part, ok, cnt_ptr, tile, pid_k, MN, SPLIT_K: tl.constexpr):
    """Split-K in one launch: store this program's fp32 partial acc at part + pid_k * MN (part: pointers of the
    tile in split 0 of a [SPLIT_K, M, N] buffer), draw the tile's ticket, and return (whether this program drew
    the last one, the sum of all SPLIT_K partials in split order); only the last program's sum is complete, and
    it resets the ticket for the next launch."""
    tl.store(part + pid_k * MN, acc, mask=ok)
    # Every thread's partial must be written before the ticket (release, gpu scope) announces it.
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = ticket == SPLIT_K - 1
    tot = acc
    if last:
        # .cg: read from L2, where the other SMs' partials are (this SM's L1 is not coherent).
        tot = tl.load(part, mask=ok, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            tot += tl.load(part + s * MN, mask=ok, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile, 0)
    return last, tot
