"""B3 — one RL step of the real trainer, split into its phases (`quarl bench step`, BENCHMARKS.md).

For each setting (precision flow, format and optionally its KV cache, e.g. `bf16`, `split:fp8:fp8`,
`unified:fp8-block`) a fresh Qwen2.5-architecture model with seeded random weights
(`quarl.bench.rollout.build_model`; `tiny` = the CPU test model of `quarl.model.tiny`) is trained by
`quarl.rl.trainer.Trainer` on a synthetic task:

- prompts are `--prompt-len` random token ids, fed to the engine as token-id lists (no tokenizer);
- the reward is uniform in [0, 1) from a seeded generator, so every group has non-zero advantages;
- `--answer-lengths fixed` (default): EOS is ignored by giving the model config no EOS ids (the trainer's engine
  call has no ignore_eos switch), so every answer is exactly `--max-new-tokens` long;
  `--answer-lengths long-tail` (the reasoning-RL workload, where answers end unevenly): a seeded random set of
  about vocab / `--mean-answer-len` token ids are EOS, so on a random-weight model, whose next-token
  distribution is close to uniform, each answer stops after a geometric number of tokens (mean about
  `--mean-answer-len`, a long tail cut at `--max-new-tokens`); completions carry ids only (no detokenization).

`--warmup` steps (CUDA-graph capture, Triton compilation) are followed by `--steps` timed steps. The reported
step is the median timed step (by wall time, CUDA-synchronized around it) with the trainer's own phase timers:
sync (re-quantization), rollout, prox (proximal log-probs; ~0 when the update's forward supplies them, see
`Trainer.proximal_from_update`), update (optimizer steps); `other` is the rest
(rewards, advantages, batch assembly, sample logging, and the asynchronous tail of the last optimizer step).
The shares of the five parts sum to 100 % of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from quarl.bench import add_output_arguments, append_entry, bench_command, bench_main
from quarl.bench.rollout import KV_CACHES, MODEL_SIZES, architecture_name, build_model

MODEL_SIZE_CHOICES = (*MODEL_SIZES, "tiny")
ANSWER_LENGTHS = ("fixed", "long-tail")
DEFAULT_SETTINGS = "bf16,split:fp8,unified:fp8-block"
DEFAULT_RESULTS = os.path.join("bench", "results", "step.md")
PHASES = ("sync", "rollout", "prox", "update", "other")
METRIC_OF_PHASE = {"sync": "time/sync_s", "rollout": "time/rollout_s", "prox": "time/prox_s",
                   "update": "time/train_s"}
SYNC_TARGET_PCT = 1.0
SPEEDUP_TARGET = 1.3
TARGETS = f"sync <= {SYNC_TARGET_PCT:g}% of the step; low-precision step >= {SPEEDUP_TARGET}x the bf16 step"


@dataclass(frozen=True)
class Setting:
    """One precision setting: a flow of quarl.precision.FLOWS, its format (None = the flow's default) and its KV
    cache ("auto" | "fp8" | "fp8-token"; None = the --kv-cache option)."""

    flow: str
    format: str | None = None
    kv: str | None = None

    @property
    def name(self) -> str:
        if self.kv is None:
            return self.flow if self.format is None else f"{self.flow}:{self.format}"
        return f"{self.flow}:{self.format or ''}:{self.kv}"


def parse_settings(text: str) -> list[Setting]:
    """'bf16,split:fp8,split:fp8:fp8' -> [Setting("bf16"), Setting("split", "fp8"), Setting("split", "fp8",
    "fp8")]: FLOW[:FORMAT[:KV]], KV the setting's own KV cache (auto | fp8 | fp8-token)."""
    from quarl.precision import FLOWS, KV_CACHE_FORMATS, QUANT_FORMATS

    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        flow, fmt, kv = (parts + ["", ""])[:3]
        if (flow not in FLOWS or (fmt and fmt not in QUANT_FORMATS) or (flow == "bf16" and fmt)
                or (kv and not (fmt or flow == "bf16")) or (len(parts) == 3 and kv not in KV_CACHE_FORMATS)
                or len(parts) > 3 or (len(parts) == 2 and not fmt)):
            raise ValueError(f"setting {item!r}: write FLOW, FLOW:FORMAT or FLOW:FORMAT:KV with FLOW in {FLOWS}, "
                             f"FORMAT in {QUANT_FORMATS} (bf16 takes none) and KV in {KV_CACHE_FORMATS}, e.g. "
                             "--settings "
                             "bf16,split:fp8:fp8")
        out.append(Setting(flow, fmt or None, kv or None))
    if not out:
        raise ValueError(f"no settings given (e.g. --settings {DEFAULT_SETTINGS})")
    return out


def add_bench_step_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quarl bench step`."""
    parser.add_argument("--model-size", default="1.5b", choices=MODEL_SIZE_CHOICES,
                        help="Qwen2.5 architecture with random weights (30b-a3b: Qwen3-30B-A3B MoE; 135m: "
                             "SmolLM2-135M's Llama shapes, the B6 model; tiny = the CPU test model)")
    parser.add_argument("--lora-rank", type=int, default=0, help="0 = full fine-tune (B3: 1.5b full, 7b rank 32)")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS,
                        help="comma list of FLOW[:FORMAT[:KV]] (bf16 | split | unified | qlora; formats as in "
                             "precision.format; KV auto | fp8 | fp8-token, default --kv-cache); the first bf16 "
                             "setting is the baseline of the speed-ups")
    parser.add_argument("--kv-cache", default="auto", choices=KV_CACHES,
                        help="KV cache of every setting that names none")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (group size)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--answer-lengths", default="fixed", choices=ANSWER_LENGTHS,
                        help="fixed: every answer --max-new-tokens long; long-tail: answers end unevenly (mean "
                             "--mean-answer-len, cut at --max-new-tokens), as in reasoning RL")
    parser.add_argument("--mean-answer-len", type=int, default=None,
                        help="long-tail: mean answer length in tokens (default a quarter of --max-new-tokens)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per setting (graph capture, compile)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting (median step reported)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; settings (and timed steps after the first) that would end after it are "
                             "skipped and reported as skipped")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra run-config override, repeatable (e.g. --set train.micro_batch_size=16)")
    parser.add_argument("--set-lowp", dest="lowp_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the low-precision settings only (not bf16), repeatable: runs a pair such "
                             "as bf16 against the Jet-RL setting in one call (e.g. --set-lowp "
                             "precision.quantized_backward=true)")
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="run the timed steps under torch.profiler and write, per setting, DIR/SETTING.txt: the "
                             "operators and kernels that took the most GPU and CPU time (the step times then include "
                             "the profiler's overhead)")
    parser.add_argument("--with", dest="with_paths", default="",
                        help="comma list of optional paths to turn on for every setting: " + ", ".join(PATHS))
    parser.add_argument("--without", default="",
                        help="comma list of optional paths to turn off for every setting (same names), to measure "
                             "what each is worth")
    add_output_arguments(parser, DEFAULT_RESULTS, "also write the rows to this JSON file")


# Optional paths a run can turn on (--with) or off (--without): name -> the `quarl.fast_paths.FastPaths` field (the
# run config's `fast_paths.<field>`). Defaults as in FastPaths: all on but wgrad-kernel.
PATHS = {
    "rope": "fused_rope",
    "logprobs": "fused_logprobs",
    "share-codes": "share_input_codes",
    "cublas-linear": "fused_cublas_path",
    "wgrad-kernel": "fp8_weight_grad_kernel",
    "lora-handoff": "lora_codes_handoff",
    "rollout-lora-stack": "stack_rollout_lora",
    "grouped-experts": "grouped_experts",
}


def _path_names(names: str, option: str) -> list[str]:
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in PATHS]
    if unknown:
        raise ValueError(f"{option} {','.join(unknown)}: unknown; choose from {', '.join(PATHS)}")
    return chosen


def path_settings(with_names: str, without_names: str) -> dict[str, bool]:
    """{FastPaths field: on} for the paths named in the comma lists of --with (on) and --without (off); refuses
    unknown names and a name in both."""
    on, off = _path_names(with_names, "--with"), _path_names(without_names, "--without")
    if set(on) & set(off):
        raise ValueError("--with and --without name the same path; name each path in one of them")
    return {PATHS[n]: True for n in on} | {PATHS[n]: False for n in off}


def path_overrides(with_names: str, without_names: str) -> list[str]:
    """The run-config overrides (`fast_paths.<field>=true|false`) of --with and --without (see `path_settings`)."""
    return [f"fast_paths.{field}={str(on).lower()}" for field, on in path_settings(with_names, without_names).items()]


# ---------------------------------------------------------------- model, task, trainer


class TokenIdTokenizer:
    """The little of a tokenizer the trainer needs when prompts are token ids: a pad id and no EOS."""

    eos_token_id = None

    def __init__(self, pad_token_id: int = 0):
        self.pad_token_id = pad_token_id


def make_model(size: str, device, seed: int, precision=None, mean_answer_len: int | None = None):
    """A random-weight QuarlForCausalLM of `size` on `device`, trainable, whose config has no EOS ids, or with
    mean_answer_len, `eos_ids_for_mean_length`'s EOS ids.

    precision: with a qlora PrecisionConfig the frozen base is quantized while the model is built (the bf16
    model never exists whole); the trainer's apply_precision then only adds the adapters."""
    import torch

    if size == "tiny":
        from quarl.model.decoder import QuarlForCausalLM
        from quarl.model.tiny import tiny_config

        torch.manual_seed(seed)
        model = QuarlForCausalLM(tiny_config("qwen2")).to(device)
    else:
        model = build_model(size, str(device), seed, precision=precision)
    # No EOS ids: both engines then decode every answer to max_new_tokens (the benchmark's "EOS ignored").
    model.config.eos_token_ids = [] if mean_answer_len is None else \
        eos_ids_for_mean_length(model.config.vocab_size, mean_answer_len, seed)
    return model.requires_grad_(True)


def eos_ids_for_mean_length(vocab_size: int, mean_len: int, seed: int) -> list[int]:
    """round(vocab_size / mean_len) distinct token ids (at least 1, never id 0, the padding id), chosen by a
    seeded generator: sampling near-uniformly over the vocabulary, an answer then stops at each token with
    probability about 1 / mean_len, so lengths are geometric with mean about mean_len."""
    import torch

    if mean_len < 1:
        raise ValueError(f"--mean-answer-len must be >= 1, got {mean_len}")
    count = min(vocab_size - 1, max(1, round(vocab_size / mean_len)))
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randperm(vocab_size - 1, generator=g)[:count] + 1).sort().values.tolist()


def mean_answer_len(args) -> int | None:
    """The long-tail workload's mean answer length (None for fixed lengths)."""
    if args.answer_lengths != "long-tail":
        return None
    return args.mean_answer_len if args.mean_answer_len is not None else max(1, args.max_new_tokens // 4)


def synthetic_task(num_examples: int, prompt_len: int, vocab_size: int, seed: int):
    """TaskData whose examples render to `prompt_len` random token ids and whose reward is seeded U[0, 1)."""
    import torch

    from quarl.tasks.datasets import Example
    from quarl.tasks.task import TaskData

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_examples, prompt_len), generator=g).tolist()
    examples = [Example(id=f"random-{i}", prompt=f"<{prompt_len} random token ids>", gold="",
                        meta={"token_ids": row}) for i, row in enumerate(ids)]
    rng = random.Random(seed)
    # Random rewards keep every group's standard deviation > 0, so no advantage is zero and the update does work.
    return TaskData(examples, [], render_fn=lambda ex: ex.meta["token_ids"], reward_fn=lambda text, ex: rng.random(),
                    correct_fn=lambda text, ex: 0.0, seed=seed)


def run_config(args, setting: Setting, run_dir: str, device):
    """The RunConfig of one setting: the benchmark workload plus the user's --set overrides, and --set-lowp's for
    a setting other than bf16 (validated)."""
    from quarl.config import load_config

    overrides = [
        f"model.device={device}", f"precision.flow={setting.flow}", f"precision.kv_cache={setting.kv or args.kv_cache}",
        f"lora.rank={args.lora_rank}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.num_generations={args.samples}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_batch_size={args.prompts * args.samples}", "rollout.temperature=1.0",
        f"train.steps={args.warmup + args.steps}", f"train.seed={args.seed}",
        "data.num_train=2", "data.num_eval=1", "eval.before=false", "eval.after=false",
        "output.tensorboard=false", "output.progress=false", f"output.dir={run_dir}",
    ]
    if setting.format is not None:
        overrides.append(f"precision.format={setting.format}")
    overrides += path_overrides(getattr(args, "with_paths", ""), getattr(args, "without", ""))
    lowp = list(args.lowp_overrides) if setting.flow != "bf16" else []
    return load_config(None, overrides + list(args.overrides) + lowp)


# ---------------------------------------------------------------- measurement


def _now(torch, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def run_setting(args, setting: Setting, device, deadline: float | None,
                ceilings: tuple[float, float] | None = None) -> dict:
    """Warm up and time one setting on a fresh model; returns its result row (see `phase_row`).

    ceilings: (bandwidth bytes/s, bf16 matrix FLOP/s) measured on this GPU; with them the row also gets the
    rollout phase's share of its roofline (`rollout_roofline`)."""
    import torch

    from quarl.fallbacks import reported_fallbacks
    from quarl.rl.trainer import Trainer

    t_setup = time.perf_counter()
    fallbacks_before = set(reported_fallbacks())
    with tempfile.TemporaryDirectory(prefix="quarl-bench-step-") as run_dir:
        cfg = run_config(args, setting, run_dir, device)
        model = make_model(args.model_size, device, args.seed,
                           precision=cfg.precision if cfg.precision.flow == "qlora" else None,
                           mean_answer_len=mean_answer_len(args))
        task = synthetic_task(args.prompts * (args.warmup + args.steps), args.prompt_len, model.config.vocab_size,
                              args.seed)
        trainer = Trainer(cfg, model=model, tokenizer=TokenIdTokenizer(), task=task)
        trainer.engine.tokenizer = None  # the engine's token-id mode: completions carry ids, no text is decoded
        trainer.prepare_run_dir()
        for step in range(args.warmup):
            trainer.step(step)
        setup_s = _now(torch, device) - t_setup
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timed = []  # (wall seconds, trainer metrics)
        with profiled(args.profile, setting.name, device):
            for step in range(args.warmup, args.warmup + args.steps):
                if timed and deadline is not None and time.perf_counter() + timed[-1][0] > deadline:
                    break  # keep the steps measured so far rather than overrun the budget
                t0 = _now(torch, device)
                metrics = trainer.step(step)
                timed.append((_now(torch, device) - t0, metrics))
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        # the roofline assumes every answer decodes --max-new-tokens at the full batch: not for long-tail answers
        roofline = None if ceilings is None or mean_answer_len(args) is not None else \
            rollout_roofline(model, cfg, args, *ceilings)
        trainer.log.close()
        del trainer, model
    row = phase_row(setting, timed, args, peak)
    row["smooth_alpha"] = cfg.precision.resolved_smooth_alpha  # int8 W8A8 rollouts smooth by default
    # a decode graph captured in a timed step read moved buffers and was captured again (the engine's count of
    # each step's last generate call: a step that samples several rounds reports its last one)
    row["timed_graph_captures"] = sum(int(m.get("rollout/graph_captures", 0)) for _, m in timed)
    row["fallbacks"] = sorted(set(reported_fallbacks()) - fallbacks_before)  # first reported by this setting
    row["setup_s"] = setup_s
    row["rollout_roofline_s"] = roofline
    row["rollout_roofline_pct"] = None if roofline is None else 100.0 * roofline / row["rollout_s"]
    return row


@contextlib.contextmanager
def profiled(out_dir: str | None, name: str, device, rows: int = 30):
    """With out_dir: run the block under torch.profiler and write out_dir/NAME.txt (NAME: the setting's name with
    ':' as '_'): the `rows` operators with the most self GPU time, then the `rows` with the most self CPU time
    (key_averages tables). Without: nothing."""
    if not out_dir:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    averages = prof.key_averages()
    tables = []
    if device.type == "cuda":
        tables.append(averages.table(sort_by="self_device_time_total", row_limit=rows))
    tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name.replace(":", "_") + ".txt")
    with open(path, "w") as f:
        f.write("\n\n".join(tables) + "\n")
    print(f"[bench step] profile of {name}: {path}", flush=True)


def rollout_roofline(model, cfg, args, bandwidth: float, rate: float) -> float:
    """Seconds the rollout phase would take at the roofline of BENCHMARKS.md B2 (`quarl.bench.rollout`): per
    decode step the rollout weights and the KV cache read at `bandwidth`, or the linear FLOPs at `rate` (2x for
    W8A8 formats), whichever is longer, plus the unique prompt tokens' prefill at that rate."""
    from quarl.bench.rollout import W8A8, kv_bytes_per_element, linear_bytes_and_params, roofline_seconds

    weight_bytes, params = linear_bytes_and_params(model)
    fmt = cfg.precision.resolved_format
    w8a8 = fmt in W8A8 and not cfg.precision.resolved_weight_only_at(model.config.hidden_size)
    kv_bytes = kv_bytes_per_element(cfg.precision.kv_cache, model.config.head_dim, model.dtype.itemsize)
    return roofline_seconds(weight_bytes, params, model.config, args.prompts * args.samples, args.prompt_len,
                            args.max_new_tokens, args.prompts * args.prompt_len, kv_bytes, bandwidth,
                            rate * (2 if w8a8 else 1))


def phase_row(setting: Setting, timed: list[tuple[float, dict]], args, peak_gib: float | None) -> dict:
    """Result row from the timed steps: the median step's wall time, its phases (seconds and % of the step).

    `timed` holds (CUDA-synchronized wall seconds of trainer.step, the metrics it returned) per timed step.
    """
    wall, metrics = sorted(timed, key=lambda t: t[0])[(len(timed) - 1) // 2]  # the (lower) median step
    seconds = {p: float(metrics.get(METRIC_OF_PHASE[p], 0.0)) for p in PHASES if p != "other"}
    seconds["other"] = wall - sum(seconds.values())
    tokens = round(metrics["rollout/tokens_per_s"] * metrics["time/rollout_s"])
    row = dict(setting=setting.name, flow=setting.flow, format=setting.format, step_s=wall,
               all_step_s=[t[0] for t in timed], steps_timed=len(timed), steps_asked=args.steps, tokens=tokens,
               expected_tokens=args.prompts * args.samples * args.max_new_tokens if mean_answer_len(args) is None
               else None, answer_len_mean=float(metrics.get("rollout/answer_len_mean", float("nan"))),
               rollout_tok_s=tokens / seconds["rollout"], step_tok_s=tokens / wall, peak_gib=peak_gib)
    for p in PHASES:
        row[f"{p}_s"] = seconds[p]
        row[f"{p}_pct"] = 100.0 * seconds[p] / wall
    return row


def bench_step(args) -> tuple[list[dict], str, str]:
    """Run every setting of `args` (see `add_bench_step_arguments`); returns (rows, table, summary).

    A row has setting, flow, format, step_s, {sync,rollout,prox,update,other}_s and _pct, tokens,
    expected_tokens, rollout_tok_s, step_tok_s, peak_gib (None off the GPU), speedup (bf16 step / this step;
    None for bf16 or without a bf16 row), steps_timed, all_step_s, setup_s; or setting + skipped / error.
    """
    import torch

    from quarl.devices import resolve_device

    for name in ("prompts", "samples", "prompt_len", "max_new_tokens", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.lora_rank < 0:
        raise ValueError("--warmup and --lora-rank must be >= 0")
    if args.mean_answer_len is not None:
        if args.answer_lengths != "long-tail":
            raise ValueError("--mean-answer-len sets the mean of --answer-lengths long-tail; add that option or drop "
                             "--mean-answer-len")
        if args.mean_answer_len < 1:
            raise ValueError(f"--mean-answer-len must be >= 1, got {args.mean_answer_len}")
    settings = parse_settings(args.settings)
    path_settings(args.with_paths, args.without)  # unknown names fail here, before any run
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as scratch:  # bad overrides or flow/LoRA combinations fail before any run
        for s in settings:
            run_config(args, s, scratch, device)

    t_start = time.perf_counter()
    deadline = None if args.time_budget is None else t_start + args.time_budget
    rows, last_duration = [], 0.0
    ceilings = None
    if device.type == "cuda":
        from quarl.bench.gemm import measure_ceilings

        ceilings = measure_ceilings(torch)
    print(HEADER, flush=True)
    for s in settings:
        if deadline is not None and time.perf_counter() + last_duration > deadline:
            rows.append(dict(setting=s.name, flow=s.flow, format=s.format,
                             skipped=f"skipped (time budget {args.time_budget:g} s)"))
            print(format_row(rows[-1]), flush=True)
            continue
        t0 = time.perf_counter()
        try:
            row = run_setting(args, s, device, deadline, ceilings)
        except Exception as e:  # report and go on: one failing setting must not hide the others
            traceback.print_exc()
            row = dict(setting=s.name, flow=s.flow, format=s.format, error=f"error: {type(e).__name__}: {e}"[:200])
        last_duration = time.perf_counter() - t0
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(format_row(row), f"({last_duration:.0f} s with setup)", flush=True)
    add_speedups(rows)
    table = "\n".join([HEADER] + [format_row(r) for r in rows])
    return rows, table, summarize(rows)


def add_speedups(rows: list[dict]) -> None:
    """Set row["speedup"] for every measured non-bf16 row: bf16 step time / the row's step time, or with long-tail
    answers (whose total differs from setting to setting, as each samples its own tokens) the row's step
    throughput (tokens/s) / bf16's."""
    base = next((r for r in rows if r["flow"] == "bf16" and "step_s" in r), None)
    for r in rows:
        if "step_s" in r:
            r["speedup"] = None if base is None or r["flow"] == "bf16" else speed_ratio(base, r, "step")


def speed_ratio(base: dict, row: dict, part: str) -> float:
    """How much faster `row` ran `part` ("step" or "rollout") than `base`: by time for fixed-length answers, by
    tokens per second when the settings' answers may total differently (long-tail)."""
    if row["expected_tokens"] is None:
        return row[f"{part}_tok_s"] / base[f"{part}_tok_s"]
    return base[f"{part}_s"] / row[f"{part}_s"]


# ---------------------------------------------------------------- report

HEADER = ("| setting | step (s) | sync | rollout | prox | update | other | rollout tok/s | rollout % roofline | "
          "step tok/s | peak mem (GiB) | vs bf16 | notes |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def format_row(r: dict) -> str:
    """One markdown table row; each phase cell is 'seconds (share %)'."""
    if "step_s" not in r:
        return f"| {r['setting']} |" + " - |" * 11 + f" {r.get('skipped') or r.get('error')} |"
    phases = " | ".join(f"{r[p + '_s']:.2f} ({r[p + '_pct']:.1f}%)" for p in PHASES)
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    vs = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
    notes = []
    if r["expected_tokens"] is not None and r["tokens"] != r["expected_tokens"]:
        notes.append(f"{r['tokens']} of {r['expected_tokens']} tokens")
    if r["expected_tokens"] is None:
        notes.append(f"answers {r['answer_len_mean']:.0f} tokens on average")
    if r["steps_timed"] < r["steps_asked"]:
        notes.append(f"{r['steps_timed']} of {r['steps_asked']} timed steps (time budget)")
    if r.get("smooth_alpha"):
        notes.append(f"SmoothQuant (alpha {r['smooth_alpha']})")
    if r.get("timed_graph_captures"):
        notes.append(f"{r['timed_graph_captures']} CUDA graphs captured in the timed steps")
    if r.get("fallbacks"):
        notes.append("fell back: " + ", ".join(r["fallbacks"]))
    roof = "-" if r.get("rollout_roofline_pct") is None else f"{r['rollout_roofline_pct']:.0f}%"
    return (f"| {r['setting']} | {r['step_s']:.2f} | {phases} | {r['rollout_tok_s']:,.0f} | {roof} | "
            f"{r['step_tok_s']:,.0f} | {peak} | {vs} | {'; '.join(notes)} |")


def rollout_bound(share: float, rollout_speedup: float) -> float:
    """The step speed-up a rollout speed-up allows when rollout is `share` (0..1) of the bf16 step and nothing
    else gets faster (Amdahl): 1 / (share / rollout_speedup + 1 - share)."""
    return 1.0 / (share / rollout_speedup + 1.0 - share)


def summarize(rows: list[dict]) -> str:
    """Target verdicts: sync share of every measured setting, speed-up of every low-precision setting, and what
    the rollout alone allows (`rollout_bound`: bf16's rollout share and the setting's rollout speed-up)."""
    ok = [r for r in rows if "step_s" in r]
    if not ok:
        return "- no setting completed"
    lines = [f"- targets: {TARGETS}"]
    base = next((r for r in ok if r["flow"] == "bf16"), None)
    if base is not None:
        lines.append(f"- bf16: rollout is {base['rollout_pct']:.1f}% of the step")
    for r in ok:
        verdict = "MET" if r["sync_pct"] <= SYNC_TARGET_PCT else "missed"
        line = f"- {r['setting']}: sync {r['sync_s'] * 1e3:.1f} ms = {r['sync_pct']:.2f}% of the step ({verdict})"
        if r["flow"] != "bf16":
            if r.get("speedup"):
                met = "MET" if r["speedup"] >= SPEEDUP_TARGET else "missed"
                line += f"; step {r['speedup']:.2f}x bf16 ({met} {SPEEDUP_TARGET}x)"
                rollout_speedup = speed_ratio(base, r, "rollout")
                bound = rollout_bound(base["rollout_pct"] / 100.0, rollout_speedup)
                line += (f"; rollout {rollout_speedup:.2f}x bf16 allows {bound:.2f}x, the step reaches "
                         f"{100.0 * r['speedup'] / bound:.0f}% of that bound")
            else:
                line += "; no bf16 step measured to compare with"
        lines.append(line)
    return "\n".join(lines)


def run_bench_step(args) -> int:
    """Run B3 as configured by `add_bench_step_arguments`: print the table and summary, append the entry. -> 0."""
    rows, table, summary = bench_step(args)
    print("\n" + table + "\n\n" + summary, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if not args.no_save:
        tuning = "full fine-tune" if args.lora_rank == 0 else f"LoRA rank {args.lora_rank}"
        facts = [
            f"workload: {architecture_name(args.model_size)} architecture (random weights), {tuning}, {args.prompts} prompts x "
            f"{args.samples} samples, {args.prompt_len} random prompt tokens, " + (
                f"{args.max_new_tokens} new tokens (EOS ignored)" if mean_answer_len(args) is None else
                f"long-tail answers (geometric, mean {mean_answer_len(args)}, cut at {args.max_new_tokens} tokens)")
            + f", KV cache {args.kv_cache} (unless a setting names its own), {args.warmup} warm-up + "
            f"{args.steps} timed step(s) per setting (median step reported)",
            "phases: the trainer's timers; other = step - the four phases (rewards, advantages, batch, logging, "
            "optimizer tail)",
        ]
        if args.overrides:
            facts.append("overrides: " + " ".join(args.overrides))
        if args.lowp_overrides:
            facts.append("low-precision settings only: " + " ".join(args.lowp_overrides))
        if args.with_paths:
            facts.append("optional paths turned on: " + args.with_paths)
        if args.without:
            facts.append("optional paths turned off: " + args.without)
        append_entry(args.out, "B3 — RL step (`quarl bench step`)",
                     "Appended by `quarl bench step`; newest last. One step of quarl.rl.trainer.Trainer on a "
                     "random-weight architecture (Qwen2.5 sizes, SmolLM2-135M's shapes, Qwen3-30B-A3B), split into "
                     "sync / rollout / prox / update / other.",
                     bench_command(args, "step"), facts, table + "\n\n" + summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("step", __doc__, add_bench_step_arguments, run_bench_step, argv)


if __name__ == "__main__":
    sys.exit(main())
