"""`quarl bench gemm --sustained` and `quarl bench gemm --training`: runs of their own beside B1's table.

--sustained: B1 times each path for milliseconds of CUDA-graph replays after idle gaps, where the GPU runs near its
boost clock. A long prefill or a training step runs for seconds at the board's power cap instead, where the SM
clock depends on how much power each path draws. For each shape and M this holds bf16 F.linear and each format's
kernel plan (`kernels.plan_for(..., prefer_kernel=True)`, activation quantization included) busy: a CUDA graph of
~2 ms of calls replayed for 0.5 s of warm-up, then for `--seconds` timed by CUDA events, while nvidia-smi samples
the SM clock, board power and clock-event reasons every 50 ms. The table gives the median clock and power of the
samples in each timed window and the union of the reasons (0x4: software power cap), and the host (CPU) time of
one eager call (launches only: what an eager caller pays when the GPU work is shorter). One weight (the same bytes
every call: at these sizes the GEMMs are compute-bound). Every plan's output is checked against the float32
reference (relative error at most 2e-2; the run exits 1 otherwise).

--training: forward + backward (y = linear(x); y.backward(g), x [M, K] and g [M, N] bf16) of one linear layer in
the training modes of the unified flow, median of `--repeats` timed iterations after 3 untimed ones, operand
quantization included: bf16 (F.linear on the bf16 master weight: the bf16 / split flows), unified
(`precision.kernel_forward` true, the default from hidden size 2048: the forward on the 8-bit kernel,
straight-through bf16 gradient GEMMs), unified-bf16 (`precision.kernel_forward` false, the default below: bf16
GEMMs of fake-quantized fp8-block x and W) and fp8-backward
(`precision.quantized_backward`: `quarl.model.fp8_training`, all three GEMMs on FP8-block operands).
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import tempfile
import time

SMI_QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def parse_smi(path: str) -> list[tuple[float, float, float, str]]:
    """(epoch seconds, SM MHz, watts, reasons) per well-formed nvidia-smi sample line of the file at path (headers,
    partial lines and [N/A] fields are skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            try:
                ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((ts, float(parts[1].split()[0]), float(parts[2].split()[0]), parts[3]))
            except (ValueError, IndexError):
                continue
    return rows


def sustained_table(windows: list[tuple], samples: list[tuple]) -> str:
    """Markdown: one row per timed window (label "shape M=m | format | path", start and end in epoch seconds, us
    per call, TFLOP/s, host us per eager call), with the median SM clock and power of the samples inside the
    window, the reasons seen there, and the speed-up over the last bf16 window before it."""
    lines = ["| shape | format | path | us | vs bf16 | TFLOP/s | SM MHz | W | reasons | host us/call |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    base = float("nan")
    for label, t0, t1, us, tflops, host_us in windows:
        if "| bf16 |" in label:
            base = us
        sel = [r for r in samples if t0 <= r[0] <= t1]
        mhz = statistics.median(r[1] for r in sel) if sel else float("nan")
        watts = statistics.median(r[2] for r in sel) if sel else float("nan")
        reasons = " ".join(sorted({r[3] for r in sel})) or "-"
        lines.append(f"| {label} | {us:.1f} | {base / us:.2f}x | {tflops:.0f} | {mhz:.0f} | {watts:.0f} | {reasons} "
                     f"| {host_us:.0f} |")
    return "\n".join(lines)


def run_sustained(args, torch, shapes: list[str], ms: list[int], formats: list[str]) -> int:
    """--sustained on the CUDA GPU (see the module docstring); returns 1 where a plan's output is wrong."""
    import torch.nn.functional as F

    from quarl.bench.gemm import (ALL_SHAPES, TUNING_MAX_ERR, _plan_name, _reference, _rel_err, append_results,
                                  weight_only_for)
    from quarl.bench.rollout_breakdown import _graph_ms
    from quarl.formats import quantize
    from quarl.kernels import plan_for
    from quarl.kernels.dispatch import run_plan

    windows, wrong = [], []

    def hold(label, fn, flops):
        fn()
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        for _ in range(20):
            fn()
        host_us = (time.perf_counter() - h0) / 20 * 1e6
        torch.cuda.synchronize()
        est_ms = _graph_ms(torch, fn, reps=3)
        calls = max(1, min(200, int(2.0 / max(est_ms, 1e-4))))
        _graph_ms(torch, fn, max(1, int(500 / (est_ms * calls))), calls)  # warm-up: clocks and power settle
        t0 = time.time()
        us = _graph_ms(torch, fn, max(1, int(args.seconds * 1e3 / (est_ms * calls))), calls) * 1e3
        windows.append((label, t0, time.time(), us, flops / us / 1e6, host_us))

    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        smi_path = os.path.join(tmp, "smi.csv")
        with open(smi_path, "w") as log:
            try:
                smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader", "-lms",
                                        "50"], stdout=log)
            except FileNotFoundError:
                raise ValueError("--sustained samples the SM clock with nvidia-smi, which is not on PATH") from None
        try:
            for name in shapes:
                n, k = ALL_SHAPES[name]
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                for m in ms:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    tag, flops = f"{name} M={m}", 2 * m * n * k
                    hold(f"{tag} | bf16 | F.linear", lambda: F.linear(x, w), flops)
                    for fmt in (f for f in formats if f != "bf16"):
                        weight_only = weight_only_for(args, fmt)
                        plan = plan_for(fmt, weight_only, m, n, k, x.device, prefer_kernel=True)
                        if plan.kind == "bf16":
                            continue  # no kernel for this format (W4A4)
                        qw = quantize(w, fmt, "weight")
                        err = _rel_err(torch, run_plan(plan, x, qw, None), _reference(torch, x, qw, weight_only))
                        if not err <= TUNING_MAX_ERR:
                            wrong.append(f"{tag} {fmt} {plan}: relative error {err:.2e}")
                        hold(f"{tag} | {fmt} | {_plan_name(plan)}", lambda plan=plan, qw=qw: run_plan(plan, x, qw, None),
                             flops)
        finally:
            time.sleep(0.2)
            smi.terminate()
            smi.wait()
        samples = parse_smi(smi_path)
    table = sustained_table(windows, samples)
    print(table)
    for line in wrong:
        print(f"WRONG {line}")
    if not args.no_save:
        append_results(args, [f"each path held {args.seconds:g} s after 0.5 s of warm-up (CUDA-graph replays); "
                              "nvidia-smi samples every 50 ms; reason 0x4 = software power cap; host us/call: CPU "
                              "time of one eager call"] + [f"WRONG {line}" for line in wrong], table)
    return 1 if wrong else 0


