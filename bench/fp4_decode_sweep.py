"""Sweep of the NVFP4 W4A16 decode kernels (`quarl.kernels.fp4_decode`) against bf16 and the current dispatch.

    python3 bench/fp4_decode_sweep.py --json $OUT/fp4_decode.json

For the Qwen2.5-7B linear shapes (qkv, o, gate_up, down) and M in {1, 16, 64}, times:
  * bf16 F.linear (cuBLAS) on the dense bf16 weight;
  * the current w4a16 plan (`tuning.choose_plan(..., prefer_kernel=True)` run by `dispatch.run_plan`);
  * every candidate config of `fp4_decode` for that M (`CANDIDATES`).
Timing is `quarl.bench.gemm.time_graph`: calls captured into a CUDA graph cycling over enough weight copies to
exceed 3x the L2 cache, median replay per call. Kernels are compiled first in parallel worker processes
(Triton's on-disk cache then serves this process).

Correctness: every variant's output is compared with the float32 reference x.float() @ dequantize(W).T as
err = max over rows of max_n |y - ref| / max_n |ref|. The fp4_decode kernels multiply exact operands with fp32
accumulation, so only the final bf16 rounding remains: tolerance 2^-8 (bf16's unit roundoff) + 1e-5 (fp32
summation order). The dispatch baseline gets 2^-6 (its deq_mm path rounds the weight to bf16 first). A variant
above its tolerance is flagged WRONG and the script exits 1; compile/launch failures are reported and skipped.

Reports speed-up over bf16 and % of the bandwidth roofline (weight bytes, codes + scales, over the copy
bandwidth measured in the same run), the best correct config per (shape, M), and those winners as a Python
literal in the layout of `quarl.kernels.tuning.MEASURED["w4a16"]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
# The compile workers are fresh interpreters: let them import this checkout too.
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")

from quarl.kernels.tuning import Cfg, Plan  # noqa: E402  (Triton-free)

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
M_VALUES = (1, 16, 64)
TOL_NEW = 2.0**-8 + 1e-5
TOL_BASE = 2.0**-6

C = Cfg
# M -> fp4_decode configs. bm=1: CUDA-core FMA path (M <= 8); bm=16: tensor-core swap-AB path.
# split_k > 1 helps the small-N shapes (qkv, o, down) fill 132 SMs; it is a no-op cost-wise only where N is large.
CANDIDATES = {
    1: [C(1, 8, 512), C(1, 16, 512), C(1, 8, 1024), C(1, 4, 1024), C(1, 16, 256, warps=2),
        C(1, 8, 512, split_k=4), C(1, 16, 512, split_k=2), C(1, 32, 512, split_k=4, warps=8),
        C(16, 64, 128, split_k=7), C(16, 64, 128, split_k=7, stages=4), C(16, 64, 128, split_k=14, stages=4),
        C(16, 128, 128, split_k=4), C(16, 64, 128, stages=4),
        # wider FMA tiles: each K step's x split is shared by more weight rows
        C(1, 16, 1024), C(1, 32, 512, split_k=2), C(1, 32, 1024, split_k=2), C(1, 64, 512, split_k=4, warps=8),
        C(1, 32, 1024, split_k=4, warps=8),
        # two warps: more programs in flight per SM (the 1x16x256 two-warp tile leads on gate_up)
        C(1, 8, 256, warps=2), C(1, 8, 512, warps=2), C(1, 4, 512, warps=2), C(1, 16, 256, split_k=2, warps=2),
        C(1, 8, 1024, warps=2), C(1, 4, 1024, warps=2), C(1, 8, 512, split_k=2, warps=2), C(1, 32, 128, warps=2)],
    # bm=16 (wgmma, register weight operand): split_k so that the small-N shapes reach ~200-450 programs on 132
    # SMs (K = 3584 is 28 steps of 128: splits 4, 7, 14 are even; K = 18944 is 148 steps); deeper pipelines keep
    # more code bytes in flight per SM (one 64-row stage is ~8.5 KB with x).
    16: [C(16, 64, 128), C(16, 64, 128, stages=4), C(16, 64, 128, split_k=7), C(16, 64, 128, split_k=7, stages=4),
         C(16, 64, 128, native=True), C(16, 64, 128, stages=4, native=True), C(16, 64, 128, split_k=7, native=True),
         C(16, 64, 128, split_k=7, stages=4, native=True), C(16, 64, 128, split_k=8, native=True)],
    64: [C(16, 64, 128), C(16, 64, 128, split_k=4), C(16, 64, 128, split_k=7), C(16, 64, 128, native=True),
         C(16, 64, 128, split_k=2, native=True), C(16, 64, 128, split_k=4, native=True),
         C(16, 64, 128, split_k=7, native=True), C(16, 64, 128, split_k=8, native=True), C(16, 128, 128, native=True),
         C(16, 128, 128, split_k=2, native=True), C(16, 128, 128, split_k=4, native=True),
         C(16, 256, 128, warps=8, native=True), C(16, 128, 128, split_k=4, warps=8, native=True)],
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma list of M values (keys of CANDIDATES)")
    ap.add_argument("--repeats", type=int, default=7, help="graph replays per measurement (median taken)")
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1),
                    help="processes compiling the kernels before timing (0 = compile while timing)")
    ap.add_argument("--json", default=None, help="write every measurement and the winners to this JSON file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.m = [int(v) for v in args.m.split(",") if v.strip()]
    bad = [s for s in args.shapes if s not in SHAPES] + [m for m in args.m if m not in CANDIDATES]
    if bad:
        ap.error(f"unknown shapes / M values {bad}; shapes: {', '.join(SHAPES)}; M: {', '.join(map(str, CANDIDATES))}")
    return args


def baseline_plan(m: int, n: int, k: int) -> Plan:
    from quarl.kernels.tuning import choose_plan

    return choose_plan("nvfp4", True, m, n, k, prefer_kernel=True)


def cfg_literal(c: Cfg) -> str:
    """Cfg as source text with only the non-default fields, e.g. C(16, 128, 256, split_k=2)."""
    extra = [f"{f.name}={getattr(c, f.name)!r}" for f in dataclasses.fields(c)[3:] if getattr(c, f.name) != f.default]
    return f"C({', '.join([str(c.bm), str(c.bn), str(c.bk)] + extra)})"


def plan_label(p: Plan) -> str:
    if p.cfg is None:
        return p.kind
    return f"{p.kind} {p.cfg.name()}" + (f" {p.x_mode}" if p.kind == "gemv" else "")


def precompile(shapes, ms, seed: int, workers: int) -> float:
    """Compile every (plan, shape, M) in worker processes (quarl.bench.gemm's pool); returns seconds spent."""
    from quarl.bench.gemm import _precompile

    jobs: dict = {}
    for s in shapes:
        n, k = SHAPES[s]
        for m in ms:
            for p in [baseline_plan(m, n, k)] + [Plan("fp4_decode", c) for c in CANDIDATES[m]]:
                j = jobs.setdefault(p, {"fmt": "nvfp4", "plan": p, "weight_only": True, "seed": seed, "problems": []})
                j["problems"].append((n, k, m))
    t0 = time.time()
    job_list = list(jobs.values())
    failed = 0
    for j, res in zip(job_list, _precompile(job_list, workers)):
        failed += sum(isinstance(v, str) for v in res.values())
    print(f"compiled {len(job_list)} plans over {len(shapes)} shapes x {len(ms)} M in {time.time() - t0:.1f} s"
          + (f" ({failed} problem(s) failed there; reported below)" if failed else ""), flush=True)
    return time.time() - t0


def row_err(torch, y, ref) -> float:
    """max over rows of max_n |y - ref| / max_n |ref|."""
    d = (y.float() - ref).abs().amax(dim=1)
    return float((d / ref.abs().amax(dim=1).clamp_min(1e-30)).max())


def measure(torch, fn, x, cps, ref, tol, repeats):
    """-> (time s or nan, err or None, note). Never raises."""
    from quarl.bench.gemm import time_graph

    try:
        y = fn(x, cps[0])
        torch.cuda.synchronize()
        err = row_err(torch, y, ref)
    except Exception as e:  # compile error, launch error, shared memory, ...
        return float("nan"), None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if not err <= tol:
        return float("nan"), err, f"WRONG (err {err:.2e} > tol {tol:.1e})"
    try:
        return time_graph(torch, lambda i: fn(x, cps[i]), len(cps), repeats), err, ""
    except Exception as e:
        return float("nan"), err, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("this sweep needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference, not TF32
    from quarl.bench.gemm import _copies, _n_copies, measure_ceilings, time_graph
    from quarl.formats import quantize
    from quarl.kernels.dispatch import run_plan

    t_start = time.time()
    t_compile = precompile(args.shapes, args.m, args.seed, args.workers)
    bw, _ = measure_ceilings(torch)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)

    rows, wrong = [], []
    for s in args.shapes:
        n, k = SHAPES[s]
        g = torch.Generator(device="cuda").manual_seed(args.seed)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        qw = quantize(w, "nvfp4")
        w_ref = qw.dequantize(torch.float32)
        wq_bytes = qw.nbytes()
        cps = _copies(qw, _n_copies(wq_bytes))
        nb = _n_copies(w.numel() * 2)
        wbs = [w] + [w.clone() for _ in range(nb - 1)]
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = x.float() @ w_ref.T
            t_bf16 = time_graph(torch, lambda i: F.linear(x, wbs[i]), nb, args.repeats)
            t_roof = wq_bytes / bw
            base = baseline_plan(m, n, k)
            variants = [("bf16", "cuBLAS F.linear", None, None, None)]
            variants.append(("dispatch", plan_label(base), lambda xx, q, p=base: run_plan(p, xx, q, None), TOL_BASE,
                             None))
            for c in CANDIDATES[m]:
                p = Plan("fp4_decode", c)
                variants.append(("fp4_decode", plan_label(p), lambda xx, q, p=p: run_plan(p, xx, q, None), TOL_NEW,
                                 cfg_literal(c)))
            for kind, label, fn, tol, lit in variants:
                if fn is None:
                    t, err, note = t_bf16, 0.0, ""
                else:
                    t, err, note = measure(torch, fn, x, cps, ref, tol, args.repeats)
                if note.startswith("WRONG"):
                    wrong.append(f"{s} M={m} {label}: {note}")
                ok = t == t
                rows.append(dict(shape=s, n=n, k=k, m=m, kind=kind, variant=label, time_us=t * 1e6 if ok else None,
                                 speedup=t_bf16 / t if ok else None,
                                 roofline=t_roof / t if ok and kind != "bf16" else None,
                                 err=err, tol=tol, note=note, cfg=lit))
            print(f"  {s} M={m} done ({time.time() - t_start:.0f} s)", flush=True)
        cps = wbs = qw = w = w_ref = None  # free them (not `del`: the timed closures use the names)
        torch.cuda.empty_cache()

    best = best_per_problem(rows)
    print(format_table(rows, best))
    print()
    print(format_best(rows, best))
    print()
    literal = measured_literal(rows, best)
    print("# winners in the layout of quarl.kernels.tuning.MEASURED['w4a16'] (C = Cfg, P = Plan):")
    print(literal)
    total = time.time() - t_start
    print(f"\ntotal {total:.0f} s (compile {t_compile:.0f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(copy_bw=bw, tol_new=TOL_NEW, tol_base=TOL_BASE, rows=rows,
                           best={f"{s}/{m}": r for (s, m), r in best.items()}, measured_literal=literal,
                           wrong=wrong, seconds=total, compile_seconds=t_compile), fh, indent=1)
        print(f"wrote {args.json}")
    if wrong:
        print("WRONG RESULTS:\n  " + "\n  ".join(wrong), file=sys.stderr)
        return 1
    return 0


