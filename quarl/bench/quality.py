"""B6 — learning quality on a real model (`quarl bench quality`, docs/BENCHMARKS.md).

Does a low-precision run train as well as bf16, and finish sooner? Every setting in `SETTINGS` (precision flow,
format, correction, LoRA) trains the real SmolLM2-135M-Instruct with GRPO on a synthetic arithmetic task for each
seed, all runs side by side as separate `quarl train` processes (one GPU is shared; OMP_NUM_THREADS=1 each). The
task (`TASK`): + and -, operands 0-50, 2000 training and 256 held-out problems, 16 prompts x 8 answers per step,
16 new tokens, temperature 0.7, GRPO + TIS (C = 2) unless the setting says otherwise.

Reported per setting (mean and spread over seeds): held-out greedy accuracy before, at every eval and after, in
the rollout precision (`eval/accuracy`) and for the trained policy with quantization off (`eval_full/accuracy`);
the first eval step (and the summed step time up to it) at which the setting's mean accuracy reaches the bf16
full fine-tuning run's final mean accuracy; mean `mismatch/kl`; median step time split into sync / rollout /
prox / update; and the B6 targets checked against those numbers.

`--summarize RUNS_DIR` rebuilds the report from the run folders alone (e.g. runs copied back from a GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from quarl.bench import add_output_arguments, append_entry, bench_command, bench_main

DEFAULT_RESULTS = os.path.join("bench", "results", "quality.md")

# The task and GRPO settings every run shares (docs/BENCHMARKS.md, B6).
TASK = [
    "model.name=smollm2-135m-instruct", "data.train=arithmetic", "data.ops=[+,-]", "data.min_operand=0",
    "data.max_operand=50", "data.num_train=2000", "data.num_eval=256", "data.eval_limit=256",
    "data.prompt_template=What is {prompt}? Answer with just the number.",
    "rollout.prompts_per_step=16", "rollout.num_generations=8", "rollout.max_new_tokens=16",
    "rollout.temperature=0.7", "rollout.stop=[\"\\n\"]", "loss.loss_type=grpo", "loss.correction=tis",
    "loss.is_cap=2.0", "train.warmup_steps=2", "train.micro_batch_size=32", "eval.temperature=0.0",
    "output.tensorboard=false", "output.progress=false", "output.samples_per_step=1",
]
FULL_LR, LORA_LR = "train.lr=1e-5", "train.lr=5e-5"
# adapters from B = 0 (the settings of the base-error start, qlora's default, name it)
LORA = ["lora.rank=32", LORA_LR, "lora.init=zeros"]

# INT8 W8A8 split-flow rollouts without SmoothQuant (the settings measured before it became the int8 default; the
# default recipe is `split-int8-smooth-tis`)
SPLIT_INT8 = ["precision.flow=split", "precision.format=int8", "precision.smooth_alpha=0"]

# name -> overrides on top of TASK. The first is the reference the others are measured against.
SETTINGS: dict[str, list[str]] = {
    "bf16": ["precision.flow=bf16", FULL_LR],
    "bf16-lora": ["precision.flow=bf16", *LORA],
    "split-int8-tis": [*SPLIT_INT8, FULL_LR],
    "split-int8-naive": [*SPLIT_INT8, "loss.correction=naive", FULL_LR],
    "split-fp8-tis": ["precision.flow=split", "precision.format=fp8", FULL_LR],
    "split-fp8-block-tis": ["precision.flow=split", "precision.format=fp8-block", FULL_LR],
    # W8A8: at SmolLM2-135M's hidden size (576) rollout and training multiply the fake-quantized weights and
    # activations with bf16 GEMMs (`precision.kernel_forward` null; the unified default there is weight-only, the
    # "-w8a16" settings below, so these pin W8A8); the "-kernels" setting takes the 8-bit kernels, which multiply
    # the codes exactly but cost launches at this size
    "unified-fp8-block": ["precision.flow=unified", "precision.format=fp8-block", "precision.weight_only=false",
                          FULL_LR],
    "unified-fp8-block-kernels": ["precision.flow=unified", "precision.format=fp8-block",
                                  "precision.kernel_forward=true", FULL_LR],
    "unified-int8": ["precision.flow=unified", "precision.format=int8", "precision.weight_only=false", FULL_LR],
    # rollout and training on the batch-invariant kernels: the same bits in both forwards (mismatch/kl 0)
    "unified-fp8-block-invariant": ["precision.flow=unified", "precision.format=fp8-block",
                                    "precision.weight_only=false", "precision.batch_invariant=true", FULL_LR],
    "bf16-invariant": ["precision.flow=bf16", "precision.batch_invariant=true", FULL_LR],
    # weight-only rollouts: on small models the per-token activation quantizer makes most of the mismatch
    # (bench/results/mismatch.md); without it the unified flow's two forwards differ only in rounding order (the
    # unified default below hidden size 2048)
    "split-int8-w8a16-tis": [*SPLIT_INT8, "precision.weight_only=true", FULL_LR],
    "split-int8-smooth-tis": ["precision.flow=split", "precision.format=int8", "precision.smooth_alpha=0.5",
                              FULL_LR],
    "unified-int8-w8a16": ["precision.flow=unified", "precision.format=int8", "precision.weight_only=true", FULL_LR],
    "unified-fp8-block-w8a16": ["precision.flow=unified", "precision.format=fp8-block", "precision.weight_only=true",
                                FULL_LR],
    "qlora-nvfp4": ["precision.flow=qlora", "precision.format=nvfp4", *LORA],
    # the frozen base rounded to nearest: the baseline GPTQ's base is measured against
    "qlora-nvfp4-rtn": ["precision.flow=qlora", "precision.format=nvfp4", "precision.base_quantizer=rtn", *LORA],
    "qlora-nvfp4-aqn": ["precision.flow=qlora", "precision.format=nvfp4", *LORA, "aqn.sigma_start=1e-2",
                        "aqn.sigma_end=5e-4"],
    # the adapters start as the rank-32 correction of the GPTQ base's error (lora.init=base_error)
    "qlora-nvfp4-base-error": ["precision.flow=qlora", "precision.format=nvfp4", "lora.rank=32", LORA_LR,
                               "lora.init=base_error"],
    "qlora-nvfp4-base-error-lr1e-4": ["precision.flow=qlora", "precision.format=nvfp4", "lora.rank=32",
                                      "train.lr=1e-4", "lora.init=base_error"],
    # an 8-bit frozen base: how much of qlora NVFP4's gap to bf16 LoRA the 4-bit base makes
    "qlora-int8": ["precision.flow=qlora", "precision.format=int8", *LORA],
    # the LoRA flows at twice the learning rate: whether the 4-bit base needs larger steps than bf16 LoRA does
    "bf16-lora-lr1e-4": ["precision.flow=bf16", "lora.rank=32", "train.lr=1e-4"],
    "qlora-nvfp4-lr1e-4": ["precision.flow=qlora", "precision.format=nvfp4", "lora.rank=32", "train.lr=1e-4",
                           "lora.init=zeros"],
    # the corrections beyond TIS (docs/CORRECTIONS.md) on the split flow's default format. GSPO's sequence ratio
    # pi_theta/pi_old and TBPO's dual clip act only from a batch's second optimizer step: 4 mini-batches per batch.
    "split-int8-icepop": [*SPLIT_INT8, "loss.correction=icepop", FULL_LR],
    "split-int8-geo-mask": [*SPLIT_INT8, "loss.correction=geo_mask", "loss.geo_high=1.02", FULL_LR],
    "split-int8-seq-mask-tis": [*SPLIT_INT8, "loss.correction=seq_mask_tis", "loss.geo_high=1.02", FULL_LR],
    "split-int8-ais": [*SPLIT_INT8, "loss.correction=ais", FULL_LR],
    "split-int8-tbpo": [*SPLIT_INT8, "loss.correction=tbpo", "train.mini_batch_size=32", FULL_LR],
    "split-int8-gspo-tis": [*SPLIT_INT8, "loss.importance_sampling_level=sequence",
                            "train.mini_batch_size=32", FULL_LR],
    # the error-answer guard (docs/CORRECTIONS.md): answers flagged as garbled repetitions are masked out of the loss
    "split-int8-tis-guard": [*SPLIT_INT8, "loss.error_token_guard=mask", FULL_LR],
    # PPO with a critic (docs/CORRECTIONS.md): GAE advantages from a separate full-precision critic
    "split-int8-ppo-gae": [*SPLIT_INT8, "loss.advantage_estimator=gae", "train.mini_batch_size=32", FULL_LR],
    "split-nvfp4-tis": ["precision.flow=split", "precision.format=nvfp4", FULL_LR],
    "split-mxfp4-tis": ["precision.flow=split", "precision.format=mxfp4", FULL_LR],
}
REFERENCE, LORA_REFERENCE = "bf16", "bf16-lora"
# Targets (docs/BENCHMARKS.md): (setting, reference, allowed points below the reference at equal steps)
# the unified settings whose mismatch/kl is held to bf16's
UNIFIED = ("unified-fp8-block", "unified-fp8-block-w8a16", "unified-int8-w8a16", "unified-fp8-block-invariant")
WITHIN = [(s, REFERENCE, 0.02) for s in ("split-int8-smooth-tis", "split-int8-tis", "split-fp8-tis",
                                         "split-fp8-block-tis", "unified-fp8-block", "unified-fp8-block-w8a16",
                                         "unified-int8-w8a16")] + \
    [("qlora-nvfp4", LORA_REFERENCE, 0.03), ("qlora-nvfp4-lr1e-4", "bf16-lora-lr1e-4", 0.03),
     ("qlora-nvfp4-base-error", LORA_REFERENCE, 0.03), ("qlora-nvfp4-base-error-lr1e-4", "bf16-lora-lr1e-4", 0.03)]
NAIVE_PAIRS = [("split-int8-naive", "split-int8-tis")]


def add_bench_quality_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quarl bench quality`."""
    parser.add_argument("--settings", default="all", help=f"comma list of settings, or all ({', '.join(SETTINGS)})")
    parser.add_argument("--seeds", default="0,1,2", help="comma list of training seeds")
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps per run")
    parser.add_argument("--eval-every", type=int, default=25, help="held-out eval every N steps")
    parser.add_argument("--runs-dir", default=os.path.join("runs", "quality"), help="folder of the run folders")
    parser.add_argument("--parallel", type=int, default=0, help="runs at once (0 = all)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: runs still going then are interrupted (they save and stop; the report "
                             "shows the steps they reached)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra run-config override for every run, repeatable (e.g. model.device=cpu)")
    parser.add_argument("--summarize", default=None, metavar="RUNS_DIR",
                        help="only summarize the run folders already in RUNS_DIR (no training)")
    add_output_arguments(parser, DEFAULT_RESULTS)


