"""Activation quantization at training shapes: the row kernel (`_act_quant_kernel`, one program per row) at each
block / warps, fp8-block codes with column-major scales as the FP8 training linear takes them. Microseconds
(CUDA-graph replays) and % of the measured copy bandwidth (bytes read + codes written). Codes and scales must be
identical to the default launch's. (A tile kernel, one program per 16-64 rows x one 128-wide group, was tried
and dropped: it won only at K = 512, 10 us against 15; bench/results/gemm.md.)

    PYTHONPATH=. python3 bench/act_quant_sweep.py [--m 20480]
"""

from __future__ import annotations

import argparse

import torch
from quarl.bench.gemm import measure_ceilings
from quarl.bench.rollout_breakdown import _graph_ms
from quarl.kernels.act_quant import quantize_activation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=20480)
    args = parser.parse_args()
    bw, _ = measure_ceilings(torch)
    print(f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; M = {args.m}")
    print("| K | kernel | us | % copy bw |\n|---:|---|---:|---:|")
    for k in (512, 3584, 18944):
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16) * 3
        ref = quantize_activation(x, "fp8-block", k, scales_column_major=True)
        floor = 3 * x.numel() / bw * 1e6
        variants = {f"row block {b} warps {w}": (lambda b=b, w=w: quantize_activation(
            x, "fp8-block", k, scales_column_major=True, block=b, num_warps=w)) for b in (512, 1024, 2048)
            for w in (2, 4, 8)}
        for name, fn in variants.items():
            codes, scales = fn()
            if not (torch.equal(codes.view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(scales, ref[1])):
                print(f"| {k} | {name} | MISMATCH | |")
                continue
            t = 1e3 * _graph_ms(torch, fn, 20)
            print(f"| {k} | {name} | {t:.1f} | {100 * floor / t:.0f}% |")


if __name__ == "__main__":
    main()
