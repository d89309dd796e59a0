"""How fast can a Triton kernel stream an FP8 weight at M = 1? A ceiling probe for the B1 decode targets.

    PYTHONPATH=. python3 bench/gemv_probe.py [--shapes qkv,o,gate_up,down] [--top 3]

The FP8 GEMV of `quarl.kernels.gemv` reached 26-32 % of the bandwidth roofline on small decode shapes
(bench/results/gemm.md, 2026-11-29), against cuBLAS bf16's 74 %; this probe located the gap (the kernel's 3-D
product layout, since replaced) and still gives the ceiling. It times simpler kernels over the same 1-byte
weight [N, K], each program owning BN rows and looping over K in BK steps (optionally split over SPLIT programs
that add into the output with atomics), to find where the time goes:
  stream   integer sum of the raw bytes (no conversion): the load pipeline alone;
  convert  E4M3 -> float32 of every weight, summed;
  gemv     the E4M3 weight times a bf16 x [K] (the W8A16 product; a W8A8 kernel adds x's quantization).
Each row: microseconds per call from CUDA-graph replays cycling over weight copies larger than L2 (cold weights,
as in decode), and % of the measured copy bandwidth for the weight bytes (the roofline of gemm.md's rows). The
bf16 cuBLAS GEMV of the same shape and the dispatched fp8 path (`kernels.quantized_matmul`) are the reference
rows. The gemv variant is checked against a float64 product (relative error printed).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
MODES = {"stream": 0, "convert": 1, "gemv": 2}
CONFIGS = {"bn": (4, 8, 16), "bk": (512, 1024), "split": (1, 2, 4), "warps": (4, 8)}


@triton.jit
def _probe_kernel(w_ptr, x_ptr, out_ptr, N, K, K_PER_SPLIT, stride_wn,
                  MODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr):
    """w uint8 [N, K] (E4M3 bytes), x bf16 [K] -> out float32 [N]: program (i, s) covers rows [i*BN, +BN) and
    columns [s*K_PER_SPLIT, +K_PER_SPLIT); MODE 0 sums the bytes, 1 the E4M3 values, 2 the products with x."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * K_PER_SPLIT
    rk = tl.arange(0, BK)
    n_ok = rn < N
    if MODE == 0:
        acc = tl.zeros((BN, BK), dtype=tl.int32)
    else:
        acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k in range(k0, k0 + K_PER_SPLIT, BK):
        ok = n_ok[:, None] & (k + rk < K)[None, :]
        w = tl.load(w_ptr + rn[:, None] * stride_wn + (k + rk)[None, :], mask=ok, other=0)
        if MODE == 0:
            acc += w.to(tl.int32)
        elif MODE == 1:
            acc += w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            x = tl.load(x_ptr + k + rk, mask=k + rk < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * x[None, :]
    y = tl.sum(acc.to(tl.float32), axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + rn, y, mask=n_ok)
    else:
        tl.store(out_ptr + rn, y, mask=n_ok)


def probe(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, mode: int, bn: int, bk: int, split: int,
          warps: int) -> None:
    """One probe launch on w uint8 [N, K], x bf16 [K] into out float32 [N] (zeroed first when split > 1)."""
    n, k = w.shape
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    if split > 1:
        out.zero_()
    _probe_kernel[(triton.cdiv(n, bn), triton.cdiv(k, k_per_split))](
        w, x, out, n, k, k_per_split, w.stride(0), MODE=mode, BN=bn, BK=bk, ATOMIC=split > 1, num_warps=warps)


def main() -> None:
    from quarl import kernels
    from quarl.bench.gemm import _copies, _n_copies, measure_ceilings, time_graph
    from quarl.formats import quantize

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--modes", default="stream,gemv", help="comma list of " + ", ".join(MODES))
    parser.add_argument("--top", type=int, default=3, help="fastest configurations printed per shape and mode")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bw, _ = measure_ceilings(torch)
    print(f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    print("| shape | mode | config | us | % bandwidth | rel. err |\n|---|---|---|---:|---:|---:|")
    configs = list(itertools.product(*CONFIGS.values()))
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw = quantize(w_bf16, "fp8", "weight")
        qws = _copies(qw, _n_copies(n * k))
        codes = [q.data.view(torch.uint8) for q in qws]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(n, device="cuda", dtype=torch.float32)

        def row(mode, label, seconds, nbytes, err=""):
            print(f"| {name} ({n} x {k}) | {mode} | {label} | {seconds * 1e6:.1f} | "
                  f"{100 * nbytes / bw / seconds:.0f}% | {err} |", flush=True)

        bf16_copies = [w_bf16] + [w_bf16.clone() for _ in range(_n_copies(2 * n * k) - 1)]
        row("bf16 cuBLAS", "F.linear", time_graph(
            torch, lambda i: torch.nn.functional.linear(x, bf16_copies[i]), len(bf16_copies), args.repeats),
            2 * n * k)
        bf16_copies = None  # free them (rebind, not del: the timed lambda uses the name)
        row("fp8 dispatched", "kernels.quantized_matmul", time_graph(
            torch, lambda i: kernels.quantized_matmul(x, qws[i], False, None), len(qws), args.repeats), n * k)
        want = (x.double() @ qw.data.double().T)[0]
        for mode_name in args.modes.split(","):
            mode = MODES[mode_name]
            timed = []
            for bn, bk, split, warps in configs:
                if triton.cdiv(k, split) < bk:
                    continue
                try:
                    t = time_graph(torch, lambda i, c=(bn, bk, split, warps): probe(codes[i], x[0], out, mode, *c),
                                   len(codes), args.repeats)
                except Exception as e:  # a tile that does not fit
                    print(f"  skipped BN={bn} BK={bk} split={split} warps={warps}: {type(e).__name__}")
                    continue
                timed.append((t, (bn, bk, split, warps)))
            for t, (bn, bk, split, warps) in sorted(timed)[:args.top]:
                err = ""
                if mode == MODES["gemv"]:
                    probe(codes[0], x[0], out, mode, bn, bk, split, warps)
                    err = f"{float((out.double() - want).norm() / want.norm()):.1e}"
                row(mode_name, f"BN={bn} BK={bk} split={split} warps={warps}", t, n * k, err)
        codes = qws = None


if __name__ == "__main__":
    main()
