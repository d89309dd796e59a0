"""Forward + backward time of one linear layer in the three training modes of the unified flow (GPU).

    python3 bench/fp8_training_linear.py [--tokens 4096] [--repeats 10]

For the Qwen2.5-7B linear shapes (qkv, o, gate_up, down) with M tokens, times y = linear(x); y.backward(g):
  * bf16: F.linear on the bf16 master weight (the bf16 / split flows' training GEMMs);
  * unified: the straight-through unified forward (fake-quantized x and W, bf16 GEMMs, bf16 gradients);
  * fp8-backward: `quarl.model.fp8_training.FP8BlockLinear` (precision.quantized_backward=true).
Each variant runs `--warmup` untimed iterations (compilation), then `--repeats` timed ones; the median is
reported (CUDA events around forward + backward; quantization of every operand included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def time_ms(torch, step, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F

    from quarl.model.qlinear import QuantLinear

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="rows M of the activations")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; M = {args.tokens} tokens")
    print("| shape (N x K) | bf16 (ms) | unified (ms) | fp8-backward (ms) | fp8-backward vs bf16 |")
    print("|---|---:|---:|---:|---:|")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        layers = {}
        for mode, backward in (("unified", False), ("fp8-backward", True)):
            layer = QuantLinear(k, n, device="cuda", dtype=torch.bfloat16)
            layer.configure(rollout_format="fp8-block", train_format="fp8-block", quantized_backward=backward)
            layers[mode] = layer
        w = layers["unified"].weight

        def run(fn):
            def step():
                x.grad = None
                fn(x).backward(g)
            return step

        ms = {"bf16": time_ms(torch, run(lambda t: F.linear(t, w)), args.warmup, args.repeats)}
        for mode, layer in layers.items():
            ms[mode] = time_ms(torch, run(layer), args.warmup, args.repeats)
        print(f"| {name} ({n} x {k}) | {ms['bf16']:.2f} | {ms['unified']:.2f} | {ms['fp8-backward']:.2f} | "
              f"{ms['bf16'] / ms['fp8-backward']:.2f}x |", flush=True)
        del x, g, layers, w
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
