"""8-bit GEMMs: int8 / fp8 (rowwise, per-tensor) and fp8-block weights, with the activation quantized on the fly.

out[m, n] = sum_k dequant(Q(x))[m, k] * dequant(W)[n, k], i.e. exactly the reference
`quantize(x, fmt, "activation").dequantize() @ qweight.dequantize().T` up to fp32 summation order.

Activation modes (X_MODE):
  0 raw       weight-only (W8A16): x itself times the weight codes.
  1 fused     x in bf16/fp16 is quantized inside the GEMM: per token with a first pass over K for the row
              amax (small M, where re-reading x from L2 is cheap), or per 1x128 group of the tile (fp8-block).
  2 prequant  x was quantized by `quarl.kernels.act_quant` (codes [M, Kp] + scales): large M.
Multiply (GemmConfig.native): the int8/fp8 tensor cores (2x the bf16 rate; tile rows >= 64), or the codes
converted exactly to fp16 on the fp16 tensor cores (any tile; decode is memory-bound so the rate is moot,
and the products and fp32 sums are exact, unlike Hopper's reduced-precision fp8 accumulator).
Orientation (GemmConfig.swap_ab): the tile product as x_tile @ W_tile^T, or transposed, W_tile @ x_tile^T, so that
the weight tile sits on the MMA's 64-row side and decode's few token rows on its narrow side (on Hopper a native
16-row tile is then one m64n16k32 wgmma instead of a 64-row x tile that is mostly padding).
Scaling: rowwise formats apply s_x[m] * s_w[n] once in the epilogue; fp8-block scales each 128-deep partial
product by s_x[m, kb] * s_w[n // 128, kb] (BK must be 128).
Prefill (GemmConfig.tma): `_w8a8_tma_kernel`, persistent (one program per SM walking the output tiles), both
operands copied by TMA; prequantized rowwise / per-tensor codes on the 8-bit tensor cores, Hopper or newer
(elsewhere, or where TMA cannot address the rows, the kernel above runs the same tile).
Decode (GemmConfig.tma with swap_ab, M <= bm): `_w8a8_tma_swap_kernel`, the transposed product fed by TMA, one
program per (bn weight rows, K split).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.kernels.common import GemmConfig, num_sms, pid_to_tile, splitk_reduce
from quarl.kernels.quant_utils import codes_to, codes_to_f16, quantize_tile, safe_scale

X_RAW, X_FUSED, X_PREQUANT = 0, 1, 2


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, K, KP, k_per_split,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_os,
    W_INT8: tl.constexpr, BLOCKWISE: tl.constexpr, X_MODE: tl.constexpr, NATIVE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, W_GROUP_ROWS: tl.constexpr,
):
    """x: [M, K] bf16/fp16 (X_MODE 0/1) or codes [M, KP] (X_MODE 2; fp8 as uint8 bytes); xs: activation
    scales float32 ([M] with stride stride_xsm, or [M, KP/128] for fp8-block; X_MODE 2 only);
    w: codes [N, KP] (int8, or fp8 as uint8 bytes); ws: float32 weight scales ([N] with stride stride_wsn,
    0 for one per tensor; fp8-block [ceil(N/W_GROUP_ROWS), KP/128] with row stride stride_wsn: 128x128 tiles,
    or with W_GROUP_ROWS = 1 1x128 groups of each row, as an activation-role second operand);
    out: [M, N] in the output dtype, or float32 partials [SPLIT_K, M, N] (scaled, without bias).
    SWAP_AB: accumulate the transposed tile [BN, BM] = W_tile @ x_tile^T (the weight on the MMA's 64-row side),
    transposed back once before the epilogue."""
    QMAX: tl.constexpr = 127.0 if W_INT8 else 448.0
    pid_m, pid_n = pid_to_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    ar_k = tl.arange(0, BK)
    k0 = pid_k * k_per_split
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k0 + ar_k)[None, :]

    if X_MODE == 1 and not BLOCKWISE:
        # Per-token scale needs the amax of the whole row before the first code.
        amax = tl.zeros((BM,), dtype=tl.float32)
        for it in range(0, tl.cdiv(K, BK)):
            v = tl.load(x_rows + (it * BK + ar_k)[None, :], mask=m_ok[:, None] & (it * BK + ar_k < K)[None, :],
                        other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
        sx = safe_scale(amax, QMAX)

    ACC_DTYPE: tl.constexpr = tl.int32 if W_INT8 and NATIVE else tl.float32
    if SWAP_AB:
        acc = tl.zeros((BN, BM), dtype=ACC_DTYPE)
    else:
        acc = tl.zeros((BM, BN), dtype=ACC_DTYPE)
    # Up to KP only: the last split's range can reach past it, where fp8-block's scale columns end.
    for it in range(0, tl.cdiv(tl.minimum(k_per_split, KP - k0), BK)):
        kk = k0 + it * BK
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (kk + ar_k < KP)[None, :], other=0)
        if X_MODE == 2:
            a = tl.load(x_rows + (kk + ar_k)[None, :], mask=m_ok[:, None] & (kk + ar_k < KP)[None, :], other=0)
        else:
            xv = tl.load(x_rows + (kk + ar_k)[None, :], mask=m_ok[:, None] & (kk + ar_k < K)[None, :], other=0.0)

        # Operands of the tensor-core product.
        if X_MODE == 0:
            a = xv
            b = codes_to(w, W_INT8, x_ptr.dtype.element_ty)
        else:
            if X_MODE == 1:
                if BLOCKWISE:
                    sg = safe_scale(tl.max(tl.abs(xv.to(tl.float32)), axis=1), QMAX)
                    q = quantize_tile(xv.to(tl.float32), sg[:, None], W_INT8)
                else:
                    q = quantize_tile(xv.to(tl.float32), sx[:, None], W_INT8)
                if NATIVE:
                    if W_INT8:
                        a = q.to(tl.int8)
                    else:
                        a = q
                else:
                    a = q.to(tl.float16)
            else:
                if BLOCKWISE:
                    sg = tl.load(xs_ptr + offs_m * stride_xsm + kk // 128, mask=m_ok, other=1.0)
                if NATIVE:
                    if not W_INT8:
                        a = a.to(tl.float8e4nv, bitcast=True)
                else:
                    a = codes_to_f16(a, W_INT8)
            if NATIVE:
                if W_INT8:
                    b = w
                else:
                    b = w.to(tl.float8e4nv, bitcast=True)
            else:
                b = codes_to_f16(w, W_INT8)

        if BLOCKWISE:
            sw = tl.load(ws_ptr + (offs_n // W_GROUP_ROWS) * stride_wsn + kk // 128, mask=n_ok, other=0.0)
            if SWAP_AB:
                part = tl.dot(b, tl.trans(a))
                if X_MODE == 0:
                    acc += part * sw[:, None]
                else:
                    acc += part * (sw[:, None] * sg[None, :])
            else:
                part = tl.dot(a, tl.trans(b))
                if X_MODE == 0:
                    acc += part * sw[None, :]
                else:
                    acc += part * (sg[:, None] * sw[None, :])
        elif SWAP_AB:
            acc = tl.dot(b, tl.trans(a), acc, out_dtype=acc.dtype)
        else:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=acc.dtype)
        w_ptrs += BK
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN], as the epilogue expects

    if BLOCKWISE:
        res = acc
    else:
        sw = tl.load(ws_ptr + offs_n * stride_wsn, mask=n_ok, other=0.0)
        res = acc.to(tl.float32) * sw[None, :]
        if X_MODE == 1:
            res = res * sx[:, None]
        elif X_MODE == 2:
            res = res * tl.load(xs_ptr + offs_m * stride_xsm, mask=m_ok, other=0.0)[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, res, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _w8a8_tma_kernel(
    x_desc, w_desc, xs_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, KP, stride_xsm, stride_wsn, stride_om,
    W_INT8: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):
    """Prefill W8A8 from prequantized activation codes, persistent: NUM_PROGRAMS programs walk the [BM, BN] output
    tiles, and both operands arrive by TMA (the copy engine, no per-thread address arithmetic or masks).

    x_desc: activation codes [M, KP] (int8 / fp8) in [BM, BK] blocks; w_desc: weight codes [N, KP] in [BN, BK]
    blocks (reads past M, N or KP return zeros); xs float32 [M] (stride stride_xsm, 0: one per tensor);
    ws float32 [N] (stride stride_wsn, 0: one per tensor); bias [N]; out [M, N] (row stride stride_om)."""
    ACC_DTYPE: tl.constexpr = tl.int32 if W_INT8 else tl.float32
    n_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    k_steps = tl.cdiv(KP, BK)
    # flatten: the tile loop and the K loop are pipelined as one, so the next tile's loads overlap this epilogue
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = pid_to_tile(tile, M, N, BM, BN, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=ACC_DTYPE)
        for ki in range(k_steps):
            a = x_desc.load([pid_m * BM, ki * BK])
            b = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc, out_dtype=ACC_DTYPE)
        _tma_epilogue(acc, pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), M, N, xs_ptr, ws_ptr,
                      bias_ptr, out_ptr, stride_xsm, stride_wsn, stride_om, HAS_BIAS, True)


@triton.jit
def _tma_epilogue(acc, offs_m, offs_n, M, N, xs_ptr, ws_ptr, bias_ptr, out_ptr, stride_xsm, stride_wsn, stride_om,
                  HAS_BIAS: tl.constexpr, FINAL: tl.constexpr):
    """The TMA kernels' output tile: acc [BM, BN] (int32 / float32 sums of rows offs_m, columns offs_n) times the
    token and channel scales; FINAL: plus bias, stored in out's dtype; else stored as float32 (a split-K partial,
    out_ptr at its split). Rows and columns past M, N are masked."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    res = acc.to(tl.float32) * tl.load(ws_ptr + offs_n * stride_wsn, mask=n_ok, other=0.0)[None, :]
    res = res * tl.load(xs_ptr + offs_m * stride_xsm, mask=m_ok, other=0.0)[:, None]
    ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if FINAL:
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(ptrs, res.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(ptrs, res, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _w8a8_tma_swap_kernel(
    x_desc, w_desc, xs_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, KP, k_per_split, stride_xsm, stride_wsn, stride_om, stride_os,
    W_INT8: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Decode W8A8 (M <= BM rows; the tables use BM 16 and 64) from prequantized codes, transposed and fed by
    TMA: the program's [BN, BK] weight block sits on the wgmma's 64-row side, the [BM, BK] block of token codes on
    its narrow side, and both arrive by TMA. Streaming the weight is the whole cost at these sizes, and a TMA
    copy is one instruction per block where `_w8a8_kernel`'s loads issue a 16-byte copy per thread and step, so
    this kernel beats `_w8a8_kernel` on the wide 7B shapes (gate/up) at 1-64 rows; down, whose split-K partials
    a second launch sums, gains little (bench/results/gemm.md).

    x_desc: codes [M, KP] in [BM, BK] blocks (rows past M read as zeros); w_desc: weight codes [N, KP] in [BN, BK]
    blocks; xs float32 [M] (stride stride_xsm, 0: one per tensor); ws float32 [N] (stride stride_wsn); bias [N];
    out [M, N] in the output dtype (SPLIT_K == 1), or float32 partials [SPLIT_K, M, N] (scaled, without bias).
    Grid (cdiv(N, BN), SPLIT_K)."""
    ACC_DTYPE: tl.constexpr = tl.int32 if W_INT8 else tl.float32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k0 = pid_k * k_per_split
    acc = tl.zeros((BN, BM), dtype=ACC_DTYPE)
    for it in range(0, tl.cdiv(tl.minimum(k_per_split, KP - k0), BK)):
        kk = k0 + it * BK
        w = w_desc.load([pid_n * BN, kk])
        x = x_desc.load([0, kk])
        acc = tl.dot(w, x.T, acc, out_dtype=ACC_DTYPE)
    acc = tl.trans(acc)  # [BM, BN]: stores run along N
    _tma_epilogue(acc, tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), M, N, xs_ptr, ws_ptr, bias_ptr,
                  out_ptr + pid_k * stride_os, stride_xsm, stride_wsn, stride_om, HAS_BIAS, SPLIT_K == 1)


def _split_k(kp: int, bk: int, split_k: int) -> tuple[int, int]:
    """(columns per split, a multiple of bk; splits that get columns) for KP columns asked to split split_k ways."""
    k_per_split = triton.cdiv(triton.cdiv(kp, split_k), bk) * bk
    return k_per_split, triton.cdiv(kp, k_per_split)


def _w8a8_tma_swap(xin, xs, w, ws, bias, out, cfg: GemmConfig, w_int8: bool) -> None:
    """Launch `_w8a8_tma_swap_kernel` on xin codes [M, KP] (M <= cfg.bm) and w codes [N, KP] (int8, or
    float8_e4m3fn) into out [M, N], through fp32 partials and `splitk_reduce` when cfg.split_k > 1 (summing them
    in the kernel's last program per tile is no faster here either: bench/results/gemm.md)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n = out.shape
    kp = w.shape[1]
    k_per_split, split = _split_k(kp, cfg.bk, cfg.split_k)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=out.device)
    _w8a8_tma_swap_kernel[(triton.cdiv(n, cfg.bn), split)](
        TensorDescriptor.from_tensor(xin, [cfg.bm, cfg.bk]), TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk]),
        xs, ws, bias if bias is not None else out, target,
        m, n, kp, k_per_split, 0 if xs.dim() == 0 else xs.stride(0), 0 if ws.dim() == 0 else ws.stride(0),
        target.stride(-2), target.stride(0) if split > 1 else 0,
        W_INT8=w_int8, HAS_BIAS=bias is not None, SPLIT_K=split, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    if split > 1:
        splitk_reduce(target, bias, out)


def _tma_usable(xin: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs Hopper or newer, 16-byte aligned bases and row strides, unit stride along K, and rows (a
    descriptor's shape must be positive)."""
    if xin.device.type == "cuda" and torch.cuda.get_device_capability(xin.device)[0] < 9:
        return False
    return xin.shape[0] > 0 and w.shape[0] > 0 and \
        all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (xin, w))


def _w8a8_tma(xin, xs, w, ws, bias, out, cfg: GemmConfig, w_int8: bool) -> None:
    """Launch `_w8a8_tma_kernel`: xin codes [M, KP], w codes [N, KP] (int8, or float8_e4m3fn), scales as
    `w8a8_matmul` passes them; one program per SM at most (fewer when there are fewer tiles; two in Triton's CPU
    interpreter, so that its checks walk several tiles per program)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n = out.shape
    n_tiles = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    programs = max(1, min(n_tiles, num_sms(out.device) if out.device.type == "cuda" else 2))
    _w8a8_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(xin, [cfg.bm, cfg.bk]), TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk]),
        xs, ws, bias if bias is not None else out, out,
        m, n, w.shape[1], 0 if xs.dim() == 0 else xs.stride(0), 0 if ws.dim() == 0 else ws.stride(0),
        out.stride(0),
        W_INT8=w_int8, HAS_BIAS=bias is not None, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs, num_warps=cfg.warps, num_stages=cfg.stages,
    )


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors travel as uint8 (a masked load needs an integer fill value); int8 stays int8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def w8a8_matmul(
    x: torch.Tensor,
    qweight,
    bias: torch.Tensor | None,
    cfg: GemmConfig,
    x_mode: int,
    xq: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [M, K] bf16/fp16 times an int8 / fp8 / fp8-tensor / fp8-block weight QuantizedTensor [N, K] -> [M, N].

    x_mode: X_RAW (weight-only), X_FUSED (quantize x here) or X_PREQUANT (xq = (codes [M, Kp], scales) from
    `quarl.kernels.act_quant.quantize_activation`; x then only gives the shape and output dtype). fp8-block
    needs cfg.bk == 128; cfg.native needs cfg.bm >= 64 (cfg.bn >= 64 with cfg.swap_ab: the MMA's 64-row side)
    and an 8-bit activation (x_mode != X_RAW); cfg.tma selects a TMA kernel (X_PREQUANT, rowwise / per-tensor,
    native, tiles of at most 256): the persistent one (no split-K), or with cfg.swap_ab the decode one (M <= bm,
    bn >= 64, split-K allowed). An fp8-block second operand in the
    "activation" role (1x128 groups of each row, as the weight gradient's x^T) is scaled per row and group
    instead of per 128x128 tile.
    """
    fmt = qweight.fmt
    blockwise = fmt == "fp8-block"
    w_int8 = fmt == "int8"
    M, K = x.shape
    N = qweight.shape[0]
    w = _raw_bytes(qweight.data)
    kp = w.shape[1]
    ws = qweight.scale
    if blockwise:
        if cfg.bk != 128:
            raise ValueError(f"fp8-block GEMM tiles must be 128 deep (one scale group per step), got bk={cfg.bk}")
        stride_wsn = ws.stride(0)
    else:
        stride_wsn = 0 if ws.dim() == 0 else ws.stride(0)
    if cfg.tma and (x_mode != X_PREQUANT or blockwise or not cfg.native
                    or (cfg.split_k != 1 and not cfg.swap_ab)):
        raise ValueError(f"the TMA W8A8 kernels take prequantized rowwise / per-tensor codes on the 8-bit tensor "
                         f"cores (split-K only transposed, swap_ab), got x_mode={x_mode}, fmt={fmt}, cfg={cfg}")
    if cfg.tma and max(cfg.bm, cfg.bn, cfg.bk) > 256:
        raise ValueError(f"TMA copies blocks of at most 256 rows and 256 columns, got cfg={cfg}")
    if cfg.tma and cfg.swap_ab and (M > cfg.bm or cfg.bn < 64):
        raise ValueError(f"the transposed TMA kernel covers all M rows in one tile of bm rows, on an MMA side of "
                         f"bn >= 64 weight rows; got M={M}, cfg={cfg}: use bm >= M and bn >= 64, or a Cfg "
                         "without tma for more rows")
    if cfg.tma and _tma_usable(xq[0], qweight.data):
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        launch = _w8a8_tma_swap if cfg.swap_ab else _w8a8_tma
        launch(xq[0], xq[1], qweight.data, ws, bias, out, cfg, w_int8)
        return out
    if x_mode == X_PREQUANT:
        xin, xs = xq
        xin = _raw_bytes(xin)
        stride_xsm = 0 if xs.dim() == 0 else xs.stride(0)
    else:
        xin, xs, stride_xsm = x, ws, 0  # xs unused
    bk = cfg.bk
    k_per_split, split = _split_k(kp, bk, cfg.split_k)
    even_k = K == kp and kp % k_per_split == 0
    grid = (triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn), split)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    # Split-K partials are summed by a second kernel: summing them in the GEMM's last program per tile (tickets,
    # as fp4_decode does) is no faster at these M (bench/results/gemm.md).
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    _w8a8_kernel[grid](
        xin, xs, w, ws, bias if bias is not None else out, target,
        M, N, K, kp, k_per_split,
        xin.stride(0), stride_xsm, w.stride(0), stride_wsn, target.stride(-2),
        target.stride(0) if split > 1 else 0,
        W_INT8=w_int8, BLOCKWISE=blockwise, X_MODE=x_mode, NATIVE=cfg.native and x_mode != X_RAW,
        HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_K=even_k, SWAP_AB=cfg.swap_ab,
        BM=cfg.bm, BN=cfg.bn, BK=bk, GROUP_M=cfg.group_m,
        W_GROUP_ROWS=1 if blockwise and qweight.role == "activation" else 128,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    if split > 1:
        splitk_reduce(target, bias, out)
    return out


# Weight-gradient tile: the products are 128 tokens deep per scale group, and both operands are large.
WGRAD_CFG = GemmConfig(bm=128, bn=128, bk=128, warps=8, stages=4, native=True)
