"""Does programmatic dependent launch hide the activation quantization of the decode W8A8 paths?

    PYTHONPATH=. python3 bench/pdl_probe.py [--shapes qkv,o,gate_up,down] [--m 1,16,64] [--formats int8,fp8]

At decode sizes a prequantized W8A8 product is two kernels: `act_quant` (2-4 us) and the GEMM / GEMV. With PDL
(`quarl.kernels.pdl`) the GEMM launches while the quantization runs, prefetches the first PREFETCH_COLS weight
columns of its rows into L2, and waits for the codes. For the Qwen2.5-7B linears and each M, this times the
dispatched plan and prequantized variants of the 8-bit decode plans:
  off      QUARL_PDL=0: plain launches (what every earlier entry measured);
  pf=N     PDL with N prefetched columns per weight row (0: PDL only, no prefetch);
  codes    the GEMM alone on codes made beforehand (the floor the two-kernel path can approach);
plus bf16 F.linear. Timing is `quarl.bench.gemm.time_graph` (CUDA-graph replays over weight copies larger than
L2). Every PDL variant's output must equal the plain launch's bit for bit (same kernel arithmetic; exit 1
otherwise), and the plain launch must be within 2e-2 relative error of the float32 reference (W8A8 rounding).
A separate check replays one captured graph and compares it with the eager result.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

from quarl.kernels.tuning import Cfg, Plan  # noqa: E402

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
C = Cfg
EXTRA = {  # prequantized decode plans tried besides the dispatched one
    1: [Plan("gemv", C(1, 8, 1024), "prequant"), Plan("gemv", C(1, 16, 512), "prequant")],
    16: [Plan("w8a8", C(16, 64, 256, split_k=4, stages=4, native=True, swap_ab=True), "prequant")],
    64: [Plan("w8a8", C(64, 64, 256, split_k=4, native=True, swap_ab=True), "prequant"),
         Plan("w8a8", C(64, 64, 256, split_k=2, native=True), "prequant")],
}
PREFETCH = (0, 1024, 4096)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--m", default="1,16,64")
    ap.add_argument("--formats", default="int8,fp8")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from quarl.bench.gemm import _copies, _n_copies, _reference, _rel_err, _weight_bytes, time_graph
    from quarl.formats import quantize
    from quarl.kernels import pdl
    from quarl.kernels.act_quant import quantize_activation
    from quarl.kernels.dispatch import codes_matmul, run_plan
    from quarl.kernels.tuning import choose_plan

    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; PDL available: "
          f"{pdl.pdl_enabled(torch.device('cuda'))}")
    failures = 0
    rows = []

    def set_mode(pf):
        os.environ["QUARL_PDL"] = "0" if pf is None else "1"
        pdl.PREFETCH_COLS = 0 if pf is None else pf

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            copies_bf16 = [w] + [w.clone() for _ in range(_n_copies(w.numel() * 2) - 1)]
            t_bf16 = time_graph(torch, lambda i: F.linear(x, copies_bf16[i]), len(copies_bf16), args.repeats)
            rows.append((name, m, "bf16", "F.linear", "-", t_bf16, 1.0))
            for fmt in args.formats.split(","):
                qw = quantize(w, fmt, "weight")
                ref = _reference(torch, x, qw, False)
                qws = _copies(qw, _n_copies(_weight_bytes(torch, qw)))
                disp = choose_plan(fmt, False, m, n, k, prefer_kernel=True)
                plans = [disp] + [p for p in EXTRA.get(m, []) if p != disp]
                if disp.kind in ("w8a8", "gemv") and disp.x_mode == "fused":
                    plans.insert(1, replace(disp, x_mode="prequant"))
                for plan in plans:
                    label = f"{plan.kind} {plan.cfg.name() if plan.cfg else ''} {plan.x_mode}"
                    set_mode(None)
                    try:
                        base = run_plan(plan, x, qw, None)
                    except Exception as e:  # a plan that does not apply to this format
                        print(f"skip {name} M={m} {fmt} {label}: {type(e).__name__}: {e}")
                        continue
                    err = _rel_err(torch, base, ref)
                    if err > 2e-2:
                        print(f"WRONG {name} M={m} {fmt} {label}: rel err {err:.2e}")
                        failures += 1
                    modes = [None] + (list(PREFETCH) if plan.kind in ("w8a8", "gemv") else [])
                    for pf in modes:
                        set_mode(pf)
                        y = run_plan(plan, x, qw, None)
                        if not torch.equal(y, base):
                            print(f"MISMATCH {name} M={m} {fmt} {label} pf={pf}")
                            failures += 1
                        t = time_graph(torch, lambda i: run_plan(plan, x, qws[i], None), len(qws), args.repeats)
                        rows.append((name, m, fmt, label, "off" if pf is None else f"pf={pf}", t, t_bf16 / t))
                    if plan.x_mode == "prequant":
                        set_mode(None)
                        codes, sx = quantize_activation(x, fmt, qw.data.shape[1])
                        t = time_graph(torch, lambda i: codes_matmul(plan, codes, sx, qws[i], None, x.dtype),
                                       len(qws), args.repeats)
                        rows.append((name, m, fmt, label, "codes", t, t_bf16 / t))

    # one captured graph with PDL launches, replayed, against the eager result
    set_mode(1024)
    n, k = SHAPES["down"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    for fmt, m, plan in (("int8", 16, EXTRA[16][0]), ("fp8", 1, EXTRA[1][0]), ("fp8", 64, EXTRA[64][0])):
        qw = quantize(w, fmt, "weight")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        eager = run_plan(plan, x, qw, None)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            run_plan(plan, x, qw, None)
            with torch.cuda.graph(graph, stream=stream):
                out = run_plan(plan, x, qw, None)
        torch.cuda.current_stream().wait_stream(stream)
        x.copy_(torch.randn_like(x))  # new input: the replay must see it
        graph.replay()
        torch.cuda.synchronize()
        ok = torch.equal(out, run_plan(plan, x, qw, None)) and not torch.equal(out, eager)
        print(f"graph replay {fmt} M={m} {plan.kind}: {'ok' if ok else 'FAILED'}")
        failures += not ok
    set_mode(None)

    print("\n| shape | M | format | plan | launch | us | vs bf16 |\n|---|---:|---|---|---|---:|---:|")
    for name, m, fmt, label, mode, t, sp in rows:
        print(f"| {name} | {m} | {fmt} | {label} | {mode} | {t * 1e6:.1f} | {sp:.2f}x |")
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