def best_per_problem(rows):
    """(shape, M) -> the fastest correct fp4_decode row."""
    best = {}
    for r in rows:
        if r["kind"] == "fp4_decode" and r["time_us"] is not None:
            key = (r["shape"], r["m"])
            if key not in best or r["time_us"] < best[key]["time_us"]:
                best[key] = r
    return best


def format_table(rows, best) -> str:
    lines = ["| shape (N x K) | M | variant | time (us) | vs bf16 | % BW roofline | max row rel. err | note |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        mark = " **best**" if best.get((r["shape"], r["m"])) is r else ""
        t = "n/a" if r["time_us"] is None else f"{r['time_us']:.1f}"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        rf = "-" if r["roofline"] is None else f"{100 * r['roofline']:.0f}%"
        err = "-" if r["err"] is None else f"{r['err']:.1e}"
        lines.append(f"| {r['shape']} ({r['n']} x {r['k']}) | {r['m']} | {r['variant']}{mark} | {t} | {sp} | {rf} | "
                     f"{err} | {r['note']} |")
    return "\n".join(lines)


def format_best(rows, best) -> str:
    out = ["best fp4_decode config per (shape, M): time, vs bf16, vs current dispatch, % BW roofline"]
    for (s, m), b in best.items():
        base = next(r for r in rows if r["shape"] == s and r["m"] == m and r["kind"] == "dispatch")
        vs = "-" if base["time_us"] is None else f"{base['time_us'] / b['time_us']:.2f}x"
        out.append(f"- {s} M={m}: {b['cfg']} {b['time_us']:.1f} us, {b['speedup']:.2f}x bf16, {vs} dispatch "
                   f"({base['variant']}), {100 * b['roofline']:.0f}% roofline")
    missing = {(r["shape"], r["m"]) for r in rows} - set(best)
    out += [f"- {s} M={m}: no correct fp4_decode config" for s, m in sorted(missing)]
    return "\n".join(out)


def measured_literal(rows, best) -> str:
    by_shape: dict = {}
    for (s, m), b in best.items():
        entry = f"{m}: (P(\"fp4_decode\", {b['cfg']}), {b['speedup']:.2f}),"
        by_shape.setdefault((b["n"], b["k"], s), []).append(entry)
    lines = ["{"]
    for (n, k, s), entries in by_shape.items():
        lines.append(f"    ({n}, {k}): {{  # {s}")
        lines += [f"        {e}" for e in entries]
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
