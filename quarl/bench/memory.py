"""B4 — the largest model whose qlora RL step runs on one GPU (`quarl bench memory`, BENCHMARKS.md).

For each Qwen2.5 size in `--sizes`, largest first, one full RL step of the real trainer runs in the qlora flow
(frozen nvfp4 base + LoRA adapters; 8 prompts x 8 samples, 256 random prompt tokens, 512 new tokens, EOS
ignored) through `quarl bench step`, in a fresh subprocess per size: an out-of-memory failure then leaves no
memory or half-built state behind for the next size. The model is built directly in its quantized form, one
linear at a time (`QuarlForCausalLM.materialize`), so a model whose bf16 weights exceed the GPU can be tried.

The first size whose step completes is the result; smaller sizes are not tried after it unless `--all`.
Reported per size: parameters, outcome (ok / out of memory / error), peak GPU memory during the step
(torch.cuda.max_memory_allocated after the model, adapters and KV cache exist), the step's wall time and phases
(the step includes CUDA-graph capture and kernel compilation: there is no warm-up step), and setup time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time

from quarl.bench import add_output_arguments, append_entry, bench_command, bench_main
from quarl.bench.rollout import MODEL_SIZES, parameter_count

DEFAULT_SIZES = "72b,32b,14b,7b"
DEFAULT_RESULTS = os.path.join("bench", "results", "memory.md")
TARGET_SIZE = "72b"
TARGETS = "the largest qlora model on one H200: 72B (QeRL's record: 32B on one 80 GB H100)"


def add_bench_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quarl bench memory`."""
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"comma list of Qwen2.5 sizes to try, largest first ({', '.join(MODEL_SIZES)}, tiny)")
    parser.add_argument("--format", default="nvfp4", help="number format of the frozen base")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (group size)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward/backward")
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="keep every layer's activations (faster, far more memory)")
    parser.add_argument("--all", action="store_true", help="try every size, not only down to the first that fits")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for all sizes together; each size's run is stopped when it runs out")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra run-config override passed to every run, repeatable")
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    add_output_arguments(parser, DEFAULT_RESULTS)


def parse_sizes(text: str) -> list[str]:
    """'7b,72b' -> ['72b', '7b']: known sizes, largest first (the search stops at the first size that fits)."""
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in MODEL_SIZES and s != "tiny"]
    if unknown or not sizes:
        raise ValueError(f"--sizes {text!r}: choose from {', '.join(MODEL_SIZES)}, tiny (comma-separated)")
    return sorted(dict.fromkeys(sizes), key=lambda s: parameter_count(s) if s != "tiny" else 0, reverse=True)


def step_command(args, size: str, json_path: str) -> list[str]:
    """The `quarl bench step` invocation (as a module, in this interpreter) that runs one qlora step of `size`."""
    overrides = [f"train.micro_batch_size={args.micro_batch_size}",
                 f"train.gradient_checkpointing={str(not args.no_gradient_checkpointing).lower()}",
                 *args.overrides]
    cmd = [sys.executable, "-m", "quarl.bench.step", "--model-size", size, "--settings", f"qlora:{args.format}",
           "--lora-rank", str(args.lora_rank), "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--prompt-len", str(args.prompt_len), "--max-new-tokens", str(args.max_new_tokens), "--warmup", "0",
           "--steps", "1", "--device", args.device, "--seed", str(args.seed), "--no-save", "--json", json_path]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def classify(returncode: int | None, rows: list[dict], output_tail: str) -> tuple[str, dict]:
    """(outcome, row) of one size's run: outcome is "ok", "out of memory", or "error: ..."."""
    row = rows[0] if rows else {}
    if "step_s" in row:
        return "ok", row
    text = (row.get("error") or "") + "\n" + output_tail
    if "OutOfMemoryError" in text or "out of memory" in text.lower():
        return "out of memory", row
    if returncode is None:
        return "error: stopped at the time budget", row
    last = (row.get("error") or "").removeprefix("error: ")
    last = last or (output_tail.strip().splitlines() or [f"exit code {returncode}"])[-1]
    return f"error: {last[:160]}", row


def _stream(pipe, lines: collections.deque) -> None:
    """Copy a child's output to ours line by line, keeping it in `lines`."""
    for line in pipe:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    pipe.close()


