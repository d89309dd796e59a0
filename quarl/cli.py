"""`quarl train | config | generate | eval | plot | export | bench` — the command-line interface."""

from __future__ import annotations

import argparse
import signal
import sys

# Heavy imports (torch) happen inside main(), so that Ctrl-C during start-up ends with one line, not a traceback.

TRAIN_EPILOG = """exit status: 0 done; 1 the run stopped with an error it names (NaN/Inf for train.max_nonfinite_steps
steps in a row or in the weights, run directory in use by another run); 2 bad config or input; 130 stopped by
Ctrl-C, 143 stopped by SIGTERM (both after finishing the step and saving a checkpoint; a second Ctrl-C or SIGTERM
stops at once with 130). Resuming a run directory runs the reward function named in its config.yaml."""


def _train(args) -> int:
    from quarl.config import config_and_overrides
    from quarl.distributed import launch, launched_by_torchrun
    from quarl.rl.trainer import RunStopped, train_from_config

    config, overrides = args.config, list(args.overrides)
    if args.nproc is not None and not launched_by_torchrun():  # one process per GPU, through torchrun
        return launch(args.nproc, ["train", *([config] if config is not None else []), *overrides])
    config, overrides = config_and_overrides(config, overrides)  # `quarl train key=value ...`: built-in defaults
    try:
        summary = train_from_config(config, overrides)
    except RunStopped as e:
        print(f"quarl train: error: {e}", file=sys.stderr)
        return 1
    if summary.get("interrupted"):
        return 128 + int(summary.get("signal") or signal.SIGINT)  # 130 after Ctrl-C, 143 after SIGTERM
    return 0


def _config(args) -> int:
    import yaml

    from quarl.config import config_and_overrides, effective_config_dict, load_config

    if args.reference:
        from quarl.config_reference import config_reference

        print(config_reference(), end="")
        return 0
    config, overrides = config_and_overrides(args.config, args.overrides)
    # The values a run will use: keys left null (format, aggregation, epsilon_high, ...) are printed resolved.
    print(yaml.safe_dump(effective_config_dict(load_config(config, overrides)), sort_keys=False), end="")
    return 0


# The instruction each benchmark's answers are usually asked with, in the form its gold answer is checked
# (quarl.tasks.rewards.math_reward reads the last \boxed{} of a completion, else its last number).
EVAL_TEMPLATES = {
    "gsm8k": "{prompt}\nLet's think step by step and output the final answer after \"####\".",
    "boxed": "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "arithmetic": "What is {prompt}? Answer with just the number.",
}


def default_eval_template(data: str, gold_format: str | None) -> str:
    """The prompt template `quarl eval` uses without --prompt-template: GSM8K's "####" instruction for GSM8K-style
    gold answers, the \\boxed{} instruction for MATH-500 / AIME and other LaTeX or plain answers."""
    if data == "arithmetic":
        return EVAL_TEMPLATES["arithmetic"]
    return EVAL_TEMPLATES["gsm8k" if gold_format == "gsm8k" else "boxed"]


def _eval_out_path(args) -> "Path":
    from pathlib import Path
    import re

    if args.out:
        out = Path(args.out)
        if out.is_dir() or args.out.endswith(("/", "\\")):
            raise ValueError(f"--out {args.out} is a folder; give the JSON file to write, e.g. {args.out.rstrip('/')}/"
                             "result.json")
        return out if out.suffix == ".json" else out.with_name(out.name + ".json")
    name = "-".join(re.sub(r"[^A-Za-z0-9_.+]+", "_", Path(str(part).rstrip("/")).stem or str(part)).strip("_")
                    for part in (args.model, args.data, args.split, args.precision))
    if args.n > 1:
        name += f"-n{args.n}"
    return Path("runs") / "eval" / f"{name}.json"


