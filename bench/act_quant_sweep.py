"""Activation quantization (`_act_quant_kernel`) at each block / warps against the default launch, at training
shapes (fp8-block codes with column-major scales, as the FP8 training linear takes them) or decode shapes
(`--fmt fp8 --m 1,16,64,512`: per-row scales; a block below K walks each row twice, as the old default did with
1024-column blocks and 4 warps; "one program per row": long rows of a few-row batch not split over programs).
Microseconds per call (a CUDA graph of back-to-back calls) and % of the measured copy bandwidth (bytes read +
codes written). Codes and scales must be identical to the default launch's. (A tile kernel, one program per
16-64 rows x one 128-wide group, was tried and dropped: it won only at K = 512, 10 us against 15;
bench/results/gemm.md.)

    PYTHONPATH=. python3 bench/act_quant_sweep.py [--m 20480] [--fmt fp8-block]
"""

from __future__ import annotations

import argparse

import torch
from quarl.bench.gemm import measure_ceilings
from quarl.bench.rollout_breakdown import _graph_ms
from quarl.kernels import act_quant
from quarl.kernels.act_quant import quantize_activation


def _one_program_per_row(fn):
    """fn run with the few-rows split of per-row amax walks off (one program walks each long row twice)."""
    def run():
        old, act_quant.SPLIT_AMAX_ROWS_BELOW = act_quant.SPLIT_AMAX_ROWS_BELOW, 0
        try:
            return fn()
        finally:
            act_quant.SPLIT_AMAX_ROWS_BELOW = old
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="20480", help="comma list of row counts")
    parser.add_argument("--fmt", default="fp8-block", help="int8, fp8, fp8-block or fp8-tensor")
    args = parser.parse_args()
    bw, _ = measure_ceilings(torch)
    print(f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; format {args.fmt}")
    print("| M | K | kernel | us | % copy bw |\n|---:|---:|---|---:|---:|")
    column_major = args.fmt == "fp8-block"
    for m in [int(v) for v in args.m.split(",")]:
        for k in (512, 3584, 18944):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
            ref = quantize_activation(x, args.fmt, k, scales_column_major=column_major)
            floor = 3 * x.numel() / bw * 1e6
            variants = {"default": lambda: quantize_activation(x, args.fmt, k, scales_column_major=column_major)}
            variants.update({f"block {b} warps {w}": (lambda b=b, w=w: quantize_activation(
                x, args.fmt, k, scales_column_major=column_major, block=b, num_warps=w))
                for b in (1024, 4096) for w in (2, 8)})
            if args.fmt in ("int8", "fp8"):
                variants["one program per row"] = _one_program_per_row(variants["default"])
            for name, fn in variants.items():
                codes, scales = fn()
                if not (torch.equal(codes.view(torch.uint8), ref[0].view(torch.uint8))
                        and torch.equal(scales, ref[1])):
                    print(f"| {m} | {k} | {name} | MISMATCH | |")
                    continue
                t = 1e3 * _graph_ms(torch, fn, reps=10, calls=50 if m <= 4096 else 5)
                print(f"| {m} | {k} | {name} | {t:.1f} | {100 * floor / t:.0f}% |")


if __name__ == "__main__":
    main()