def _median_ms(torch, fn, reps: int, device) -> float:
    """Median milliseconds of fn over reps calls after 3 untimed ones (CUDA events on a GPU, else wall clock)."""
    if torch.device(device).type == "cuda":
        from quarl.bench.gemm import median_time

        return 1e3 * median_time(torch, fn, reps)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def training_times(torch, n: int, k: int, m: int, repeats: int, device) -> dict[str, float]:
    """{"bf16", "unified", "unified-bf16", "fp8-backward"} -> median ms of forward + backward of one [n, k] linear on
    m tokens
    (bf16 x [m, k], output gradient [m, n]); runs on any device (a CPU takes the reference GEMMs)."""
    import torch.nn.functional as F

    from quarl.model.qlinear import QuantLinear

    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    runs = {}
    for mode, kernel_forward, quantized_backward in (("unified", True, False), ("unified-bf16", False, False),
                                                     ("fp8-backward", False, True)):
        layer = QuantLinear(k, n, device=device, dtype=torch.bfloat16)
        layer.configure(rollout_format="fp8-block", train_format="fp8-block", kernel_forward=kernel_forward,
                        quantized_backward=quantized_backward, bf16_gemms=mode == "unified-bf16")
        runs[mode] = layer
    w = runs["unified"].weight
    runs = {"bf16": lambda t: F.linear(t, w), **runs}

    def step(fn):
        def run():
            x.grad = None
            fn(x).backward(g)
        return run

    return {mode: _median_ms(torch, step(fn), repeats, device) for mode, fn in runs.items()}


def run_training(args, torch, shapes: list[str], ms: list[int], formats: list[str]) -> int:
    """--training on the CUDA GPU (see the module docstring); `formats` is unused (fp8-block is the only format with
    quantized training GEMMs)."""
    from quarl.bench.gemm import ALL_SHAPES, append_results

    torch.manual_seed(args.seed)
    lines = ["| shape (N x K) | M | bf16 (ms) | unified (ms) | unified-bf16 (ms) | fp8-backward (ms) | "
             "unified vs bf16 | fp8-backward vs bf16 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for name in shapes:
        n, k = ALL_SHAPES[name]
        for m in ms:
            t = training_times(torch, n, k, m, args.repeats, "cuda")
            lines.append(f"| {name} ({n} x {k}) | {m} | {t['bf16']:.2f} | {t['unified']:.2f} | "
                         f"{t['unified-bf16']:.2f} | {t['fp8-backward']:.2f} | {t['bf16'] / t['unified']:.2f}x | "
                         f"{t['bf16'] / t['fp8-backward']:.2f}x |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    table = "\n".join(lines)
    if not args.no_save:
        append_results(args, [f"forward + backward of one linear, median of {args.repeats} iterations after 3 "
                              "untimed ones; formats: fp8-block (unified: the forward on the 8-bit kernel; "
                              "unified-bf16: fake-quantized, bf16 GEMMs; fp8-backward: "
                              "precision.quantized_backward)"], table)
    return 0