def run_size(args, size: str, timeout: float | None) -> dict:
    """Run one size in a subprocess (output streamed to ours); returns its result row."""
    with tempfile.TemporaryDirectory(prefix="quarl-bench-memory-") as scratch:
        json_path = os.path.join(scratch, "rows.json")
        cmd = step_command(args, size, json_path)
        print(f"\n[quarl bench memory] {size}: {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        lines: collections.deque[str] = collections.deque(maxlen=200)  # the output's tail, for the outcome
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the child's progress arrives as it is printed
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        reader = threading.Thread(target=_stream, args=(proc.stdout, lines), daemon=True)
        reader.start()
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # also a child that prints nothing is stopped at the budget
            returncode = None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader.join()
        tail = "".join(lines)[-4000:]
        rows = json.load(open(json_path)) if os.path.exists(json_path) else []
    outcome, row = classify(returncode, rows, tail)
    return dict(size=size, params=parameter_count(size) if size != "tiny" else None, outcome=outcome,
                wall_s=time.perf_counter() - t0, **{k: row.get(k) for k in (
                    "step_s", "peak_gib", "rollout_s", "prox_s", "update_s", "sync_s", "setup_s", "tokens")})


def bench_memory(args) -> tuple[list[dict], str, str]:
    """Try the sizes largest first; returns (rows, markdown table, summary)."""
    sizes = parse_sizes(args.sizes)
    for name in ("prompts", "samples", "prompt_len", "max_new_tokens", "micro_batch_size", "lora_rank"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    t_start = time.perf_counter()
    rows = []
    for size in sizes:
        left = None if args.time_budget is None else args.time_budget - (time.perf_counter() - t_start)
        if left is not None and left <= 0:
            rows.append(dict(size=size, params=None, outcome=f"skipped (time budget {args.time_budget:g} s)"))
            continue
        rows.append(run_size(args, size, left))
        print(format_row(rows[-1]), flush=True)
        if rows[-1]["outcome"] == "ok" and not args.all:
            break
    table = "\n".join([HEADER] + [format_row(r) for r in rows])
    return rows, table, summarize(rows)


HEADER = ("| size | parameters | outcome | peak mem (GiB) | step (s) | rollout (s) | prox (s) | update (s) | "
          "setup (s) |\n|---|---:|---|---:|---:|---:|---:|---:|---:|")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_row(r: dict) -> str:
    params = "-" if r.get("params") is None else f"{r['params'] / 1e9:.1f} B"
    return (f"| {r['size']} | {params} | {r['outcome']} | {_num(r.get('peak_gib'), '.1f')} | "
            f"{_num(r.get('step_s'), '.1f')} | {_num(r.get('rollout_s'), '.1f')} | {_num(r.get('prox_s'), '.1f')} | "
            f"{_num(r.get('update_s'), '.1f')} | {_num(r.get('setup_s'), '.1f')} |")


def summarize(rows: list[dict]) -> str:
    ok = [r for r in rows if r["outcome"] == "ok"]
    lines = [f"- target: {TARGETS}"]
    if not ok:
        return "\n".join(lines + ["- no size completed a step"])
    best = max(ok, key=lambda r: r["params"] or 0)
    met = best["size"] == TARGET_SIZE or (best["params"] or 0) >= parameter_count(TARGET_SIZE)
    lines.append(f"- largest model whose qlora step ran: {best['size']} ({format_row(best).split(' | ')[1]}), "
                 f"peak {_num(best.get('peak_gib'), '.1f')} GiB ({'MET' if met else 'missed'})")
    return "\n".join(lines)


def run_bench_memory(args) -> int:
    """Run B4 as configured by `add_bench_memory_arguments`: print the table and summary, append the entry."""
    import torch

    rows, table, summary = bench_memory(args)
    print("\n" + table + "\n\n" + summary, flush=True)
    if not args.no_save:
        total = (f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB"
                 if torch.cuda.is_available() else "no GPU")
        facts = [
            f"workload: qlora flow, {args.format} frozen base + LoRA rank {args.lora_rank} on every linear but "
            f"lm_head; {args.prompts} prompts x {args.samples} samples, {args.prompt_len} random prompt tokens, "
            f"{args.max_new_tokens} new tokens (EOS ignored); micro-batch {args.micro_batch_size}, gradient "
            f"checkpointing {'off' if args.no_gradient_checkpointing else 'on'}; GPU memory {total}",
            "one step per size in a fresh process, no warm-up (the step includes graph capture and compilation); "
            "peak = torch.cuda.max_memory_allocated during the step",
        ]
        if args.overrides:
            facts.append("overrides: " + " ".join(args.overrides))
        append_entry(args.out, "B4 — largest qlora model on one GPU (`quarl bench memory`)",
                     "Appended by `quarl bench memory`; newest last. One RL step of quarl.rl.trainer.Trainer in "
                     "the qlora flow per Qwen2.5 size (random weights), largest first.",
                     bench_command(args, "memory"), facts, table + "\n\n" + summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("memory", __doc__, add_bench_memory_arguments, run_bench_memory, argv)


if __name__ == "__main__":
    sys.exit(main())
