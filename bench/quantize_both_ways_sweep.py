"""Time the FP8 training operand quantizers on the GPU: both ways in one pass vs the two one-way passes.

    PYTHONPATH=. python3 bench/quantize_both_ways_sweep.py [--tokens 16384] [--cols 3584,4608] [--warps 8,16]

For x [tokens, cols] bf16: `act_quant.quantize_rows_and_columns` (rows in 1x128 groups + columns in 128-row
groups, one read of x) at each warp count, against `quantize_activation` + `quantize_columns_transposed` (two
reads). (A variant looping over several row tiles per program with `tl.range(..., num_stages=...)` measured 2x
slower and was removed: bench/results/gemm.md, 19:5x.) Microseconds per call (CUDA-graph replays,
`quarl.bench.gemm.time_graph`) and the copy-bandwidth floor (bytes read + written).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))


def main(argv=None) -> int:
    import torch

    from quarl.bench.gemm import measure_ceilings, time_graph
    from quarl.kernels.act_quant import quantize_activation, quantize_columns_transposed, quantize_rows_and_columns

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--cols", default="3584,4608,1536")
    parser.add_argument("--warps", default="4,8")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    bw, _ = measure_ceilings(torch)
    print(f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; M = {args.tokens}")
    print("| C | variant | us | floor us | % floor |\n|---:|---|---:|---:|---:|")
    for c in (int(v) for v in args.cols.split(",")):
        xs = [torch.randn(args.tokens, c, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        floor = 1e6 * (2 + 1 + 1) * args.tokens * c / bw  # read bf16, write two code copies
        kp = -(-c // 128) * 128
        variants = {f"both ways, {w} warps": (lambda i, w=w: quantize_rows_and_columns(xs[i], num_warps=w))
                    for w in (int(v) for v in args.warps.split(","))}
        variants["rows + columns, two passes"] = lambda i: (
            quantize_activation(xs[i], "fp8-block", kp, scales_column_major=True), quantize_columns_transposed(xs[i]))
        for name, fn in variants.items():
            t = 1e6 * time_graph(torch, fn, len(xs), 5)
            print(f"| {c} | {name} | {t:.1f} | {floor:.1f} | {100 * floor / t:.0f}% |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
