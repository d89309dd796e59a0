"""Fused decode elementwise kernels at rollout batch sizes (microseconds, CUDA-graph replays), one table.

    PYTHONPATH=. python3 bench/decode_elementwise_sweep.py [--m 512] [--warps 8 16]

Qwen2.5-7B shapes (hidden 3584, intermediate 18944, 28 + 2 x 4 heads of 128). SiLU·mul with FP8 codes is timed
both ways: the two-pass kernel (`_silu_mul_kernel`, every product computed twice) and the row-on-chip kernel
(`_silu_mul_row_kernel`, once) at each --warps; their codes must be identical. The kernels that take a unit-scale
FP8 product under deferred scales (SiLU·mul, add + norm, rotary) are also timed with their scaled inputs: that
extra time is what deferring a GEMM's scales costs, against what the per-tensor GEMM saves (bench/results/gemm.md).
"floor" = bytes read + written / the measured copy bandwidth (column scales not counted: they are L2 reads).
"""

from __future__ import annotations

import argparse

import torch

from quarl.bench.gemm import measure_ceilings
from quarl.bench.rollout_breakdown import _graph_ms
from quarl.kernels.act_quant import quantize_activation
from quarl.kernels.decode_fused import (_silu_mul_kernel, _silu_mul_row_kernel, rms_norm_rows, rope_rows,
                                        rope_rows_scaled, row_pieces, silu_mul_rows)

HIDDEN, INTER, HQ, HKV, D = 3584, 18944, 28, 4, 128


def us(fn) -> float:
    return 1e3 * _graph_ms(torch, fn, 50)


def silu_two_pass(g, u, codes, scales):
    # u, u, u: the unused scale pointers of the unscaled kernel
    _silu_mul_kernel[(g.shape[0],)](g, u, u, codes, scales, u, u, u, g.shape[1], g.stride(0), u.stride(0),
                                    WRITE_H=False, QUANT=True, QUANT_INT8=False, SCALED=False, BLOCK=2048,
                                    num_warps=8)


def silu_row(g, u, codes, scales, warps):
    c0, c1, c2 = row_pieces(g.shape[1])
    _silu_mul_row_kernel[(g.shape[0],)](g, u, u, codes, scales, u, u, u, g.shape[1], g.stride(0), u.stride(0),
                                        WRITE_H=False, QUANT_INT8=False, SCALED=False, C0=c0, C1=c1, C2=c2,
                                        num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[512])
    ap.add_argument("--warps", type=int, nargs="+", default=[8, 16])
    args = ap.parse_args()
    bw, _ = measure_ceilings(torch)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| kernel | M | us | floor us | % floor |")
    print("|---|---:|---:|---:|---:|")
    for m in args.m:
        def row(name, fn, nbytes):
            t = us(fn)
            print(f"| {name} | {m} | {t:.1f} | {1e6 * nbytes / bw:.1f} | {100 * nbytes / bw / (t * 1e-6):.0f}% |")

        gu = torch.randn(m, 2 * INTER, device="cuda", dtype=torch.bfloat16) * 4
        g, u = gu[:, :INTER], gu[:, INTER:]
        ref_codes = torch.empty(m, INTER, device="cuda", dtype=torch.uint8)
        ref_scales = torch.empty(m, 1, device="cuda")
        silu_two_pass(g, u, ref_codes, ref_scales)
        silu_bytes = m * INTER * (2 + 2 + 1)
        row("silu_mul + fp8 codes, two passes", lambda: silu_two_pass(g, u, ref_codes, ref_scales), silu_bytes)
        for w in args.warps:
            codes, scales = torch.empty_like(ref_codes), torch.empty_like(ref_scales)
            silu_row(g, u, codes, scales, w)
            same = torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
            row(f"silu_mul + fp8 codes, row on chip, {w} warps{'' if same else ' (CODES DIFFER)'}",
                lambda: silu_row(g, u, codes, scales, w), silu_bytes)
        row("silu_mul, bf16 out", lambda: silu_mul_rows(g, u, None), m * INTER * 6)
        rs = torch.rand(m, 1, device="cuda") * 1e-3
        cols = torch.rand(2 * INTER, device="cuda") * 1e-3
        row("silu_mul + fp8 codes (production call)", lambda: silu_mul_rows(g, u, "fp8", write_h=False), silu_bytes)
        row("silu_mul + fp8 codes, scaled inputs (deferred scales)",
            lambda: silu_mul_rows(g, u, "fp8", write_h=False, in_scales=(rs, cols)), silu_bytes)
        x, d = (torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w_norm = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
        for w in (None, 4, 16):
            row(f"add + rms_norm + fp8 codes, {w or 'default'} warps",
                lambda: rms_norm_rows(x, d, w_norm, None, 1e-6, "fp8", write_h=False, num_warps=w),
                m * HIDDEN * (2 + 2 + 2 + 1))
        row("add + rms_norm + fp8 codes, scaled delta (deferred scales)",
            lambda: rms_norm_rows(x, d, w_norm, None, 1e-6, "fp8", write_h=False, delta_scales=(rs, cols[:HIDDEN])),
            m * HIDDEN * (2 + 2 + 2 + 1))
        for block, w in ((None, 4), (4096, 4), (4096, 8)):
            row(f"act quant fp8 (o_proj input), block {block or 'default'}, {w} warps",
                lambda: quantize_activation(x, "fp8", HIDDEN, block=block, num_warps=w), m * HIDDEN * 3)
        qkv = torch.randn(m, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
        cs = torch.randn(m, D, device="cuda", dtype=torch.bfloat16)
        row("rope q/k", lambda: rope_rows(qkv, cs, cs, HQ, HKV, D), m * (HQ + HKV) * D * 4)
        n_qkv = (HQ + 2 * HKV) * D
        bias = torch.randn(n_qkv, device="cuda", dtype=torch.bfloat16)
        row("rope q/k + v, scaled product and bias (deferred scales)",
            lambda: rope_rows_scaled(qkv, rs, cols[:n_qkv], bias, cs, cs, HQ, HKV, D), m * n_qkv * 4)


if __name__ == "__main__":
    main()
