"""B1's prefill GEMMs under sustained load: each path runs back to back for seconds, while nvidia-smi samples the
SM clock, board power and clock-event reasons.

    PYTHONPATH=. python3 bench/gemm_sustained.py [--shapes qkv,o,gate_up,down] [--m 1024,4096] [--seconds 1.5]

Why: `quarl bench gemm` times each path for a few milliseconds of CUDA-graph replays, after idle gaps. An H200
then runs near its 1980 MHz boost clock, so bf16 reaches its peak. A prefill or a training step runs for seconds
at the board's power cap instead, where the SM clock depends on how much power each path draws. This script
measures that regime. For each shape and M it times:
  * bf16 F.linear;
  * each 8-bit format's kernel plan (`kernels.plan_for(..., prefer_kernel=True)`, run by `dispatch.run_plan`),
    activation quantization included as in B1;
  * torch._int_mm / torch._scaled_mm on codes made beforehand (cuBLAS, for reference).
Each path is captured into a CUDA graph of ~2 ms of calls (no host gaps, as in B1), replayed for 0.5 s of
warm-up, then for `--seconds` timed by CUDA events; the table gives the median SM clock and power of the samples
in that window and the union of the clock-event reasons (0x4: software power cap). It also gives the host
(CPU) time of one eager call, launches only: what an eager prefill pays when the GPU work is shorter. One
weight (the same bytes every call: at these sizes the GEMMs are compute-bound). Every path's output is
checked against the float32 reference (relative error below 2e-2; exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def _parse_smi(path: str) -> list[tuple[float, float, float, str]]:
    """(epoch seconds, SM MHz, watts, reasons) per nvidia-smi sample line."""
    rows = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            try:
                ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((ts, float(parts[1].split()[0]), float(parts[2].split()[0]), parts[3]))
            except (ValueError, IndexError):
                continue  # header or a partial line
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--m", default="1024,4096")
    ap.add_argument("--formats", default="int8,fp8,fp8-block")
    ap.add_argument("--seconds", type=float, default=1.5, help="timed seconds per path")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from quarl.bench.gemm import _rel_err, _reference
    from quarl.bench.rollout_breakdown import _graph_ms
    from quarl.formats import quantize
    from quarl.kernels import plan_for
    from quarl.kernels.act_quant import quantize_activation
    from quarl.kernels.dispatch import run_plan

    if not torch.cuda.is_available():
        raise SystemExit("bench/gemm_sustained.py needs a CUDA GPU")
    smi_path = os.path.join(tempfile.gettempdir(), "quarl_gemm_sustained_smi.csv")
    try:
        with open(smi_path, "w") as log:
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,"
                                    "clocks_event_reasons.active", "--format=csv,noheader", "-lms", "50"], stdout=log)
    except FileNotFoundError:
        raise SystemExit("bench/gemm_sustained.py samples clocks with nvidia-smi, which is not on PATH") from None
    windows = []
    failures = 0

    def run(label, fn, flops):
        # host cost of one eager call (launches queued, no sync): what an eager prefill pays on the CPU
        fn()
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        for _ in range(20):
            fn()
        host_us = (time.perf_counter() - h0) / 20 * 1e6
        torch.cuda.synchronize()
        # the timed calls replay a CUDA graph of ~2 ms of calls (no host gaps between calls, as in B1)
        est_ms = _graph_ms(torch, fn, reps=3)
        calls = max(1, min(200, int(2.0 / max(est_ms, 1e-4))))

        def reps(seconds: float) -> int:
            return max(1, int(seconds * 1e3 / (est_ms * calls)))

        _graph_ms(torch, fn, reps(0.5), calls)  # warm-up: clocks and power settle
        t0 = time.time()
        us = _graph_ms(torch, fn, reps(args.seconds), calls) * 1e3
        windows.append((label, t0, time.time(), us, flops / us / 1e6, host_us))

    try:
        print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for m in map(int, args.m.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                flops = 2 * m * n * k
                tag = f"{name} M={m}"
                run(f"{tag} | bf16 | F.linear", lambda: F.linear(x, w), flops)
                for fmt in args.formats.split(","):
                    qw = quantize(w, fmt, "weight")
                    plan = plan_for(fmt, False, m, n, k, x.device, prefer_kernel=True)
                    err = _rel_err(torch, run_plan(plan, x, qw, None), _reference(torch, x, qw, False))
                    if err > 2e-2:
                        print(f"WRONG {tag} {fmt} {plan}: rel err {err:.2e}")
                        failures += 1
                    pname = plan.kind + (f" {plan.cfg.name()}" if plan.cfg else "")
                    run(f"{tag} | {fmt} | {pname}", lambda: run_plan(plan, x, qw, None), flops)
                    if fmt == "int8":
                        codes, _ = quantize_activation(x, fmt, qw.data.shape[1])
                        wt = qw.data.t()
                        run(f"{tag} | int8 codes | torch._int_mm", lambda: torch._int_mm(codes, wt), flops)
                    elif fmt == "fp8":
                        codes, sx = quantize_activation(x, fmt, qw.data.shape[1])
                        sw = qw.scale.reshape(1, n)
                        run(f"{tag} | fp8 codes | torch._scaled_mm", lambda: torch._scaled_mm(
                            codes, qw.data.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16), flops)
    finally:
        time.sleep(0.2)
        smi.terminate()
        smi.wait()

    samples = _parse_smi(smi_path)
    print("\n| shape | format | path | us | vs bf16 | TFLOP/s | SM MHz | W | reasons | host us/call |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|---:|")
    base = None
    for label, t0, t1, us, tflops, host_us in windows:
        if "| bf16 |" in label:
            base = us
        sel = [r for r in samples if t0 <= r[0] <= t1]
        mhz = sorted(r[1] for r in sel)[len(sel) // 2] if sel else float("nan")
        watts = sorted(r[2] for r in sel)[len(sel) // 2] if sel else float("nan")
        reasons = " ".join(sorted({r[3] for r in sel})) or "-"
        print(f"| {label} | {us:.1f} | {base / us:.2f}x | {tflops:.0f} | {mhz:.0f} | {watts:.0f} | {reasons} "
              f"| {host_us:.0f} |")
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