def _eval(args) -> int:
    import json
    import time
    from dataclasses import replace

    from quarl.config import DataSection, RewardSection
    from quarl.model.loading import load_model
    from quarl.model.precision_apply import apply_precision
    from quarl.devices import resolve_device, set_cpu_threads
    from quarl.rl.evaluate import evaluate
    from quarl.rollout.generate_cli import make_engine, precision_config
    from quarl.tasks.task import load_task, make_renderer

    verbose = not args.quiet
    out_path = _eval_out_path(args)  # a bad --out fails before the model loads
    device = resolve_device(args.device)
    set_cpu_threads(device)
    precision = precision_config(args.precision)
    data = DataSection(train=args.data, eval=args.data, eval_split=args.split, train_split=args.split,
                       eval_limit=args.limit, limit=args.limit, data_dir=args.data_dir,
                       prompt_template=args.prompt_template or "{prompt}", system_prompt=args.system_prompt,
                       chat_template=not args.no_chat, num_eval=args.limit or 64)
    task = load_task(data, RewardSection(), None, seed=args.seed)  # bad data fails before the model loads
    if not task.eval_examples:
        raise ValueError(f"--data {args.data} --split {args.split} has no examples to evaluate")
    template = args.prompt_template or default_eval_template(args.data, task.eval_examples[0].gold_format)
    model, tok = load_model(args.model, device=str(device), dtype=precision.torch_dtype(device),
                            gguf_file=args.gguf_file, progress=verbose)
    apply_precision(model, precision)
    task.render_fn = make_renderer(replace(data, prompt_template=template), tok)
    engine = make_engine(model, tok, args.engine, args.kv_cache, len(task.eval_examples) * args.n, args.n,
                         args.sampler)
    records: list[dict] = []
    if verbose:
        answers = f"{args.n} answers each" if args.n > 1 else "1 answer each"
        print(f"[quarl] evaluating {len(task.eval_examples)} problems of {args.data} ({answers}, up to "
              f"{args.max_new_tokens} new tokens) with {type(engine).__name__}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    result = evaluate(engine, task, task.eval_examples, n=args.n, temperature=args.temperature,
                      max_new_tokens=args.max_new_tokens, seed=args.seed, progress=None if verbose else False,
                      desc=f"quarl eval {args.data}", records=records)
    samples_path = out_path.with_name(out_path.stem + ".samples.jsonl")
    summary = {"model": args.model, "data": args.data, "split": args.split, "precision": args.precision,
               "engine": type(engine).__name__, "kv_cache": args.kv_cache,
               "sampler": getattr(engine, "sampler", "gumbel"), "prompt_template": template,
               "system_prompt": args.system_prompt, "chat_template": not args.no_chat, "n": args.n,
               "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
               **result, "samples": str(samples_path)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with samples_path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    out_path.write_text(json.dumps(summary, indent=2) + "\n")
    if verbose:
        print(f"[quarl] evaluated in {time.perf_counter() - started:.1f} s: accuracy {result['accuracy']:.3f}",
              file=sys.stderr)
        print(f"[quarl] wrote {out_path} and the completions with their scores to {samples_path}", file=sys.stderr)
    print(json.dumps(summary, indent=2))
    return 0


def _plot(args) -> int:
    from quarl.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def _export(args) -> int:
    from quarl.export import export_from_run

    print(export_from_run(args.run_dir, args.out, overwrite=args.overwrite, dtype=args.dtype,
                          verbose=not args.quiet))
    return 0


BENCHMARKS = {
    "gemm": "B1: low-precision GEMMs vs bf16 on Qwen2.5-7B linear shapes",
    "rollout": "B2: rollout throughput of the fast engine (Qwen2.5-7B architecture)",
    "step": "B3: one RL step of the real trainer, split into sync/rollout/prox/update",
    "memory": "B4: the largest Qwen2.5 model whose qlora RL step runs on this GPU",
    "quality": "B6: learning quality of every precision flow on the real SmolLM2-135M (runs side by side)",
    "mismatch": "before training: each rollout format's KL to the full-precision model on a run config's data",
}


def _add_module_command(subparsers, name: str, help_text: str, module: str, stem: str, label: str) -> None:
    """A subcommand whose options and runner live in `module` as add_<stem>_arguments / run_<stem>. An import
    failure (e.g. a GPU-only dependency) leaves the rest of the CLI usable and explains itself when invoked."""
    import importlib

    parser = subparsers.add_parser(name, help=help_text)
    try:
        mod = importlib.import_module(module)
        getattr(mod, f"add_{stem}_arguments")(parser)
        parser.set_defaults(fn=getattr(mod, f"run_{stem}"))
    except ImportError as e:
        parser.set_defaults(fn=lambda a, e=e: sys.exit(f"{label} is unavailable: {e}"))


def build_parser() -> argparse.ArgumentParser:
    from quarl.precision import QUANT_FORMATS
    from quarl.rollout.generate_cli import add_engine_arguments

    parser = argparse.ArgumentParser(prog="quarl", description="RL post-training of LLMs with low-precision rollouts")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train with RL from a YAML config (plus key=value overrides)",
                       epilog=TRAIN_EPILOG)
    p.add_argument("config", nargs="?", help="YAML config file (e.g. configs/demo.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5 precision.flow=unified; "
                                                 "resume=RUN_DIR continues a run")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="run on N processes of this machine, one per GPU (starts torchrun; FSDP2, see "
                        "docs/DISTRIBUTED.md); several machines: torchrun ... -m quarl train CONFIG")
    p.set_defaults(fn=_train)

    p = sub.add_parser("config", help="print the effective configuration (validated; null defaults resolved to "
                                      "the values a run uses), or every key with --reference")
    p.add_argument("config", nargs="?", help="YAML config file (default: the built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for quarl train")
    p.add_argument("--reference", action="store_true", help="print the markdown reference of every key")
    p.set_defaults(fn=_config)

    _add_module_command(sub, "generate", "sample completions from a model in any precision",
                        "quarl.rollout.generate_cli", "generate", "quarl generate")

    p = sub.add_parser("eval", help="accuracy / avg@k / pass@k of a model on a dataset, in any precision",
                       description="Score a model on a dataset. The result (JSON) is printed and saved to --out, "
                                   "the completions with their per-problem scores next to it (.samples.jsonl).")
    p.add_argument("--model", default="smollm2-135m-instruct", help="HF dir, hub id, .gguf file, or a run's export")
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--data", default="gsm8k", help="gsm8k | math500 | aime24 | arithmetic | .jsonl/.parquet | hub id")
    p.add_argument("--split", default="test")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples")
    p.add_argument("--precision", default="bf16", choices=["bf16", *QUANT_FORMATS])
    p.add_argument("--n", type=int, default=1, help="answers per problem (avg@n, pass@n)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompt-template", default=None,
                   help="the user turn, {prompt} is the question (default: the dataset's usual instruction: for "
                        "GSM8K step by step with the answer after ####, for MATH-500 / AIME the answer in \\boxed{})")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON result file (default runs/eval/MODEL-DATA-SPLIT-PRECISION.json); "
                                               "the completions go to OUT's stem + .samples.jsonl")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines or bars on stderr")
    add_engine_arguments(p)
    p.set_defaults(fn=_eval)

    p = sub.add_parser("plot", help="a PNG page of a run's curves (reward, held-out accuracy, loss, grad norm, "
                                    "entropy, mismatch KL, IS weights, clipping, time) and a Markdown summary")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    p.set_defaults(fn=_plot)

    p = sub.add_parser("export", help="write a run's latest checkpoint as a Hugging Face model (+ PEFT adapters)")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/export)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in the output folder")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the written weights (default bfloat16; float32 keeps full training precision)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(fn=_export)

    p = sub.add_parser("bench", help="benchmarks (GPU): gemm, rollout, step, memory, quality; mismatch (CPU or GPU)")
    bench = p.add_subparsers(dest="bench", required=True)
    for name, help_text in BENCHMARKS.items():
        _add_module_command(bench, name, help_text, f"quarl.bench.{name}", f"bench_{name}", f"quarl bench {name}")
    return parser


def main(argv: list[str] | None = None) -> int:
    rank_of_a_run = False  # `quarl train` as one rank under torchrun: ends through end_process, whatever happens
    try:
        args = build_parser().parse_args(argv)
        if args.command == "train":
            from quarl.distributed import launched_by_torchrun

            rank_of_a_run = launched_by_torchrun()
        from quarl.config import ConfigError

        try:
            code = int(args.fn(args) or 0)
        except (ConfigError, FileNotFoundError, ValueError, ImportError) as e:
            print(f"quarl {args.command}: error: {e}", file=sys.stderr)
            code = 2
    except KeyboardInterrupt:  # Ctrl-C while loading, or a second Ctrl-C / SIGTERM during training
        print("[quarl] interrupted", file=sys.stderr)
        code = 130
    except Exception:
        if not rank_of_a_run:
            raise
        import traceback

        traceback.print_exc()
        code = 1
    if rank_of_a_run:  # the run's files are closed and its process group left (Trainer.train's finally)
        from quarl.distributed import end_process

        end_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
