"""Experiment: decode attention over an FP8 cache with the scores on the FP8 tensor cores (swap-AB wgmma).

    PYTHONPATH=. python3 bench/decode_attention_swapab.py [--batch 512 128] [--context 768]

The production kernel (`quarl.kernels.decode_attention`) widens every cached key and value to fp16 and runs
`mma.sync` with the G = 7 query heads of a kv head padded to 16 rows; at 512 sequences it is instruction-bound
(0.12 ms per 7B layer against a 0.097 ms byte floor). Here the scores are computed transposed, s^T = K q^T
([BLOCK_N, 16]): K is the 64-row A operand straight from shared memory in E4M3, so Triton emits
`wgmma.m64n16k32.e4m3` and K is never widened. q is split into two E4M3 parts per head (q_hi + q_lo, about 8
significant bits, like bf16), scaled so the largest |q| of a head maps to 224. The softmax runs down the columns
of s^T; P^T V accumulates acc^T [D, 16] from the fp16-widened V (pinned before its layout change, as in the
production kernel).

Checks every variant against `decode_attention_torch` in float64 (relative error) and times it against the
production kernel as CUDA-graph replays, printing one table. Nothing in quarl uses this kernel yet: it has run
only in Triton's CPU interpreter (relative error 2e-4 with fp16 queries) and been compiled for sm_90, where its
loop issues about as many instructions per 64 columns as the production kernel's (44 k vs 42 k thread
instructions: no K widening, but cross-warp softmax reductions and wgmma fences), so a speed-up is not expected
from the instruction count alone; the GPU run decides.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _widen_fp8(x):
    """E4M3 codes -> fp16 four at a time by inline assembly (two `cvt.rn.f16x2.e4m3x2`), pinned before the PV
    operand's layout change (the production kernel's widening until 2026-11-29; it now uses Triton's own)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _swapab_kernel(q_ptr, k_ptr, v_ptr, len_ptr, out_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                   stride_ob, stride_oh, sm_scale, kv_scale,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   PIN_WIDEN: tl.constexpr):
    """One program per (sequence, kv head), all of the sequence's columns; writes out [B, Hq, D] normalised."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    length = tl.load(len_ptr + b).to(tl.int32)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None],
                other=0.0).to(tl.float32)
    # scores in log2 units: sm_scale * kv_scale * log2(e) folded into q, then q split into two E4M3 parts
    q = q * (sm_scale * kv_scale * 1.4426950408889634)
    q_top = tl.max(tl.abs(q), 1)
    q_mult = tl.where(q_top > 0, 224.0 / q_top, 1.0)
    q = q * q_mult[:, None]
    q_hi = q.to(tl.float8e4nv)
    q_lo = (q - q_hi.to(tl.float32)).to(tl.float8e4nv)
    unscale = 1.0 / q_mult  # [BLOCK_G]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([D, BLOCK_G], dtype=tl.float32)  # acc^T
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    for n0 in range(0, length, BLOCK_N):
        cols = n0 + offs_n
        n_ok = cols < length
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        v = _widen_fp8(v) if PIN_WIDEN else v.to(tl.float16)
        s = tl.dot(k, tl.trans(q_lo), tl.dot(k, tl.trans(q_hi)))  # s^T [BLOCK_N, BLOCK_G] float32
        s = s * unscale[None, :]
        s = tl.where(n_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp2(s - m_new[None, :])  # p^T
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(tl.float16))  # [D, BLOCK_G]
        m_i = m_new
    l_safe = tl.where(g_ok, l_i, 1.0)
    out = acc * kv_scale / l_safe[None, :]
    tl.store(out_ptr + b * stride_ob + heads[None, :] * stride_oh + offs_d[:, None],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[None, :])


def decode_attention_swapab(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                            kv_scale: float = 1.0, block_n: int = 64, num_warps: int = 4,
                            num_stages: int = 3) -> torch.Tensor:
    """As `quarl.kernels.decode_attention.decode_attention` with one column range, for an FP8 cache only:
    q [B, Hq, D] bf16, k/v [S >= B, Hkv, C, D] float8_e4m3fn, lengths [B] -> [B, Hq, D] bf16."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        raise ValueError("decode_attention_swapab reads an FP8 E4M3 cache")
    out = torch.empty_like(q)
    G = Hq // Hkv
    _swapab_kernel[(B, Hkv)](
        q, k_cache, v_cache, lengths, out, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        1.0 / math.sqrt(D), float(kv_scale), G=G, D=D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        PIN_WIDEN=not INTERPRETED, num_warps=num_warps, num_stages=num_stages)
    return out


def main() -> None:
    from decode_attention_sweep import HKV, attention_case

    from quarl.bench.gemm import measure_ceilings
    from quarl.bench.rollout_breakdown import _graph_ms
    from quarl.kernels.decode_attention import choose_num_splits, decode_attention
    from quarl.rollout.fast_attention import FP8_KV_DTYPE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[512, 128])
    ap.add_argument("--context", type=int, default=768)
    args = ap.parse_args()
    bw, _ = measure_ceilings(torch)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; context {args.context}")
    print("| batch | kernel | block_n | warps | stages | ms | floor ms | % floor | rel. err |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        q, kk, vv, lengths, ref, floor = attention_case(batch, FP8_KV_DTYPE, args.context, bw)
        splits = choose_num_splits(batch, HKV, args.context, 64)
        runs = [("production", 64, None, 3, lambda bn, w, s: decode_attention(q, kk, vv, lengths, splits))]
        runs += [("swap-AB wgmma", bn, w, s, lambda bn, w, s: decode_attention_swapab(q, kk, vv, lengths, 1.0, bn,
                                                                                         w, s))
                 for bn in (64, 128) for w in (4, 8) for s in (2, 3)]
        for name, bn, w, s, fn in runs:
            try:
                out = fn(bn, w, s)
                err = float((out[:8].double() - ref).norm() / ref.norm())
                ms = _graph_ms(torch, lambda: fn(bn, w, s))
                print(f"| {batch} | {name} | {bn} | {w or 'default'} | {s} | {ms:.4f} | {floor:.4f} | "
                      f"{100 * floor / ms:.0f}% | {err:.1e} |")
            except Exception as e:  # a tile that does not compile is reported, not fatal
                print(f"| {batch} | {name} | {bn} | {w} | {s} | failed: {type(e).__name__}: {str(e)[:80]} | | | |")


if __name__ == "__main__":
    main()
