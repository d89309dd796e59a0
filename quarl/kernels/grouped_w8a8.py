"""Grouped W8A8 GEMM for mixture-of-experts: one launch computes every expert's product over its rows.

    out[r, n] = (sum_k xq[r, k] * W_e[n, k]) * s_w,e[n] * s_x[r]        for the rows r of expert e

Rows are sorted by expert (expert e owns rows offsets[e-1] .. offsets[e]); int8 / fp8 (rowwise) codes, one scale
per token and per output channel, as `quarl.formats` makes them. The experts' codes and scales stay where their
`QuantLinear`s hold them: the kernel reads them through device tables of their addresses (`ExpertTable`), not a
stacked copy, so an in-place re-quantization (the per-step sync) is read by the next launch, and a CUDA graph
captured once reads the current codes.

No host synchronisation: the grid is sized from upper bounds known on the host (cdiv(M, BM) + min(E, M) row
tiles x cdiv(N, BN) column tiles), and each program finds its expert and rows on the device from the offsets
(tiles per expert, their running sum, the expert whose tiles cover the program's); programs past the last tile
return at once.

Arithmetic, per row exactly as `quarl.kernels.w8a8_gemm` without split-K: int8 codes multiply on the int8 tensor
cores into int32 (exact); fp8 codes convert exactly to fp16 and multiply on the fp16 tensor cores into float32
(exact products, float32 sums: only the summation order can differ from another kernel). The epilogue is the
dense kernel's: float32(acc) * s_w[n], then * s_x[r], rounded once to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quarl.kernels.quant_utils import codes_to_f16

FORMATS = ("int8", "fp8")


@triton.jit(do_not_specialize=["M"])
def _grouped_w8a8_kernel(
    x_ptr, xs_ptr, ends_ptr, w_table, ws_table, out_ptr,
    M, N, K, E, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
    W_INT8: tl.constexpr, E_BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """x: codes [M, K] (int8, or fp8 as uint8 bytes), rows sorted by expert; xs: float32 [M] at stride_xsm;
    ends: int32 [E], the row after each expert's last (offsets[e] - offsets[e-1] rows); w_table / ws_table: int64
    [E] addresses of each expert's codes [N, K] (row stride stride_wn) and float32 scales [N] (stride stride_wsn);
    out [M, N] (row stride stride_om). pid 0: a BM-row tile of one expert (the experts' tiles in order), pid 1: BN
    columns."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)

    # Which expert owns row tile pid_t: count each expert's tiles, and find the first whose running total passes it.
    ar_e = tl.arange(0, E_BLOCK)
    e_ok = ar_e < E
    ends = tl.load(ends_ptr + ar_e, mask=e_ok, other=0)
    starts = tl.load(ends_ptr + ar_e - 1, mask=e_ok & (ar_e > 0), other=0)
    rows = tl.where(e_ok, ends - starts, 0)
    tiles = (rows + BM - 1) // BM
    tiles_end = tl.cumsum(tiles, 0)
    e = tl.sum((tiles_end <= pid_t).to(tl.int32), axis=0)
    if e >= E:
        return  # a spare program of the upper-bound grid
    this = ar_e == e
    first_tile = tl.sum(tl.where(this, tiles_end - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(this, starts, 0), axis=0) + (pid_t - first_tile) * BM
    row_end = tl.sum(tl.where(this, ends, 0), axis=0)
    if W_INT8:
        w_ptr = tl.load(w_table + e).to(tl.pointer_type(tl.int8))
    else:
        w_ptr = tl.load(w_table + e).to(tl.pointer_type(tl.uint8))
    ws_ptr = tl.load(ws_table + e).to(tl.pointer_type(tl.float32))

    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < row_end
    n_ok = offs_n < N
    ar_k = tl.arange(0, BK)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + ar_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + ar_k[None, :]
    ACC_DTYPE: tl.constexpr = tl.int32 if W_INT8 else tl.float32
    acc = tl.zeros((BM, BN), dtype=ACC_DTYPE)
    for kk in range(0, K, BK):
        k_ok = kk + ar_k < K
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
        if W_INT8:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(codes_to_f16(a, False), tl.trans(codes_to_f16(b, False)), acc, out_dtype=tl.float32)
        x_ptrs += BK
        w_ptrs += BK

    # the dense W8A8 kernel's epilogue, in its order: channel scales, then token scales, one rounding
    res = acc.to(tl.float32) * tl.load(ws_ptr + offs_n * stride_wsn, mask=n_ok, other=0.0)[None, :]
    res = res * tl.load(xs_ptr + offs_m * stride_xsm, mask=m_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class ExpertTable:
    """Where E experts' weight codes and scales live, for `grouped_w8a8_matmul`.

    codes: int64 [E] device addresses of the codes [N, K] (int8 / float8_e4m3fn, rows stride_wn apart, unit
    column stride); scales: int64 [E] addresses of the float32 scales [N] (stride_wsn apart). The table holds no
    reference to the tensors: whoever builds it keeps them alive and rebuilds it when one moves."""

    fmt: str
    n: int
    k: int
    codes: torch.Tensor
    scales: torch.Tensor
    stride_wn: int
    stride_wsn: int

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]


def expert_table(fmt: str, codes: list[torch.Tensor], scales: list[torch.Tensor]) -> ExpertTable:
    """The `ExpertTable` of E experts: codes[e] [N, K] (int8 for "int8", float8_e4m3fn for "fp8"), scales[e]
    float32 with N values (per output channel: [N] or [N, 1]), all on one device with the same shapes and strides.
    Copies E addresses to the device (one small host-to-device copy): build it once and keep it."""
    if fmt not in FORMATS:
        raise ValueError(f"the grouped W8A8 GEMM takes formats {', '.join(FORMATS)}, got {fmt!r}")
    if not codes or len(codes) != len(scales):
        raise ValueError(f"expert_table needs one scale tensor per code tensor, got {len(codes)} and {len(scales)}")
    code_dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    first = codes[0]
    if first.dim() != 2 or first.dtype != code_dtype or first.stride(1) != 1:
        raise ValueError(f"{fmt} expert codes must be 2-D {code_dtype} with unit column stride, got "
                         f"{first.dtype} of shape {tuple(first.shape)} strides {first.stride()}")
    n, k = first.shape
    for c, s in zip(codes, scales):
        if c.dtype != code_dtype or c.shape != first.shape or c.stride() != first.stride() or c.device != first.device:
            raise ValueError(f"every expert's codes must be {code_dtype} {tuple(first.shape)} with strides "
                             f"{first.stride()} on {first.device}, got {c.dtype} {tuple(c.shape)} {c.stride()} on "
                             f"{c.device}")
        if s.dtype != torch.float32 or s.numel() != n or s.device != first.device or \
                s.stride(0) != scales[0].stride(0):
            raise ValueError(f"every expert's scales must be {n} float32 values (one per output channel) on "
                             f"{first.device} with one stride, got {s.dtype} of shape {tuple(s.shape)} on {s.device}")
    addresses = torch.tensor([[c.data_ptr(), s.data_ptr()] for c, s in zip(codes, scales)], dtype=torch.int64)
    addresses = addresses.to(first.device)
    return ExpertTable(fmt, n, k, addresses[:, 0].contiguous(), addresses[:, 1].contiguous(), first.stride(0),
                       scales[0].stride(0))


def _tiles(m: int, experts: int) -> tuple[int, int]:
    """(BM, BN) for m sorted rows over `experts` experts: the row tile near the rows an active expert owns (decode:
    a few rows each, the 16-row minimum of a tensor-core tile), wider column tiles for tall tiles."""
    per_expert = m / max(1, min(experts, m))
    if per_expert <= 16:
        return 16, 64
    if per_expert <= 32:
        return 32, 64
    return 64, 128


def grouped_w8a8_matmul(xq: torch.Tensor, xs: torch.Tensor, ends: torch.Tensor, table: ExpertTable,
                        out_dtype: torch.dtype, block_m: int | None = None, block_n: int | None = None,
                        block_k: int = 128) -> torch.Tensor:
    """Every expert's W8A8 product over its rows, in one launch and without a host sync.

    xq: activation codes [M, K] of rows sorted by expert (int8 / float8_e4m3fn as `table.fmt`, unit column stride),
    from `quarl.kernels.act_quant.quantize_activation`; xs: their float32 scales, M values ([M] or [M, 1]);
    ends: int32 [E] on the device, the running row count after each expert (`counts.cumsum(0)`; ends[-1] must be M,
    which is not checked: that would read the device); table: the experts' weights (`expert_table`).
    block_m / block_n / block_k: the tile (powers of two >= 16; default from M and E).
    Returns [M, N] in out_dtype.
    """
    code_dtype = torch.int8 if table.fmt == "int8" else torch.float8_e4m3fn
    if xq.dim() != 2 or xq.dtype != code_dtype or xq.shape[1] != table.k or (xq.shape[1] > 1 and xq.stride(1) != 1):
        raise ValueError(f"xq must be {code_dtype} codes [M, {table.k}] with unit column stride, got {xq.dtype} of "
                         f"shape {tuple(xq.shape)} strides {xq.stride()}")
    m = xq.shape[0]
    if xs.dtype != torch.float32 or xs.numel() != m:
        raise ValueError(f"xs must hold {m} float32 scales (one per row), got {xs.dtype} of shape {tuple(xs.shape)}")
    experts = table.num_experts
    if ends.dtype != torch.int32 or ends.shape != (experts,):
        raise ValueError(f"ends must be int32 [{experts}] (counts.cumsum(0)), got {ends.dtype} of shape "
                         f"{tuple(ends.shape)}")
    if not (xq.device == xs.device == ends.device == table.codes.device):
        raise ValueError(f"xq, xs, ends and the expert table must share one device, got {xq.device}, {xs.device}, "
                         f"{ends.device}, {table.codes.device}")
    out = torch.empty((m, table.n), dtype=out_dtype, device=xq.device)
    if m == 0 or table.n == 0:
        return out
    bm, bn = _tiles(m, experts)
    bm, bn = block_m or bm, block_n or bn
    xs = xs.reshape(m)
    xin = xq.view(torch.uint8) if table.fmt == "fp8" else xq  # a masked load needs an integer fill value
    grid = (triton.cdiv(m, bm) + min(experts, m), triton.cdiv(table.n, bn))
    _grouped_w8a8_kernel[grid](
        xin, xs, ends, table.codes, table.scales, out,
        m, table.n, table.k, experts, xin.stride(0), xs.stride(0), table.stride_wn, table.stride_wsn, out.stride(0),
        W_INT8=table.fmt == "int8", E_BLOCK=triton.next_power_of_2(experts), BM=bm, BN=bn, BK=block_k,
        num_warps=4, num_stages=3,
    )
    return out
