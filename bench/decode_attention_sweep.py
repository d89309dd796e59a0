"""Decode attention kernel sweep on the GPU: bf16 vs FP8 KV cache, tile and pipeline variants, one table.

    python3 bench/decode_attention_sweep.py [--batch 512 128] [--context 768] [--quick] [--layers 8]

Qwen2.5-7B attention geometry (28 query heads, 4 kv heads, head_dim 128), every sequence at `context` filled
columns of a cache with room for 1280. Each variant is checked against `decode_attention_torch` in float64 on
the same cache values (relative error) and timed as a CUDA-graph replay (mean per call). "floor" is the cache
bytes read / the measured copy bandwidth (read + write bytes per second, as in the B2 roofline).

--layers L times each call over L distinct caches in turn (ms per layer), as the decode step reads 28 layers'
caches one after another: with a single cache repeated, part of it stays in the 50 MB L2 between calls, which
flatters the kernel against the per-layer time of the step's breakdown.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from quarl.bench.gemm import measure_ceilings  # noqa: E402
from quarl.bench.rollout_breakdown import _graph_ms  # noqa: E402
from quarl.kernels.decode_attention import choose_num_splits, decode_attention  # noqa: E402
from quarl.rollout.fast_attention import FP8_KV_DTYPE, decode_attention_torch  # noqa: E402

HQ, HKV, D, CAPACITY = 28, 4, 128, 1280


def attention_case(batch: int, kv_dtype: torch.dtype, context: int, bw: float):
    """Seeded inputs of the 7B geometry, every sequence at `context` columns: (q, k, v cut to context, lengths,
    float64 reference of the first 8 sequences, byte floor in ms)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, HQ, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(batch, HKV, CAPACITY, D, device="cuda", generator=g).to(kv_dtype)
    v = torch.randn(batch, HKV, CAPACITY, D, device="cuda", generator=g).to(kv_dtype)
    lengths = torch.full((batch,), context, device="cuda")
    ref = decode_attention_torch(q[:8].double(), k[:8], v[:8], lengths[:8], context)
    floor_ms = 1e3 * 2 * batch * HKV * context * D * k.element_size() / bw
    return q, k[:, :, :context], v[:, :, :context], lengths, ref, floor_ms


def _copy_in_capacity(t: torch.Tensor) -> torch.Tensor:
    """t [B, H, context, D] copied into a new cache with room for CAPACITY columns, cut to context (t's layout)."""
    full = torch.empty(t.shape[0], t.shape[1], CAPACITY, t.shape[3], dtype=t.dtype, device=t.device)
    full[:, :, :t.shape[2]] = t
    return full[:, :, :t.shape[2]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[512, 128])
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--quick", action="store_true", help="only the default tile (block_n 64, 4 warps, 2 stages)")
    ap.add_argument("--layers", type=int, default=1, help="distinct caches read in turn (cold L2, as in a step)")
    args = ap.parse_args()
    bw, _ = measure_ceilings(torch)
    variants = [(64, 4, 2)] if args.quick else list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3)))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; context {args.context}")
    print("| batch | KV | block_n | warps | stages | splits | ms | floor ms | % floor | rel. err |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, kv_dtype in itertools.product(args.batch, (torch.bfloat16, FP8_KV_DTYPE)):
        q, kk, vv, lengths, ref, floor_ms = attention_case(batch, kv_dtype, args.context, bw)
        caches = [(kk, vv)] + [(_copy_in_capacity(kk), _copy_in_capacity(vv)) for _ in range(args.layers - 1)]
        for block_n, warps, stages in variants:
            splits = choose_num_splits(batch, HKV, args.context, block_n)
            try:
                out = decode_attention(q, kk, vv, lengths, splits, 1.0, block_n, warps, stages)
                err = float((out[:8].double() - ref).norm() / ref.norm())
                ms = _graph_ms(torch, lambda: [decode_attention(q, k, v, lengths, splits, 1.0, block_n, warps, stages)
                                               for k, v in caches]) / len(caches)
            except Exception as e:  # a variant that does not compile (shared memory) is reported, not fatal
                print(f"| {batch} | {str(kv_dtype)[6:]} | {block_n} | {warps} | {stages} | {splits} | failed: "
                      f"{type(e).__name__} | | | |")
                continue
            print(f"| {batch} | {str(kv_dtype)[6:]} | {block_n} | {warps} | {stages} | {splits} | {ms:.3f} | "
                  f"{floor_ms:.3f} | {100 * floor_ms / ms:.0f}% | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
