"""`quarl generate`: sample completions from a model in any rollout precision and print them."""

from __future__ import annotations

import argparse
import sys
import time

from quarl.devices import resolve_device, set_cpu_threads
from quarl.config import SAMPLERS
from quarl.precision import KV_CACHE_FORMATS, QUANT_FORMATS

PRECISIONS = ("bf16", *QUANT_FORMATS)
ENGINES = ("auto", "fast", "reference")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--engine, --kv-cache and --sampler (shared by `quarl generate` and `quarl eval`)."""
    parser.add_argument("--engine", default="auto", choices=ENGINES,
                        help="rollout engine: fast (slot KV cache, CUDA graphs on a GPU), reference (plain "
                             "PyTorch); auto = fast on a GPU or with an FP8 KV cache, else reference")
    parser.add_argument("--kv-cache", default="auto", choices=KV_CACHE_FORMATS,
                        help="KV cache of the fast engine: auto (the model dtype), fp8 (E4M3, scale 1), fp8-token "
                             "(E4M3, a scale per token and kv head)")
    parser.add_argument("--sampler", default=None, choices=SAMPLERS,
                        help="temperature draws of the fast engine: inverse-cdf (its default; one uniform per "
                             "sequence) or gumbel (Gumbel-max: the reference engine's draws for the same seed)")


def make_engine(model, tokenizer, engine: str, kv_cache: str, max_sequences: int, group_size: int = 1,
                sampler: str | None = None):
    """The rollout engine for a CLI run of `max_sequences` sequences in groups of `group_size` (completions per
    prompt). The fast engine gets min(max_sequences, 512 on a GPU / 64 on a CPU) slots, at least one group: the
    rest wait in its queue. sampler: the fast engine's (None = its default)."""
    from quarl.rollout.engine import RolloutEngine
    from quarl.rollout.fast_engine import FastRolloutEngine

    if engine not in ENGINES or kv_cache not in KV_CACHE_FORMATS:
        raise ValueError(f"--engine {engine!r} / --kv-cache {kv_cache!r}: choose from {ENGINES} / {KV_CACHE_FORMATS}")
    if engine == "auto":
        engine = "fast" if model.device.type == "cuda" or kv_cache != "auto" else "reference"
    if engine == "reference":
        if kv_cache != "auto":
            raise ValueError(f"--kv-cache {kv_cache} is a fast-engine cache; use --engine fast (or auto)")
        if sampler is not None:
            raise ValueError(f"--sampler {sampler} is a fast-engine option (the reference engine draws by "
                             "Gumbel-max); use --engine fast, or leave --sampler out")
        return RolloutEngine(model, tokenizer)
    limit = 512 if model.device.type == "cuda" else 64  # a CPU cache of 512 slots would take gigabytes
    slots = max(group_size, min(limit, max_sequences), 1)
    return FastRolloutEngine(model, tokenizer, max_batch_size=slots, kv_cache_dtype=kv_cache,
                             **({} if sampler is None else {"sampler": sampler}))


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `quarl generate` to `parser`."""
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="HF directory, hub id, .gguf file, or smollm2-135m-instruct (default)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --model (a directory or hub repo)")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat the option for several prompts)")
    parser.add_argument("--system", default=None, help="system message for the chat template")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS,
                        help="rollout precision: bf16 = full precision, else the split flow with this format")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap the prompt in the model's chat template (default on)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    add_engine_arguments(parser)


def precision_config(name: str):
    """The PrecisionConfig of a --precision choice: bf16 -> flow bf16, a format -> flow split with it."""
    from quarl.precision import PrecisionConfig

    if name not in PRECISIONS:
        raise ValueError(f"--precision {name!r} is unknown; choose one of {PRECISIONS}")
    if name == "bf16":
        return PrecisionConfig(flow="bf16").validate()
    return PrecisionConfig(flow="split", format=name).validate()


def run_generate(args: argparse.Namespace) -> int:
    """Load the model, apply the precision, generate, print. Returns the exit code (0 on success)."""
    from quarl.model.loading import load_model
    from quarl.model.tokenizer import apply_chat

    device = resolve_device(args.device)
    set_cpu_threads(device)
    precision = precision_config(args.precision)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=device, dtype=precision.torch_dtype(device),
                                  gguf_file=args.gguf_file, revision=args.revision)
    if precision.flow != "bf16":
        try:
            from quarl.model.precision_apply import apply_precision
        except ImportError as err:
            raise ValueError(f"--precision {args.precision} needs quarl.model.precision_apply ({err})") from err
        configured = apply_precision(model, precision)
        print(f"[quarl] {args.precision} rollout on {len(configured)} linear layers", file=sys.stderr)
    print(f"[quarl] loaded {args.model} on {device} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    prompts = [apply_chat(tokenizer, p, system=args.system) if args.chat else p for p in args.prompt]
    engine = make_engine(model, tokenizer, args.engine, args.kv_cache, len(prompts) * args.n, args.n, args.sampler)
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, stop=args.stop, seed=args.seed)
    elapsed = time.perf_counter() - t0
    tokens = 0
    for i, (text, out) in enumerate(zip(args.prompt, outputs)):
        print(f"=== prompt {i}: {text}")
        for j, c in enumerate(out.completions):
            tokens += len(c.token_ids)
            mean_lp = sum(c.logprobs) / max(len(c.logprobs), 1)
            print(f"--- completion {j} ({len(c.token_ids)} tokens, {c.finish_reason}, mean logprob {mean_lp:.3f})")
            print(c.text)
    print(f"[quarl] {tokens} tokens in {elapsed:.2f}s ({tokens / max(elapsed, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0
