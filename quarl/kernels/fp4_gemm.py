"""W4A16 GEMM for NVFP4 / MXFP4 weights on GPUs without FP4 tensor cores (Hopper): out = x @ dequant(W)^T.

The kernel streams the packed E2M1 codes (0.5 byte per weight) and the block scales, dequantizes each tile in
registers and multiplies in the activation dtype (bf16/fp16) on the tensor cores with fp32 accumulation.
Decode (small M) is memory-bound: 4x fewer weight bytes than bf16 is the whole gain (BRIEF §3).

Element decode (why it is exact and cheap): a nibble s|e1 e0 m is placed into an fp16 bit pattern as
sign -> bit 15 and (e1 e0 m) -> bits 11..9. That fp16 number is exactly the E2M1 value times 2^-14 (the
E2M1 subnormal 0.5 lands on the fp16 subnormal 2^-15, converted exactly to fp32). The 2^14 is folded into
the block scale, so w = code * s_block is formed in fp32 and is exact in bf16/fp16 (a code has <= 2
significant bits, an E4M3 scale 4, an E8M0 scale 1). NVFP4's fp32 global scale is applied to the fp32
accumulator once, in the epilogue.

Limit: MXFP4 exponents e > 240 (block scales above 2^113) overflow the folded scale; real weights are far below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.kernels.common import GemmConfig, pid_to_tile, splitk_reduce


@triton.jit(do_not_specialize=["M"])
def _fp4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr,
    M, N, K, KP, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os,
    IS_MX: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """x [M, K] bf16/fp16; w uint8 [N, KP/2]; s [N, KP/G] (E4M3 for nvfp4, E8M0 uint8 for mxfp4);
    (both passed as uint8 bytes) gs float32 [] (nvfp4 global scale; unused for mxfp4); out [M, N] in x's dtype, or
    with SPLIT_K > 1 float32 partial sums [SPLIT_K, M, N] (global scale applied, bias not)."""
    G: tl.constexpr = 32 if IS_MX else 16
    pid_m, pid_n = pid_to_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k0 = pid_k * k_per_split
    ar_k = tl.arange(0, BK)
    ar_b = tl.arange(0, BK // 2)
    ar_g = tl.arange(0, BK // G)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k0 + ar_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k0 // 2 + ar_b)[None, :]
    s_ptrs = s_ptr + offs_n[:, None] * stride_sn + (k0 // G + ar_g)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for it in range(0, k_per_split // BK):
        kk = k0 + it * BK
        if EVEN_K:
            b = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            sc = tl.load(s_ptrs, mask=n_ok[:, None], other=0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            # Only tiles of the last split can run past KP (each split covers whole tiles).
            b = tl.load(w_ptrs, mask=n_ok[:, None] & (kk // 2 + ar_b < KP // 2)[None, :], other=0)
            sc = tl.load(s_ptrs, mask=n_ok[:, None] & (kk // G + ar_g < KP // G)[None, :], other=0)
            # x's last dim is the unpadded K: the weight's zero padding meets x's masked zeros.
            x = tl.load(x_ptrs, mask=m_ok[:, None] & (kk + ar_k < K)[None, :], other=0.0)
        b = b.to(tl.int32)
        lo = (((b & 0x8) << 12) | ((b & 0x7) << 9)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        if IS_MX:
            sf = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(e-127) * 2^14
        else:
            sf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
        # lo/hi element j is weight element 2j / 2j+1 of the tile, which lies in block j // (G/2).
        lo = (tl.reshape(lo, (BN, BK // G, G // 2)) * sf[:, :, None]).to(x_ptr.dtype.element_ty)
        hi = (tl.reshape(hi, (BN, BK // G, G // 2)) * sf[:, :, None]).to(x_ptr.dtype.element_ty)
        w = tl.reshape(tl.join(lo, hi), (BN, BK))
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BK
        w_ptrs += BK // 2
        s_ptrs += BK // G
    if not IS_MX:
        acc = acc * tl.load(gs_ptr)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


def fp4_matmul(x: torch.Tensor, qweight, bias: torch.Tensor | None, cfg: GemmConfig) -> torch.Tensor:
    """x [M, K] bf16/fp16 (contiguous rows) times an nvfp4/mxfp4 weight QuantizedTensor [N, K] -> [M, N] in x.dtype.

    cfg.bk must be a multiple of the format's block (16 / 32) and >= 32; cfg.split_k > 1 splits K over
    programs and sums the fp32 partials in a second small kernel.
    """
    is_mx = qweight.fmt == "mxfp4"
    M, K = x.shape
    N = qweight.shape[0]
    # Scales travel as raw bytes (E4M3 bits are reinterpreted in the kernel; a masked load needs an integer fill).
    data, scale = qweight.data, qweight.scale.view(torch.uint8)
    kp = data.shape[1] * 2
    gs = scale if is_mx else qweight.global_scale  # any tensor when unused
    bk, split = cfg.bk, cfg.split_k
    # Each split covers a whole number of BK tiles.
    k_per_split = triton.cdiv(triton.cdiv(kp, split), bk) * bk
    split = triton.cdiv(kp, k_per_split)
    even_k = K == kp and kp % k_per_split == 0
    grid = (triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn), split)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    _fp4_gemm_kernel[grid](
        x, data, scale, gs, bias if bias is not None else out, target,
        M, N, K, kp, k_per_split,
        x.stride(0), data.stride(0), scale.stride(0), target.stride(-2), target.stride(0) if split > 1 else 0,
        IS_MX=is_mx, HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_K=even_k,
        BM=cfg.bm, BN=cfg.bn, BK=bk, GROUP_M=cfg.group_m,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    if split > 1:
        splitk_reduce(target, bias, out)
    return out
