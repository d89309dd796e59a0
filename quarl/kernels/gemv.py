"""Matrix-vector kernels for decode with very few rows: FMA on the CUDA cores, no tensor cores. fp4 (weight-only)
takes M <= 4 rows, the 8-bit formats one row (M = 1, the decode of a single sequence; from 2 rows the dispatch
takes the GEMM kernels).

Why: with one token per call a tensor-core tile wastes 15 of its 16 rows, a split-K reduction and a separate
activation-quantization kernel each cost a launch (as long as streaming a small weight), and the
bytes per SM in flight matter more than arithmetic. Each program here owns BN output features, streams their
whole K once (no split, no second kernel), keeps per-lane partial sums in registers and reduces them once at
the end. For W8A8 the activation is quantized inside (x_mode "fused": the row amax over K first, then the same
codes as `quarl.formats`), so one launch does everything (its speed against cuBLAS bf16: bench/results/gemm.md).

Same semantics and decodes as `fp4_gemm` / `w8a8_gemm` (see there); results differ only by fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.kernels.quant_utils import codes_to_f16, quantize_tile, safe_scale

MAX_ROWS = 4


@triton.jit(do_not_specialize=["M"])
def _fp4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr,
    M, N, K, KP, stride_xm, stride_wn, stride_sn, stride_om,
    IS_MX: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """x [M, K] bf16/fp16, w uint8 [N, KP/2], s uint8 [N, KP/G] (E4M3 / E8M0 bytes), gs float32 [] -> out [M, N]."""
    G: tl.constexpr = 32 if IS_MX else 16
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    n_ok = offs_n < N
    m_ok = offs_m < M
    ar_k = tl.arange(0, BK)
    ar_b = tl.arange(0, BK // 2)
    ar_g = tl.arange(0, BK // G)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + ar_b[None, :]
    s_ptrs = s_ptr + offs_n[:, None] * stride_sn + ar_g[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + ar_k[None, :]
    acc = tl.zeros((BM, BN, BK // 2), dtype=tl.float32)
    for it in range(0, tl.cdiv(KP, BK)):
        kk = it * BK
        if EVEN_K:
            b = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            sc = tl.load(s_ptrs, mask=n_ok[:, None], other=0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            b = tl.load(w_ptrs, mask=n_ok[:, None] & (kk // 2 + ar_b < KP // 2)[None, :], other=0)
            sc = tl.load(s_ptrs, mask=n_ok[:, None] & (kk // G + ar_g < KP // G)[None, :], other=0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & (kk + ar_k < K)[None, :], other=0.0)
        b = b.to(tl.int32)
        lo = (((b & 0x8) << 12) | ((b & 0x7) << 9)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        if IS_MX:
            sf = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
        else:
            sf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
        lo = tl.reshape(tl.reshape(lo, (BN, BK // G, G // 2)) * sf[:, :, None], (BN, BK // 2))
        hi = tl.reshape(tl.reshape(hi, (BN, BK // G, G // 2)) * sf[:, :, None], (BN, BK // 2))
        xe, xo = tl.split(tl.reshape(x.to(tl.float32), (BM, BK // 2, 2)))
        acc += xe[:, None, :] * lo[None, :, :] + xo[:, None, :] * hi[None, :, :]
        w_ptrs += BK // 2
        s_ptrs += BK // G
        x_ptrs += BK
    y = tl.sum(acc, axis=2)
    if not IS_MX:
        y = y * tl.load(gs_ptr)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w8_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, N, K, KP, stride_wn, stride_wsn,
    W_INT8: tl.constexpr, BLOCKWISE: tl.constexpr, X_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, XC: tl.constexpr,
):
    """One row x [K] (bf16/fp16, or codes [KP] with X_MODE 2 and scales xs: one float32, or [KP/128] for
    fp8-block) times the 8-bit weight codes w [N, KP] (int8, or fp8 as uint8 bytes; scales ws float32 [N] with
    stride stride_wsn, 0 for one per tensor, or [ceil(N/128), KP/128] for fp8-block) -> out [N] in its dtype.
    X_MODE as in `w8a8_gemm._w8a8_kernel`. 2-D tiles: the weight tile [BN, BK] is multiplied in the layout it was
    loaded in (a [M, BN, BK] product for several rows would move every tile through shared memory into a slice
    of a 3-D layout, which streams the weight far more slowly). fp8-block needs BK a multiple of
    128 and BN dividing 128: a program's rows lie in one 128-row weight tile, so each 128-column group of a K step
    has one weight scale, applied to x's BK values before the product (not to BN * BK weights). XC: columns per
    load of the fused per-row amax pass (a few wide loads: that pass runs before the weight stream starts, so
    its latency is not hidden)."""
    QMAX: tl.constexpr = 127.0 if W_INT8 else 448.0
    G: tl.constexpr = BK // 128  # fp8-block scale groups per K step
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    ar_k = tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + ar_k[None, :]
    if X_MODE == 1 and not BLOCKWISE:
        ar_x = tl.arange(0, XC)
        amax = tl.max(tl.abs(tl.load(x_ptr + ar_x, mask=ar_x < K, other=0.0).to(tl.float32)), axis=0)
        for k0 in range(XC, K, XC):
            v = tl.load(x_ptr + k0 + ar_x, mask=k0 + ar_x < K, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=0))
        sx = safe_scale(amax, QMAX)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for it in range(0, tl.cdiv(KP, BK)):
        kk = it * BK
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (kk + ar_k < KP)[None, :], other=0)
        wf = codes_to_f16(w, W_INT8).to(tl.float32)
        if X_MODE == 2:
            xv = codes_to_f16(tl.load(x_ptr + kk + ar_k, mask=kk + ar_k < KP, other=0), W_INT8).to(tl.float32)
            if BLOCKWISE:
                xv = xv * tl.load(xs_ptr + (kk + ar_k) // 128, mask=kk + ar_k < KP, other=0.0)
        else:
            xv = tl.load(x_ptr + kk + ar_k, mask=kk + ar_k < K, other=0.0).to(tl.float32)
            if X_MODE == 1:
                if BLOCKWISE:  # each 128-column group by its own amax (1 x 128 activation groups)
                    xg = tl.reshape(xv, (G, 128))
                    sg = safe_scale(tl.max(tl.abs(xg), axis=1), QMAX)[:, None]
                    xv = tl.reshape(quantize_tile(xg, sg, W_INT8).to(tl.float32) * sg, (BK,))
                else:
                    xv = quantize_tile(xv, sx, W_INT8).to(tl.float32)
        if BLOCKWISE:  # all BN rows lie in one 128-row weight tile: one scale per 128-column group
            xv = xv * tl.load(ws_ptr + ((pid * BN) // 128) * stride_wsn + (kk + ar_k) // 128, mask=kk + ar_k < KP,
                              other=0.0)
        acc += wf * xv[None, :]
        w_ptrs += BK
    y = tl.sum(acc, axis=1)
    if not BLOCKWISE:
        y = y * tl.load(ws_ptr + offs_n * stride_wsn, mask=n_ok, other=0.0)
        if X_MODE == 1:
            y = y * sx
        elif X_MODE == 2:
            y = y * tl.load(xs_ptr)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def _rows_block(m: int) -> int:
    if m > MAX_ROWS:
        raise ValueError(f"the fp4 GEMV takes at most {MAX_ROWS} rows, got M={m}; use the GEMM kernels")
    return 1 if m <= 1 else triton.next_power_of_2(m)


def fp4_gemv(x: torch.Tensor, qweight, bias: torch.Tensor | None, bn: int, bk: int, warps: int, stages: int
             ) -> torch.Tensor:
    """x [M<=4, K] bf16/fp16 times an nvfp4/mxfp4 weight [N, K] -> [M, N] in x.dtype (weight-only)."""
    is_mx = qweight.fmt == "mxfp4"
    M, K = x.shape
    N = qweight.shape[0]
    data, scale = qweight.data, qweight.scale.view(torch.uint8)
    kp = data.shape[1] * 2
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _fp4_gemv_kernel[(triton.cdiv(N, bn),)](
        x, data, scale, scale if is_mx else qweight.global_scale, bias if bias is not None else out, out,
        M, N, K, kp, x.stride(0), data.stride(0), scale.stride(0), out.stride(0),
        IS_MX=is_mx, HAS_BIAS=bias is not None, EVEN_K=K == kp and kp % bk == 0,
        BM=_rows_block(M), BN=bn, BK=bk, num_warps=warps, num_stages=stages,
    )
    return out


def w8_gemv(x: torch.Tensor, qweight, bias: torch.Tensor | None, bn: int, bk: int, warps: int, stages: int,
            x_mode: int, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [1, K] times an int8 / fp8 / fp8-tensor / fp8-block weight [N, K] -> [1, N] in x.dtype.

    x_mode as in `w8a8_gemm` (0 raw, 1 fused, 2 prequant with xq from `act_quant.quantize_activation`).
    """
    fmt = qweight.fmt
    blockwise = fmt == "fp8-block"
    if blockwise and (128 % bn or bk % 128):
        raise ValueError(f"fp8-block GEMV needs BN dividing 128 and BK a multiple of 128, got BN={bn}, BK={bk}")
    M, K = x.shape
    if M != 1:
        raise ValueError(f"the 8-bit GEMV takes one row, got M={M}; use the GEMM kernels (w8a8_matmul)")
    N = qweight.shape[0]
    w = qweight.data.view(torch.uint8) if qweight.data.dtype == torch.float8_e4m3fn else qweight.data
    kp = w.shape[1]
    ws = qweight.scale
    stride_wsn = ws.stride(0) if ws.dim() else 0
    if x_mode == 2:
        xin, xs = xq
        xin = xin.view(torch.uint8) if xin.dtype == torch.float8_e4m3fn else xin
    else:
        xin, xs = x, ws  # xs unused
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    # XC: columns per load of the fused amax pass (1 for the modes without it: no extra compiled variants).
    xc = min(triton.next_power_of_2(K), 4096) if x_mode == 1 and not blockwise else 1
    _w8_gemv_kernel[(triton.cdiv(N, bn),)](
        xin, xs, w, ws, bias if bias is not None else out, out, N, K, kp, w.stride(0), stride_wsn,
        W_INT8=fmt == "int8", BLOCKWISE=blockwise, X_MODE=x_mode, HAS_BIAS=bias is not None,
        EVEN_K=K == kp and kp % bk == 0, BN=bn, BK=bk, XC=xc, num_warps=warps, num_stages=stages,
    )
    return out
