"""Forward + backward time of one linear layer in the three training modes of the unified flow (GPU).

    python3 bench/fp8_training_linear.py [--tokens 4096] [--repeats 10] [--shapes qkv,o] [--wgrad-kernel] [--profile]

For the Qwen2.5-7B linear shapes (qkv, o, gate_up, down) with M tokens, times y = linear(x); y.backward(g):
  * bf16: F.linear on the bf16 master weight (the bf16 / split flows' training GEMMs);
  * unified: the straight-through unified forward (fake-quantized x and W, bf16 GEMMs, bf16 gradients);
  * fp8-backward: `quarl.model.fp8_training.FP8BlockLinear` (precision.quantized_backward=true), on its default
    path (all three GEMMs on cuBLAS where `training_gemm_ok`), or with --unfused on the per-GEMM path
    (`FastPaths.fused_cublas_path` off);
  * with --wgrad-kernel, fp8-backward again with its weight gradient on the FP8 tensor cores
    (`FastPaths.fp8_weight_grad_kernel`), and that gradient's largest difference from the bf16-GEMM one
    relative to its largest value (both multiply the same rounded operands);
  * with --profile, the CUDA kernels of three fp8-backward iterations (weight-gradient kernel on with
    --wgrad-kernel), largest total time first: where the layer's time goes.
Shapes: the Qwen2.5-7B linears (qkv, o, gate_up, down) and the Qwen2.5-1.5B ones (qkv-1.5b, ...).
Each variant runs `--warmup` extra untimed iterations, then `quarl.bench.gemm.median_time` (3 untimed
iterations, then `--repeats` timed ones; CUDA events around forward + backward; the median is reported;
quantization of every operand included).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
          "qkv-1.5b": (2048, 1536), "o-1.5b": (1536, 1536), "gate_up-1.5b": (17920, 1536), "down-1.5b": (1536, 8960)}


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F

    from quarl.bench.gemm import median_time
    from quarl.model.qlinear import QuantLinear

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="rows M of the activations")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--warmup", type=int, default=0, help="extra untimed iterations per variant")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--wgrad-kernel", action="store_true",
                        help="also time fp8-backward with the weight gradient on the FP8 kernel "
                             "(quarl.fast_paths.FastPaths.fp8_weight_grad_kernel)")
    parser.add_argument("--unfused", action="store_true",
                        help="fp8-backward without the all-cuBLAS path (quarl.fast_paths.FastPaths.fused_cublas_path)")
    parser.add_argument("--profile", action="store_true", help="print the CUDA kernels of fp8-backward per shape")
    parser.add_argument("--host-profile", action="store_true",
                        help="print where the host (Python) time of fp8-backward goes per shape (cProfile)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; M = {args.tokens} tokens")
    from quarl.fast_paths import FastPaths

    paths = FastPaths(fused_cublas_path=not args.unfused)
    print(f"fp8-backward: {'unfused (fused_cublas_path off)' if args.unfused else 'defaults'}")
    extra = " fp8 wgrad (ms) | fp8 wgrad vs bf16 | wgrad rel. diff |" if args.wgrad_kernel else ""
    print("| shape (N x K) | bf16 (ms) | unified (ms) | fp8-backward (ms) | fp8-backward vs bf16 |" + extra)
    print("|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if args.wgrad_kernel else ""))
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        layers = {}
        for mode, backward in (("unified", False), ("fp8-backward", True)):
            layer = QuantLinear(k, n, device="cuda", dtype=torch.bfloat16)
            layer.configure(rollout_format="fp8-block", train_format="fp8-block", quantized_backward=backward)
            layer.fast_paths = paths
            layers[mode] = layer
        w = layers["unified"].weight

        def run(fn):
            def step():
                x.grad = None
                fn(x).backward(g)
            for _ in range(args.warmup):
                step()
            return step

        ms = {"bf16": 1e3 * median_time(torch, run(lambda t: F.linear(t, w)), args.repeats)}
        for mode, layer in layers.items():
            ms[mode] = 1e3 * median_time(torch, run(layer), args.repeats)
        row = (f"| {name} ({n} x {k}) | {ms['bf16']:.2f} | {ms['unified']:.2f} | {ms['fp8-backward']:.2f} | "
               f"{ms['bf16'] / ms['fp8-backward']:.2f}x |")
        if args.wgrad_kernel:
            layer = layers["fp8-backward"]
            layer.weight.grad = None
            layer(x).backward(g)
            ref = layer.weight.grad.float()
            layer.fast_paths = dataclasses.replace(paths, fp8_weight_grad_kernel=True)
            try:
                t = 1e3 * median_time(torch, run(layer), args.repeats)
                layer.weight.grad = None
                layer(x).backward(g)
                diff = float((layer.weight.grad.float() - ref).abs().max() / ref.abs().max())
            finally:
                layer.fast_paths = paths
            row += f" {t:.2f} | {ms['bf16'] / t:.2f}x | {diff:.1e} |"
        print(row, flush=True)
        if args.profile:
            layers["fp8-backward"].fast_paths = dataclasses.replace(paths, fp8_weight_grad_kernel=args.wgrad_kernel)
            try:
                _print_profile(torch, run(layers["fp8-backward"]), name)
            finally:
                layers["fp8-backward"].fast_paths = paths
        if args.host_profile:
            _print_host_profile(torch, run(layers["fp8-backward"]), name)
        x = g = layers = w = None  # free them (not `del`: the timed closures use the names)
        torch.cuda.empty_cache()
    return 0


def _print_profile(torch, step, name: str, iterations: int = 3, top: int = 10) -> None:
    """The CUDA kernels of `iterations` calls of step(), as a markdown table, largest total first."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            step()
        torch.cuda.synchronize()
    rows = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"),
                  key=lambda e: e.device_time_total, reverse=True)
    print(f"\n{name}: CUDA kernels per fp8-backward call (us)\n\n| kernel | us per call | launches per call |")
    print("|---|---:|---:|")
    for e in rows[:top]:
        print(f"| {e.key[:90]} | {e.device_time_total / iterations:.0f} | {e.count / iterations:.0f} |")
    print(flush=True)


def _print_host_profile(torch, step, name: str, iterations: int = 20, top: int = 25) -> None:
    """cProfile of `iterations` calls of step() (GPU synchronized once at the end): host seconds per call and
    the functions with the most cumulative time."""
    import cProfile
    import io
    import pstats
    import time

    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(iterations):
        step()
    prof.disable()
    host = (time.perf_counter() - t0) / iterations
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    print(f"\n{name}: host {1e3 * host:.2f} ms per fp8-backward call (under cProfile)\n{out.getvalue()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