def parse_settings(text: str) -> list[str]:
    names = list(SETTINGS) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown B6 setting(s) {unknown}; choose from {', '.join(SETTINGS)} or all")
    return names


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds={text!r} must be a comma list of integers, e.g. 0,1,2") from None
    if not seeds:
        raise ValueError("--seeds is empty")
    return seeds


def run_overrides(setting: str, seed: int, args) -> list[str]:
    """The `quarl train` overrides of one run."""
    return [*TASK, *SETTINGS[setting], f"train.seed={seed}", f"train.steps={args.steps}",
            f"eval.every={args.eval_every}", f"output.checkpoint_every={args.steps}",
            f"output.dir={os.path.join(args.runs_dir, f'{setting}-s{seed}')}", *args.overrides]


# ----------------------------------------------------------------------------------------------------- running
def launch_all(jobs: list[tuple[str, int]], args) -> None:
    """Run every (setting, seed) as a `quarl train` process, at most args.parallel at once, printing progress."""
    os.makedirs(args.runs_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    pending, running = list(jobs), {}
    limit = args.parallel or len(jobs)
    start = time.time()
    interrupted = False
    last_report = 0.0
    while pending or running:
        while pending and len(running) < limit and not interrupted:
            setting, seed = pending.pop(0)
            _failed_marker(args.runs_dir, setting, seed).unlink(missing_ok=True)
            log = open(os.path.join(args.runs_dir, f"{setting}-s{seed}.log"), "w")
            running[(setting, seed)] = (subprocess.Popen(train_command(setting, seed, args), stdout=log,
                                                         stderr=subprocess.STDOUT, env=env), log)
        for key, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[key]
                if proc.returncode != 0 and not interrupted and running and _out_of_memory(args.runs_dir, *key):
                    # Too many runs for the GPU's memory: run this one again from its start once fewer are
                    # running (the trainer moves the partial run aside), and never start more at once than were
                    # running when it failed. (A run out of memory with the GPU to itself fails below.)
                    limit = max(1, len(running))
                    pending.append(key)
                    done = _steps_done(Path(args.runs_dir) / f"{key[0]}-s{key[1]}")
                    print(f"[quality] {key[0]} seed {key[1]}: out of GPU memory after {done} steps; queued again "
                          f"from step 0 (at most {limit} runs at once from now on)", flush=True)
                    continue
                # the budget's SIGINT stops a run with 130 (the trainer saves first) or -SIGINT (killed by it)
                stopped = interrupted and proc.returncode in (130, -signal.SIGINT)
                if proc.returncode != 0 and not stopped:
                    _failed_marker(args.runs_dir, *key).write_text(f"exit {proc.returncode}\n")
                if proc.returncode == 0:
                    status = "done"
                elif stopped:
                    done = _steps_done(Path(args.runs_dir) / f"{key[0]}-s{key[1]}")
                    status = f"stopped by the time budget at step {done}"
                else:
                    status = f"FAILED (exit {proc.returncode}; see its .log)"
                print(f"[quality] {key[0]} seed {key[1]}: {status} after {time.time() - start:.0f} s", flush=True)
        if args.time_budget is not None and not interrupted and time.time() - start > args.time_budget:
            interrupted = True
            for key in pending:  # one with a log was queued again after running out of memory: a dead attempt
                if (Path(args.runs_dir) / f"{key[0]}-s{key[1]}.log").is_file():
                    _failed_marker(args.runs_dir, *key).write_text("out of GPU memory; not run again before the "
                                                                   "time budget ran out\n")
            pending.clear()
            print(f"[quality] time budget {args.time_budget:.0f} s spent: interrupting {len(running)} runs "
                  "(each saves after its current step)", flush=True)
            for proc, _ in running.values():
                proc.send_signal(signal.SIGINT)
        if time.time() - last_report > 60 and running:
            last_report = time.time()
            steps = {f"{s}-s{d}": _steps_done(Path(args.runs_dir) / f"{s}-s{d}") for s, d in running}
            print(f"[quality] {time.time() - start:.0f} s: steps done " +
                  ", ".join(f"{k} {v}" for k, v in sorted(steps.items())), flush=True)
        time.sleep(1.0)


def train_command(setting: str, seed: int, args) -> list[str]:
    """The `quarl train` command line of one run."""
    return [sys.executable, "-m", "quarl", "train", *run_overrides(setting, seed, args)]


def _out_of_memory(runs_dir: str, setting: str, seed: int) -> bool:
    """Whether the run died of CUDA out-of-memory (its log names torch.OutOfMemoryError)."""
    log = Path(runs_dir) / f"{setting}-s{seed}.log"
    return log.is_file() and "OutOfMemoryError" in log.read_text(errors="replace")


def _failed_marker(runs_dir: str, setting: str, seed: int) -> Path:
    """The file that marks a run which stopped with an error (not done, not interrupted by the time budget): its
    folder holds a partial curve that the summary leaves out."""
    return Path(runs_dir) / f"{setting}-s{seed}.failed"


def _steps_done(run_dir: Path) -> int:
    records = read_records(run_dir)
    return max((r["step"] for r in records if "time/step_s" in r), default=0)


# ----------------------------------------------------------------------------------------------------- summary
def read_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return out


def run_summary(records: list[dict]) -> dict:
    """One run's numbers: evals {step: (rollout-precision acc, full-precision acc)}, steps, mismatch, times."""
    evals: dict[int, list] = {}
    steps = [r for r in records if "time/step_s" in r]
    for r in records:
        if "eval/accuracy" in r:
            evals[r["step"]] = [r["eval/accuracy"], r.get("eval_full/accuracy")]
    cumulative, total = {}, 0.0
    for r in steps:
        total += r["time/step_s"]
        cumulative[r["step"]] = total

    def median(key):
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else float("nan")

    kl = [r["mismatch/kl"] for r in steps if "mismatch/kl" in r]
    return {
        "evals": evals, "steps": max((r["step"] for r in steps), default=0), "cumulative_s": cumulative,
        "kl": sum(kl) / len(kl) if kl else float("nan"),
        "times": {k: median(f"time/{k}") for k in ("step_s", "sync_s", "rollout_s", "prox_s", "train_s")},
    }


def _mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _fmt(mean: float, sd: float) -> str:
    return "-" if mean != mean else f"{mean:.3f} ± {sd:.3f}"


def setting_summary(runs: list[dict]) -> dict:
    """Mean and spread over seeds: accuracy at each eval step present in every run, final accuracies, times."""
    common = sorted(set.intersection(*(set(r["evals"]) for r in runs))) if runs else []
    curve = {s: _mean_sd([r["evals"][s][0] for r in runs]) for s in common}
    full_curve = {s: _mean_sd([r["evals"][s][1] for r in runs]) for s in common}
    times = {k: statistics.fmean([r["times"][k] for r in runs]) for k in runs[0]["times"]} if runs else {}
    return {
        "curve": curve, "full_curve": full_curve, "steps": min((r["steps"] for r in runs), default=0),
        "kl": _mean_sd([r["kl"] for r in runs if r["kl"] == r["kl"]]), "times": times, "runs": runs,
        "final": curve[common[-1]] if common else (float("nan"), float("nan")),
        "final_full": full_curve[common[-1]] if common else (float("nan"), float("nan")),
    }


def reach(summary: dict, target: float) -> tuple[int | None, float | None]:
    """First eval step whose mean accuracy is >= target, and the mean summed step time to it (evals excluded)."""
    for step, (mean, _) in summary["curve"].items():
        if step > 0 and mean >= target - 1e-9:
            times = [r["cumulative_s"].get(step) for r in summary["runs"]]
            times = [t for t in times if t is not None]
            return step, (statistics.fmean(times) if times else None)
    return None, None


def summarize(runs_dir: str, settings: list[str] | None = None) -> tuple[str, list[str]]:
    """The markdown report (tables) and the target verdict lines for the run folders in runs_dir."""
    root = Path(runs_dir)
    found: dict[str, list[dict]] = {}
    failed: list[str] = []
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and (p / "metrics.jsonl").is_file()):
        name, _, seed = run_dir.name.rpartition("-s")
        if name in SETTINGS and seed.isdigit() and (settings is None or name in settings):
            if _failed_marker(runs_dir, name, int(seed)).is_file():
                failed.append(f"{name} seed {seed}")
                continue
            records = read_records(run_dir)
            if records:
                found.setdefault(name, []).append(run_summary(records))
    if not found:
        raise ValueError(f"no B6 run folders (SETTING-sSEED with metrics.jsonl) in {runs_dir}")
    summaries = {name: setting_summary(found[name]) for name in SETTINGS if name in found}
    steps = sorted(set().union(*(s["curve"] for s in summaries.values())))
    lines = ["| setting | seeds | steps | " + " | ".join(f"acc @{s}" for s in steps) +
             " | full-precision acc before -> after | mean mismatch/kl |",
             "|---|---:|---:|" + "---:|" * len(steps) + "---|---:|"]
    for name, s in summaries.items():
        cells = [_fmt(*s["curve"][st]) if st in s["curve"] else "-" for st in steps]
        full = s["full_curve"]
        full_text = "-" if not full or full[min(full)][0] != full[min(full)][0] else \
            f"{full[min(full)][0]:.3f} -> {s['final_full'][0]:.3f}"
        kl = s["kl"]
        lines.append(f"| {name} | {len(s['runs'])} | {s['steps']} | " + " | ".join(cells) +
                     f" | {full_text} | {'-' if kl[0] != kl[0] else f'{kl[0]:.4f}'} |")
    if failed:
        lines += ["", f"Left out (stopped with an error; see each one's .log): {', '.join(failed)}"]
    ref = summaries.get(REFERENCE)
    target = ref["final"][0] if ref else None
    lines += ["", f"Time to the bf16 run's final accuracy ({'-' if target is None else f'{target:.3f}'}) and median "
              "step time (seconds; evals excluded):", "",
              "| setting | reaches it at step | summed step time to it | step | sync | rollout | prox | update | "
              "sync share | step vs bf16 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref_step = ref["times"]["step_s"] if ref else None
    for name, s in summaries.items():
        at, secs = reach(s, target) if target is not None else (None, None)
        t = s["times"]
        share = t["sync_s"] / t["step_s"] if t.get("step_s") else float("nan")
        ratio = f"{t['step_s'] / ref_step:.2f}x" if ref_step else "-"
        lines.append(f"| {name} | {at if at is not None else 'not reached'} | "
                     f"{'-' if secs is None else f'{secs:.0f}'} | {t['step_s']:.2f} | {t['sync_s']:.3f} | "
                     f"{t['rollout_s']:.2f} | {t['prox_s']:.2f} | {t['train_s']:.2f} | {share:.1%} | {ratio} |")
    return "\n".join(lines), verdicts(summaries)


def _at_equal_steps(a: dict, b: dict) -> tuple[int, float, float] | None:
    """(step, mean accuracy of a, of b) at the last eval step both settings reached (runs interrupted by a time
    budget may stop at different steps)."""
    common = sorted(set(a["curve"]) & set(b["curve"]))
    if not common:
        return None
    step = common[-1]
    return step, a["curve"][step][0], b["curve"][step][0]


def verdicts(summaries: dict) -> list[str]:
    """The B6 targets, each as 'met' / 'missed' with the numbers (mean accuracies at the last common eval step)."""
    out = []
    for name, ref_name, points in WITHIN:
        if name in summaries and ref_name in summaries and (pair := _at_equal_steps(summaries[name],
                                                                                     summaries[ref_name])):
            step, a, r = pair
            out.append(f"{name} within {points * 100:.0f} points of {ref_name} at step {step}: {a:.3f} vs {r:.3f} "
                       f"-> {'met' if a >= r - points else 'missed'}")
    for naive, corrected in NAIVE_PAIRS:
        if naive in summaries and corrected in summaries and (pair := _at_equal_steps(summaries[naive],
                                                                                       summaries[corrected])):
            step, a, c = pair
            out.append(f"{naive} below {corrected} at step {step}: {a:.3f} vs {c:.3f} -> "
                       f"{'met' if a < c else 'missed'}")
    heavy = [f"{n} {s['times']['sync_s'] / s['times']['step_s']:.1%}" for n, s in summaries.items()
             if s["times"].get("step_s") and s["times"]["sync_s"] > 0.01 * s["times"]["step_s"]]
    out.append("sync <= 1 % of every step: " + ("met" if not heavy else "missed (" + ", ".join(heavy) + ")"))
    for name in UNIFIED:
        if name in summaries and REFERENCE in summaries:
            u, b = summaries[name]["kl"][0], summaries[REFERENCE]["kl"][0]
            out.append(f"{name} mismatch/kl no higher than bf16's: {u:.4f} vs {b:.4f} -> "
                       f"{'met' if u <= b else 'missed'}")
    if REFERENCE in summaries:
        ref = summaries[REFERENCE]["times"]["step_s"]
        slow = [f"{n} {s['times']['step_s'] / ref:.2f}x" for n, s in summaries.items()
                if s["times"]["step_s"] > 1.1 * ref]
        out.append("every median step <= 1.1x bf16's: " + ("met" if not slow else "missed (" + ", ".join(slow) + ")"))
    return out


def run_bench_quality(args) -> int:
    settings = parse_settings(args.settings)
    if args.summarize is None:
        seeds = parse_seeds(args.seeds)
        jobs = [(s, seed) for s in settings for seed in seeds]
        print(f"[quality] {len(jobs)} runs ({len(settings)} settings x {len(seeds)} seeds), {args.steps} steps each, "
              f"into {args.runs_dir}", flush=True)
        launch_all(jobs, args)
    runs_dir = args.summarize or args.runs_dir
    table, verdict_lines = summarize(runs_dir, settings)
    print(table)
    print("\n".join(verdict_lines))
    if not args.no_save:
        append_entry(
            args.out, "B6 — learning quality on a real model",
            "SmolLM2-135M-Instruct, GRPO on + / - arithmetic (operands 0-50), 16 prompts x 8 answers, held-out "
            "greedy accuracy on 256 problems; every setting x seeds side by side on one GPU (quarl/bench/quality.py).",
            bench_command(args, "quality"),
            [f"runs: {runs_dir}"] + [f"target: {v}" for v in verdict_lines], table)
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("quality", __doc__, add_bench_quality_arguments, run_bench_quality, argv)


if __name__ == "__main__":
    sys.exit(main())
