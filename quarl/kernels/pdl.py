"""Programmatic dependent launch (PDL): a decode GEMM starts while the activation-quantization kernel before it
still runs, and spends that time pulling its first weight tiles into L2.

Why: at decode sizes the prequantized W8A8 path is two kernels, the quantization (2-4 us) and the GEMM (5-45 us),
and the GEMM cannot start its weight stream until the codes exist: the weight bytes, which do not depend on the
quantization at all, wait behind it. With PDL (Hopper and newer) the quantization kernel lets its dependent
launch at once (`griddepcontrol.launch_dependents`); the GEMM's programs prefetch their first weight tiles into
L2 (`prefetch.global.L2`, read-only and coherent: nothing stale can reach the SM), then block in
`griddepcontrol.wait` until the quantization has finished and its writes are visible, and only then read the
activation codes, scales or anything else. Launched without PDL (older GPUs, QUARL_PDL=0) the wait is a no-op
and the prefetch only warms L2.

Inside CUDA graphs the launch attribute becomes a programmatic edge (CUDA 12.3+), so replays keep the overlap.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL off
    gdc_launch_dependents = gdc_wait = None


def pdl_enabled(device: torch.device) -> bool:
    """PDL for kernels on `device`: a CUDA GPU of compute capability 9.0 or newer, a Triton that exposes grid
    dependency control, and QUARL_PDL not set to 0 (the switch for comparing both ways)."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("QUARL_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def let_dependents_launch():
    """Called first by a producer kernel: its PDL-launched consumer may start now (it still waits for our
    writes in `wait_for_producer`)."""
    gdc_launch_dependents()


@triton.jit
def wait_for_producer():
    """Block until the kernel before this one in the stream has finished and its writes are visible."""
    gdc_wait()


@triton.jit
def prefetch_rows_l2(base_ptr, rows, row_ok, stride_row, col0, cols_end, COLS: tl.constexpr):
    """Prefetch into L2 the bytes [col0, col0 + COLS) (clipped at cols_end) of each row in rows: [R] int
    (row_ok [R] bool masks rows past the tensor) of a uint8/int8 matrix at base_ptr with row stride stride_row.
    One prefetch per 128-byte line; clipped lines are redirected to a valid address instead of masked (a
    prefetch has no mask), so nothing outside the tensor is touched."""
    lines = col0 + tl.arange(0, COLS // 128) * 128
    lines = tl.minimum(lines, cols_end - 1)
    safe_rows = tl.where(row_ok, rows, 0)
    ptrs = base_ptr + safe_rows.to(tl.int64)[:, None] * stride_row + lines[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                              pack=1)


# Weight columns per row that a PDL consumer prefetches before its wait (bench/pdl_probe.py): enough to cover a
# 2-4 us quantization kernel at decode sizes, few enough that the lines are still in L2 when the program reads them.
PREFETCH_COLS = 1024


def prefetch_cols(k_per_program: int, bk: int) -> int:
    """Columns of its rows a consumer program prefetches: PREFETCH_COLS, at most its own K range (rounded down to a
    power of two >= 128, a whole number of 128-byte lines; 0 turns the prefetch off)."""
    cols = min(PREFETCH_COLS, k_per_program)
    if cols < 128:
        return 0
    return 1 << (cols.bit_length() - 1)
