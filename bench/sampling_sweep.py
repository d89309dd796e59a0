"""Sampling kernel tiles at the rollout batch: one program per row vs rows split into column ranges.

    PYTHONPATH=. python3 bench/sampling_sweep.py [--batch 512] [--vocab 152064]

Times `quarl.kernels.sampling.sample_rows` (bf16 logits + float32 noise, temperature 1) as CUDA-graph replays
for ranges x (block, warps), checks each variant's tokens against the one-program kernel on the same noise, and
prints one table; floor = logits + noise bytes / copy bandwidth. Why ranges: with one program per row, a row
of a 152k vocabulary is 149 blocks of 1024 columns walked one after another, latency-bound at rollout batches.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from quarl.bench.gemm import measure_ceilings
from quarl.bench.rollout_breakdown import _graph_ms
from quarl.kernels.sampling import sample_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=152064)
    args = ap.parse_args()
    bw, _ = measure_ceilings(torch)
    logits = torch.randn(args.batch, args.vocab, device="cuda", dtype=torch.bfloat16) * 3
    noise = torch.rand(args.batch, args.vocab, device="cuda")
    floor_ms = 1e3 * args.batch * args.vocab * (2 + 4) / bw
    ref, _ = sample_rows(logits, noise, 1.0)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| ranges | block | warps | ms | floor ms | % floor | tokens as 1 range |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for ranges, (block, warps) in itertools.product((1, 2, 4, 8, 16), ((1024, 4), (2048, 8), (4096, 8))):
        tok, _ = sample_rows(logits, noise, 1.0, ranges, block, warps)
        ms = _graph_ms(torch, lambda: sample_rows(logits, noise, 1.0, ranges, block, warps))
        print(f"| {ranges} | {block} | {warps} | {ms:.3f} | {floor_ms:.3f} | {100 * floor_ms / ms:.0f}% | "
              f"{'same' if torch.equal(tok, ref) else f'{int((tok != ref).sum())} differ'} |")


if __name__ == "__main__":
    main()
