"""Where a dispatched 8-bit linear's time goes: each kernel it launches (activation quantization, the GEMM, a
split-K reduction) timed by the CUDA profiler over many calls, next to bf16 F.linear.

    PYTHONPATH=. python3 bench/gemm_breakdown.py [--formats fp8,int8] [--m 16,64]
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.nn.functional as F
from quarl.bench.gemm import SHAPES
from quarl.formats import quantize
from quarl.kernels import plan_for
from quarl.kernels.dispatch import run_plan


def kernel_times(fn, calls: int = 200) -> dict[str, float]:
    """Mean microseconds per call of fn spent in each CUDA kernel (by name), from the profiler."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name[:60]] += ev.device_time / calls
    return dict(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="fp8,int8")
    parser.add_argument("--m", default="16,64")
    args = parser.parse_args()
    print("| shape | M | format | plan | kernel | us/call |\n|---|---:|---|---|---|---:|")
    for shape, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for name, t in kernel_times(lambda: F.linear(x, w)).items():
                print(f"| {shape} | {m} | bf16 | cuBLAS | {name} | {t:.1f} |")
            for fmt in args.formats.split(","):
                qw = quantize(w, fmt)
                plan = plan_for(fmt, False, m, n, k)
                if plan.kind == "bf16":
                    print(f"| {shape} | {m} | {fmt} | bf16 fallback | - | - |")
                    continue
                for name, t in kernel_times(lambda: run_plan(plan, x, qw, None)).items():
                    print(f"| {shape} | {m} | {fmt} | {plan.kind} {plan.cfg} | {name} | {t:.1f} |")


if __name__ == "__main__":
    main()
