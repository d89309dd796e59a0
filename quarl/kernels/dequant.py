"""Weight dequantization to bf16/fp16/fp32 on the GPU, one kernel per weight.

fp4 weights: for the "dequantize then cuBLAS" path of large-M GEMMs. For prefill-sized M the GEMM is compute-bound
and an fp4 weight saves nothing on the tensor cores, so writing the dense weight once (N*K*2 bytes, tens of
microseconds) and calling the library GEMM can beat dequantizing every tile inside a Triton GEMM. The element
decode is the one of `quarl.kernels.fp4_gemm` (exact).

8-bit weights (int8, fp8, fp8-tensor, fp8-block): Q(W) for the unified flow's backward (the gradient of x is
g @ Q(W)), in one pass instead of the reference's float32 temporaries and expanded tile scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp4_dequant_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, N, K, KP2, KG, stride_wn, stride_sn, stride_on,
                        IS_MX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """w uint8 [N, KP/2], s uint8 [N, KP/G] (E4M3 / E8M0 bytes), gs float32 [] -> out [N, K] (padding dropped)."""
    G: tl.constexpr = 32 if IS_MX else 16
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    ar_b = tl.arange(0, BK // 2)
    ar_g = tl.arange(0, BK // G)
    n_ok = offs_n < N
    b = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 // 2 + ar_b)[None, :],
                mask=n_ok[:, None] & (k0 // 2 + ar_b < KP2)[None, :], other=0).to(tl.int32)
    sc = tl.load(s_ptr + offs_n[:, None] * stride_sn + (k0 // G + ar_g)[None, :],
                 mask=n_ok[:, None] & (k0 // G + ar_g < KG)[None, :], other=0)
    lo = (((b & 0x8) << 12) | ((b & 0x7) << 9)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if IS_MX:
        sf = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    else:
        sf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
    # (code * s_block) is exact; the global scale then rounds once, as in the reference.
    lo = tl.reshape(lo, (BN, BK // G, G // 2)) * sf[:, :, None]
    hi = tl.reshape(hi, (BN, BK // G, G // 2)) * sf[:, :, None]
    w = tl.reshape(tl.join(lo, hi), (BN, BK))
    if not IS_MX:
        w = w * tl.load(gs_ptr)
    w = w.to(out_ptr.dtype.element_ty)
    offs_k = k0 + tl.arange(0, BK)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], w,
             mask=n_ok[:, None] & (offs_k < K)[None, :])


def dequantize_fp4_weight(qweight, dtype: torch.dtype) -> torch.Tensor:
    """nvfp4 / mxfp4 weight QuantizedTensor [N, K] -> dense [N, K] in dtype (bf16/fp16), on its device.

    Values are code * s_block * s_global computed in fp32, then rounded once to dtype.
    """
    N, K = qweight.shape
    is_mx = qweight.fmt == "mxfp4"
    scale = qweight.scale.view(torch.uint8)
    gs = scale if is_mx else qweight.global_scale
    out = torch.empty((N, K), dtype=dtype, device=qweight.data.device)
    bn, bk = 32, 256
    _fp4_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        qweight.data, scale, gs, out, N, K, qweight.data.shape[1], scale.shape[1], qweight.data.stride(0),
        scale.stride(0), out.stride(0),
        IS_MX=is_mx, BN=bn, BK=bk, num_warps=4,
    )
    return out


# scale layouts of the 8-bit weight formats
_PER_TENSOR, _PER_ROW, _PER_TILE = 0, 1, 2


@triton.jit
def _w8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, IS_FP8: tl.constexpr,
                       SCALES: tl.constexpr, TILE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """w [N, Kp] int8 codes or E4M3 bytes, s float32 (SCALES 0: one scale []; 1: per row [N, 1]; 2: per TILE x TILE
    tile [ceil(N/TILE), Kp/TILE]) -> out [N, K] = code * scale in float32, rounded once (padding dropped)."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    n_ok = offs_n < N
    mask = n_ok[:, None] & (offs_k < K)[None, :]
    rows = offs_n.to(tl.int64)  # N * Kp can pass 2^31 elements
    c = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
    if IS_FP8:
        v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = c.to(tl.float32)
    if SCALES == 0:
        w = v * tl.load(s_ptr)
    elif SCALES == 1:
        w = v * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)[:, None]
    else:
        w = v * tl.load(s_ptr + (offs_n // TILE)[:, None] * stride_sn + (offs_k // TILE)[None, :], mask=mask,
                        other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_8bit_weight(qweight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 / fp8 / fp8-tensor / fp8-block weight QuantizedTensor [N, K] -> dense [N, K] in dtype, on its device:
    the values of `qweight.dequantize(dtype)` bit for bit (code * scale in float32, then one rounding). out: an
    [N, K] tensor of dtype (rows contiguous) to write instead of a new one."""
    from quarl.formats.fp8 import FP8_BLOCK

    N, K = qweight.shape
    data = qweight.data if qweight.data.stride(-1) == 1 else qweight.data.contiguous()
    is_fp8 = data.dtype != torch.int8
    if is_fp8:
        data = data.view(torch.uint8)
    scale = qweight.scale.contiguous()
    # the layout by format, and the scale count checked: a misread layout would read past the scales
    if qweight.fmt == "fp8-block":
        layout, count = _PER_TILE, triton.cdiv(N, FP8_BLOCK) * (data.shape[1] // FP8_BLOCK)
    elif qweight.fmt == "fp8-tensor":
        layout, count = _PER_TENSOR, 1
    else:  # int8, fp8: one scale per row
        layout, count = _PER_ROW, N
    if scale.numel() != count:
        raise ValueError(f"{qweight.fmt} weight [{N}, {K}] has {scale.numel()} scales; expected {count}")
    if layout == _PER_TENSOR:
        scale = scale.reshape(())
    elif layout == _PER_ROW:
        scale = scale.reshape(N, 1)
    if out is None:
        out = torch.empty((N, K), dtype=dtype, device=data.device)
    elif out.shape != (N, K) or out.dtype != dtype or (K and out.stride(1) != 1) or out.device != data.device:
        raise ValueError(f"dequantize out must be [{N}, {K}] {dtype} with contiguous rows on {data.device}, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()} on {out.device}")
    bn, bk = 32, 128
    _w8_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        data, scale, out, N, K, data.stride(0), scale.stride(0) if scale.dim() else 0, out.stride(0),
        IS_FP8=is_fp8, SCALES=layout, TILE=FP8_BLOCK, BN=bn, BK=bk, num_warps=4,
    )
    return out
