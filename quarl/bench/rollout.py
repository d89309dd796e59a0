"""B2 — rollout throughput benchmark (`quarl bench rollout`, BENCHMARKS.md).

Qwen2.5-architecture model with seeded random weights built in bf16 directly on the GPU (throughput does not
depend on the values); workload 64 prompts x 8 samples, 256 random prompt tokens, 1024 new tokens, EOS ignored,
temperature 1, through `quarl.rollout.fast_engine.FastRolloutEngine`. For each setting (rollout precision x KV
cache dtype; quantized precisions via `apply_precision(PrecisionConfig(flow="split", format=...))`) one warm-up
call (graph capture, kernel compilation) is followed by `--repeats` timed calls (median reported).

Reported: output tokens/s (all generated tokens / wall time of the call, prefill included), decode tokens/s,
prefill time (CUDA events), peak GPU memory of the timed call, and % of the roofline: per decode step, bytes =
rollout weights read (lm_head included; quantized codes + scales where quantized) + KV cache read at the current
context, FLOPs = 2 * linear params * batch; roofline time = sum over steps of max(bytes / bandwidth,
FLOPs / rate) + prefill of the unique prompt tokens at the matrix rate. Bandwidth (1 GiB device copy) and bf16
matrix rate (8192^3 matmul) are measured in the same run; W8A8 formats (int8, fp8, fp8-block) get 2x the bf16
rate, weight-only nvfp4 the bf16 rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

from quarl.bench import add_output_arguments, append_entry, bench_command, bench_main

PRECISIONS = ("bf16", "int8", "fp8", "fp8-block", "nvfp4")
KV_CACHES = ("auto", "fp8", "fp8-token")  # = quarl.precision.KV_CACHE_FORMATS (this module imports no torch)
SAMPLERS = ("inverse-cdf", "gumbel")  # = quarl.config.SAMPLERS, likewise
W8A8 = ("int8", "fp8", "fp8-block", "fp8-tensor")
HEAD_SUFFIX = "+head"  # "fp8+head": lm_head quantized as well (it stays bf16 otherwise)
DEFAULT_SETTINGS = ("bf16:auto", "bf16:fp8", "int8:auto", "fp8:auto", "fp8-block:auto", "nvfp4:auto", "int8:fp8",
                    "fp8:fp8", "fp8-block:fp8", "nvfp4:fp8")
DEFAULT_RESULTS = os.path.join("bench", "results", "rollout.md")
TARGETS = ("bf16 >= 12,000 output tok/s; best low-precision >= 1.6x bf16; moonshot >= 50% of roofline in every "
           "precision")

# Qwen2.5 shapes (config.json of the released checkpoints); qkv bias, no o_proj bias, rope theta 1e6.
MODEL_SIZES = {
    "72b": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_layers=80, num_heads=64,
                num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64, num_heads=40,
                num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_layers=48, num_heads=40,
                num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
               num_kv_heads=4, head_dim=128, tie_word_embeddings=False),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                 num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16,
               num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                 num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
}


# Qwen3-30B-A3B (config.json of the released checkpoint): 48 layers, each a sparse MoE block of 128 experts of width
# 768 with top-8 routing (renormalised); q/k norms, no attention bias. Built with random weights like the others.
MODEL_SIZES["30b-a3b"] = dict(
    architecture="qwen3_moe", attention_bias=False, attention_out_bias=False, qk_norm=True, vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
    tie_word_embeddings=False, max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True)


# SmolLM2-135M-Instruct's shapes (the B6 model; Llama: no attention bias, hidden 576, MLP 1536, 9 heads of 64, 3 KV
# heads), so its step can be timed with random weights where the GGUF is not at hand.
MODEL_SIZES["135m"] = dict(
    architecture="llama", attention_bias=False, vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=1e5,
    rms_norm_eps=1e-5, max_position_embeddings=8192)


def architecture_name(size: str) -> str:
    """The architecture a --model-size names, for results entries: "Qwen2.5-7b", "Qwen3-30B-A3B",
    "SmolLM2-135M (Llama)", "tiny test model"."""
    return {"30b-a3b": "Qwen3-30B-A3B", "135m": "SmolLM2-135M (Llama)", "tiny": "tiny test model"}.get(
        size, f"Qwen2.5-{size}")


def model_config(size: str):
    """The ModelConfig of a size (a key of MODEL_SIZES: a Qwen2.5 size such as "7b", "30b-a3b" for the
    Qwen3-30B-A3B mixture of experts, or "135m" for SmolLM2-135M's Llama shapes)."""
    from quarl.model.config import ModelConfig

    if size not in MODEL_SIZES:
        raise ValueError(f"--model-size {size!r} is unknown; choose one of {', '.join(MODEL_SIZES)}")
    qwen25 = dict(architecture="qwen2", attention_bias=True)
    return ModelConfig(**{**qwen25, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                          "eos_token_ids": [151643, 151645], **MODEL_SIZES[size]})


def build_model(size: str, device: str = "cuda", seed: int = 0, std: float = 0.02, precision=None):
    """A QuarlForCausalLM of `size` with N(0, std) weights, bf16, built on `device` without a float32 copy.

    precision: a qlora PrecisionConfig quantizes each linear's base as it is built (QuarlForCausalLM.materialize),
    so models whose bf16 weights exceed the GPU (72B) can be built; other precisions are applied later by the
    caller (apply_precision), as before.
    """
    import torch

    from quarl.model.decoder import QuarlForCausalLM

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = QuarlForCausalLM(model_config(size), init_std=None)
    model = model.to(torch.bfloat16)
    model.materialize(device, std, precision)
    return model.eval().requires_grad_(False)


def parameter_count(size: str) -> int:
    """Parameters of the `size` architecture (tied embeddings counted once), from its shapes."""
    c = model_config(size)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    attention += (q + 2 * kv) * c.attention_bias + c.hidden_size * c.attention_out_bias + 2 * c.head_dim * c.qk_norm
    dense = 3 * c.hidden_size * c.intermediate_size
    sparse = c.num_experts * (c.hidden_size + 3 * c.hidden_size * c.moe_intermediate_size)  # router + experts
    moe = len(c.moe_layers)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_layers * (attention + 2 * c.hidden_size) + moe * sparse + (c.num_layers - moe) * dense + \
        embeddings + c.hidden_size


def _deferred_choice(text: str):
    """--deferred-scales: "all" -> True, "none" -> False, else a tuple of the decoder's linear names."""
    from quarl.rollout.fused_decode import DEFERRABLE

    if text in ("all", "none"):
        return text == "all"
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or set(names) - set(DEFERRABLE):
        raise argparse.ArgumentTypeError(f"expected all, none or a comma list of {','.join(DEFERRABLE)}; got {text!r}")
    return names


def add_bench_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quarl bench rollout`."""
    parser.add_argument("--model-size", default="7b",
                        help=f"architecture (Qwen2.5 sizes; 30b-a3b = Qwen3-30B-A3B MoE; 135m = SmolLM2-135M's shapes): "
                             f"{', '.join(MODEL_SIZES)}")
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                        help="comma list of PRECISION:KV (precision in " + ", ".join(PRECISIONS)
                        + f", a quantized one optionally with {HEAD_SUFFIX} to quantize lm_head too; KV "
                        + "|".join(KV_CACHES) + ")")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (group size)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sync-every", type=int, default=16, help="decode steps between host syncs")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per setting (median reported)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; settings that would start after it are skipped (reported as skipped)")
    parser.add_argument("--attention", default="auto", help="decode attention backend: auto | triton | torch")
    parser.add_argument("--deferred-scales", default=None, type=_deferred_choice,
                        help="which FP8 decode GEMMs fed activation codes run with unit per-tensor scales where their "
                             "plan allows (cuBLAS or persistent TMA plans), the next fused kernel applying the scales "
                             "(FusedDecoder.deferred_scales): all, none, or a comma "
                             "list of qkv,o,gate_up,down; default: the decoder's (qkv,o,down)")
    parser.add_argument("--sampler", default=SAMPLERS[0], choices=SAMPLERS,
                        help="temperature sampling: Gumbel-max over a [batch, vocab] uniform tensor per step, or "
                             "inverse CDF with one uniform per sequence (FastRolloutEngine(sampler=...))")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="LoRA adapters of this rank on every decoder linear (nonzero B, so they act), as in a "
                             "LoRA RL step's rollout; 0 = none")
    parser.add_argument("--with", dest="with_paths", default="",
                        help="comma list of optional paths to turn on (names as in `quarl bench step --with`)")
    parser.add_argument("--without", default="", help="comma list of optional paths to turn off (same names)")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead of timed generate calls, time one decode step and its parts (linears, "
                             "attention, sampling) at context prompt-len + max-new-tokens / 2")
    parser.add_argument("--rollout-copy", default="full", choices=("full", "codes-only"),
                        help="full: one bf16 model, each quantized setting adds its rollout copy beside the bf16 "
                             "weights (as the split flow on one process); codes-only: each setting builds the model "
                             "afresh and its quantized linears keep only codes and scales (a many-rank run's rollout "
                             "copy, whose quantized linears always take the quantized kernels), for models whose "
                             "bf16 weights and a quantized copy do not fit together (30b-a3b on 80 GB)")
    add_output_arguments(parser, DEFAULT_RESULTS, "also write the rows to this JSON file")


def parse_settings(text: str) -> list[tuple[str, str]]:
    """'bf16:auto,int8:fp8' -> [("bf16", "auto"), ("int8", "fp8")] (KV defaults to auto; auto, fp8 or
    fp8-token). 'fp8+head:fp8' also quantizes lm_head (precision.quantize_lm_head)."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        prec, _, kv = item.partition(":")
        kv = kv or "auto"
        base = prec.removesuffix(HEAD_SUFFIX)
        if base not in PRECISIONS or kv not in KV_CACHES or prec == "bf16" + HEAD_SUFFIX:
            raise ValueError(f"setting {item!r}: precision must be one of {PRECISIONS} (a quantized one may end in "
                             f"{HEAD_SUFFIX!r} to quantize lm_head too) and KV one of {KV_CACHES}")
        out.append((prec, kv))
    if not out:
        raise ValueError("no settings given (e.g. --settings bf16:auto,fp8:fp8)")
    return out


# ---------------------------------------------------------------- roofline


def linear_bytes_and_params(model) -> tuple[int, int]:
    """(bytes the rollout forward reads for all linears, lm_head included; number of linear weights a token
    multiplies by). In a MoE model a token multiplies by k of the E experts of a layer, so each expert's weights
    count k / E times, while every expert's bytes are read (a decode batch of B tokens routes B * k pairs,
    touching nearly every expert once B * k >> E)."""
    from quarl.model.qlinear import QuantLinear

    c = model.config
    active = c.num_experts_per_tok / c.num_experts if c.num_experts else 1.0
    nbytes = params = 0
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        params += m.in_features * m.out_features * (active if ".experts." in name else 1.0)
        if m.rollout_format is not None and m.qweight_data is not None:
            parts = (m.qweight_data, m.qweight_scale, m.qweight_global_scale)
            nbytes += sum(t.numel() * t.element_size() for t in parts if t is not None)
        else:
            nbytes += m.weight.numel() * m.weight.element_size()
        if m.bias is not None:
            nbytes += m.bias.numel() * m.bias.element_size()
    return nbytes, round(params)


def kv_bytes_per_element(kv: str, head_dim: int, model_itemsize: int) -> float:
    """Bytes the decode attention reads per cached key/value element: the model dtype's size ("auto"), 1 (FP8),
    or 1 plus the float32 per-token scale spread over head_dim elements ("fp8-token")."""
    return {"auto": float(model_itemsize), "fp8": 1.0, "fp8-token": 1.0 + 4.0 / head_dim}[kv]


def roofline_seconds(weight_bytes: int, params: int, cfg, batch: int, prompt_len: int, new_tokens: int,
                     unique_prompt_tokens: int, kv_bytes_per_elem: float, bandwidth: float, rate: float) -> float:
    """BENCHMARKS.md B2 roofline: sum over decode steps of max(bytes / bw, flops / rate) + prefill at `rate`.

    Step j (0-based) reads the weights and the KV cache of prompt_len + j columns for every sequence.
    """
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes_per_elem
    flops_step = 2.0 * params * batch
    total = 0.0
    for j in range(new_tokens):
        step_bytes = weight_bytes + batch * (prompt_len + j) * kv_per_token
        total += max(step_bytes / bandwidth, flops_step / rate)
    return total + 2.0 * params * unique_prompt_tokens / rate


# ---------------------------------------------------------------- run


def _sync_time(torch) -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def configure_precision(model, prec: str, lora_rank: int = 0) -> str:
    """Put `model` in setting precision `prec` ("bf16", "fp8", "fp8+head", ...), with LoRA adapters of
    `lora_rank` on every decoder linear (B drawn N(0, 0.02^2), so they act); returns the format without the
    lm_head suffix. Settings run one after another on one model, so lm_head goes back to bf16 when the setting
    does not quantize it (apply_precision itself leaves lm_head alone)."""
    import torch

    from quarl.model.precision_apply import apply_precision, base_settings
    from quarl.precision import LoraConfig, PrecisionConfig

    base, head = prec.removesuffix(HEAD_SUFFIX), prec.endswith(HEAD_SUFFIX)
    lora = LoraConfig(rank=lora_rank)
    pc = PrecisionConfig(flow="bf16", lora=lora) if base == "bf16" else PrecisionConfig(
        flow="split", format=base, quantize_lm_head=head, lora=lora)
    apply_precision(model, pc)
    if not head and model.lm_head.rollout_format is not None:
        model.lm_head.configure(**base_settings(PrecisionConfig(flow="bf16")))
    if lora_rank:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0, 0.02)
    return base


def keep_codes_only(model, prec: str) -> str:
    """Put the bf16 `model` in setting precision `prec` as a rollout-only copy: every linear the split flow quantizes
    is quantized as a frozen base and its bf16 weight freed, one linear at a time (the form of a many-rank run's
    rollout copy, `quarl.rl.sharding.make_rollout_copy`), so peak memory is the bf16 model plus one linear's codes.
    Returns the format without the lm_head suffix. The model cannot go back to bf16: build a fresh one."""
    from quarl.model.precision_apply import base_settings, wants_quantization
    from quarl.model.qlinear import QuantLinear
    from quarl.precision import PrecisionConfig

    base = prec.removesuffix(HEAD_SUFFIX)
    if base == "bf16":
        return base
    pc = PrecisionConfig(flow="split", format=base, quantize_lm_head=prec.endswith(HEAD_SUFFIX))
    settings = dict(base_settings(pc), frozen_base=True, train_format=None, quantized_backward=False)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and wants_quantization(name, pc):
            module.configure(**settings)
    return base


def run_setting(torch, model, prec: str, kv: str, args, prompts, bw: float, rate: float, cfg) -> dict:
    """Configure `model` for `prec` (unless --rollout-copy codes-only built it so), warm up, time `args.repeats`
    generate calls; returns one result row."""
    from quarl.rollout.fast_engine import FastRolloutEngine

    t_setup = time.perf_counter()
    if getattr(args, "rollout_copy", "full") == "codes-only":
        base = prec.removesuffix(HEAD_SUFFIX)
    else:
        base = configure_precision(model, prec, getattr(args, "lora_rank", 0))
    batch = args.prompts * args.samples
    engine = FastRolloutEngine(model, None, max_batch_size=batch,
                               max_seq_len=args.prompt_len + args.max_new_tokens - 1, kv_cache_dtype=kv,
                               sync_every=args.sync_every, attention_backend=args.attention,
                               sampler=getattr(args, "sampler", "inverse-cdf"), fast_paths=model.fast_paths)
    if engine._decoder is not None and getattr(args, "deferred_scales", None) is not None:
        engine._decoder.deferred_scales = args.deferred_scales
    gen_kw = dict(n=args.samples, temperature=args.temperature, ignore_eos=True)
    engine.generate(prompts, max_new_tokens=min(args.max_new_tokens, 2 * args.sync_every), seed=args.seed, **gen_kw)
    warm = dict(engine.last_stats)
    setup_s = _sync_time(torch) - t_setup
    if getattr(args, "breakdown", False):
        from quarl.bench.rollout_breakdown import step_breakdown
        from quarl.rollout.sampling import SamplingParams

        b = step_breakdown(torch, engine, model, batch, args.prompt_len + args.max_new_tokens // 2,
                           SamplingParams(args.temperature), bw, rate * (2 if base in W8A8 else 1))
        del engine
        return dict(precision=prec, kv_cache=kv, breakdown=b, setup_s=setup_s)
    totals, stats = [], []
    torch.cuda.reset_peak_memory_stats()
    for r in range(args.repeats):
        t0 = _sync_time(torch)
        outs = engine.generate(prompts, max_new_tokens=args.max_new_tokens, seed=args.seed + 1 + r, **gen_kw)
        totals.append(_sync_time(torch) - t0)
        stats.append(dict(engine.last_stats))
    peak = torch.cuda.max_memory_allocated()
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    expected = batch * args.max_new_tokens
    total = statistics.median(totals)
    prefill = statistics.median(s["prefill_s"] for s in stats)
    weight_bytes, params = linear_bytes_and_params(model)
    kv_elem = kv_bytes_per_element(kv, cfg.head_dim, model.dtype.itemsize)
    prec_rate = rate * (2 if base in W8A8 else 1)
    roof = roofline_seconds(weight_bytes, params, cfg, batch, args.prompt_len, args.max_new_tokens,
                            args.prompts * args.prompt_len, kv_elem, bw, prec_rate)
    row = dict(precision=prec, kv_cache=kv, tokens=tokens, expected_tokens=expected, total_s=total,
               all_totals_s=totals, prefill_s=prefill, output_tok_s=tokens / total,
               decode_tok_s=tokens / max(total - prefill, 1e-9), peak_gib=peak / 2**30, roofline_s=roof,
               roofline_pct=100.0 * roof / total, weight_gb=weight_bytes / 1e9, setup_s=setup_s,
               warmup_captures=warm.get("graph_captures"), warmup_capture_s=warm.get("capture_s"),
               timed_captures=stats[-1].get("graph_captures"), attention=stats[-1].get("attention"),
               decode_steps=stats[-1].get("decode_steps"))
    del engine, outs
    return row


def _format_row(r: dict, bf16_tok_s: float | None) -> str:
    if "breakdown" in r:
        from quarl.bench.rollout_breakdown import format_breakdown

        return f"- {r['precision']} / KV {r['kv_cache']}: {format_breakdown(r['breakdown'])}"
    if "error" in r or "skipped" in r:
        why = r.get("error") or r.get("skipped")
        return f"| {r['precision']} | {r['kv_cache']} | - | - | - | - | - | - | - | - | {why} |"
    vs = f"{r['output_tok_s'] / bf16_tok_s:.2f}x" if bf16_tok_s else "-"
    note = "" if r["tokens"] == r["expected_tokens"] else f"{r['tokens']} of {r['expected_tokens']} tokens"
    if r.get("timed_captures"):
        note += f" {r['timed_captures']} graph captures in timed call"
    return (f"| {r['precision']} | {r['kv_cache']} | {r['output_tok_s']:,.0f} | {r['decode_tok_s']:,.0f} | "
            f"{r['prefill_s']:.2f} | {r['total_s']:.2f} | {r['peak_gib']:.1f} | {r['roofline_s']:.2f} | "
            f"{r['roofline_pct']:.0f}% | {vs} | {r['attention']} {note}|")


HEADER = ("| precision | KV cache | output tok/s | decode tok/s | prefill (s) | total (s) | peak mem (GiB) | "
          "roofline (s) | % roofline | vs bf16 | attention / notes |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def run_bench_rollout(args) -> int:
    """Run B2 as configured by `add_bench_rollout_arguments`; prints rows as they finish. Returns 0 (2 = no GPU)."""
    import torch

    if not torch.cuda.is_available():
        print("quarl bench rollout needs a CUDA GPU", file=sys.stderr)
        return 2
    from quarl.bench.step import path_settings
    from quarl.fast_paths import FastPaths

    settings = parse_settings(args.settings)
    cfg = model_config(args.model_size)
    for name in ("prompts", "samples", "prompt_len", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0, got {args.lora_rank}")
    codes_only = args.rollout_copy == "codes-only"
    if codes_only and args.lora_rank:
        raise ValueError("--rollout-copy codes-only measures the base model's rollout; drop --lora-rank")
    paths = FastPaths(**path_settings(args.with_paths, args.without))
    from quarl.bench.gemm import measure_ceilings

    t_start = time.perf_counter()
    bw, rate = measure_ceilings(torch)
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    model = build_model(args.model_size, "cuda", args.seed)
    model.set_fast_paths(paths)  # its prefill's RoPE, and the engine's decode paths (run_setting)
    print(f"model {args.model_size}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, built in "
          f"{time.perf_counter() - t_start:.1f} s", flush=True)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
    if not args.breakdown:
        print(HEADER, flush=True)
    rows, bf16_tok_s, last_duration = [], None, 0.0
    bf16_weights = True  # --rollout-copy codes-only: whether the model still holds its bf16 weights
    for prec, kv in settings:
        elapsed = time.perf_counter() - t_start
        if args.time_budget is not None and elapsed + last_duration > args.time_budget:
            rows.append(dict(precision=prec, kv_cache=kv, skipped=f"skipped (time budget {args.time_budget:.0f} s)"))
            print(_format_row(rows[-1], bf16_tok_s), flush=True)
            continue
        t0 = time.perf_counter()
        try:
            if codes_only and not bf16_weights:  # a quantized copy cannot go back to bf16: the same weights again
                model = None
                gc.collect()
                torch.cuda.empty_cache()
                model = build_model(args.model_size, "cuda", args.seed)
                model.set_fast_paths(paths)
                bf16_weights = True
            if codes_only and prec.removesuffix(HEAD_SUFFIX) != "bf16":
                bf16_weights = False  # before quantizing: a failure part-way leaves some linears quantized
                keep_codes_only(model, prec)
            row = run_setting(torch, model, prec, kv, args, prompts, bw, rate, cfg)
        except Exception as e:  # report and go on: one failing format must not hide the others
            traceback.print_exc()
            row = dict(precision=prec, kv_cache=kv, error=f"error: {type(e).__name__}: {str(e)[:200]}")
        last_duration = time.perf_counter() - t0
        gc.collect()
        torch.cuda.empty_cache()
        if prec == "bf16" and kv == "auto" and "output_tok_s" in row:
            bf16_tok_s = row["output_tok_s"]
        rows.append(row)
        print(_format_row(row, bf16_tok_s), f"({last_duration:.0f} s with setup)", flush=True)
        if args.json:  # rewritten after every setting: a run cut short keeps what it measured
            _write_json(args.json, bw, rate, rows, args)

    if args.breakdown:
        table = "Decode-step breakdown (ms per step; floor = bytes read / copy bandwidth):\n\n" + "\n".join(
            _format_row(r, None) for r in rows)
        summary = ""
    else:
        table = "\n".join([HEADER] + [_format_row(r, bf16_tok_s) for r in rows])
        summary = _summary(rows, bf16_tok_s)
    print("\n" + table + "\n\n" + summary, flush=True)
    if args.json:
        _write_json(args.json, bw, rate, rows, args)
    if not args.no_save:
        _append_results(args.out, bw, rate, args, table, summary)
    return 0


def _write_json(path: str, bw: float, rate: float, rows: list[dict], args) -> None:
    import torch

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(path, "w") as fh:
        json.dump(dict(ceilings=dict(copy_bytes_s=bw, bf16_flops=rate), rows=rows, args=vars(args), **meta), fh,
                  indent=1, default=str)


def _summary(rows: list[dict], bf16_tok_s: float | None) -> str:
    ok = [r for r in rows if "output_tok_s" in r]
    if not ok:
        return "- no setting completed"
    lines = [f"- targets: {TARGETS}"]
    if bf16_tok_s:
        lines.append(f"- bf16: {bf16_tok_s:,.0f} output tok/s ({'MET' if bf16_tok_s >= 12000 else 'missed'} "
                     "12,000)")
        low = [r for r in ok if r["precision"] != "bf16" or r["kv_cache"] != "auto"]
        if low:
            best = max(low, key=lambda r: r["output_tok_s"])
            ratio = best["output_tok_s"] / bf16_tok_s
            lines.append(f"- best low-precision setting: {best['precision']} / KV {best['kv_cache']} "
                         f"{best['output_tok_s']:,.0f} tok/s = {ratio:.2f}x bf16 "
                         f"({'MET' if ratio >= 1.6 else 'missed'} 1.6x)")
    worst = min(ok, key=lambda r: r["roofline_pct"])
    lines.append(f"- lowest % of roofline: {worst['roofline_pct']:.0f}% ({worst['precision']} / KV "
                 f"{worst['kv_cache']}; moonshot 50%)")
    return "\n".join(lines)


def _append_results(path: str, bw: float, rate: float, args, table: str, summary: str) -> None:
    facts = [f"workload: {architecture_name(args.model_size)} architecture, {args.prompts} prompts x {args.samples} samples, "
             f"{args.prompt_len} prompt tokens, {args.max_new_tokens} new tokens, temperature {args.temperature}, "
             f"sync every {args.sync_every} steps, {args.repeats} timed call(s) per setting"
             + (f", LoRA rank {args.lora_rank} on every decoder linear" if args.lora_rank else ""),
             f"ceilings measured in this run: copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul "
             f"{rate / 1e12:.0f} TFLOP/s (W8A8 roofline: 2x)"]
    if args.with_paths or args.without:
        facts.append(f"optional paths: on {args.with_paths or '-'}; off {args.without or '-'}")
    append_entry(path, "B2 — rollout throughput (`quarl bench rollout`)",
                 "Appended by `quarl bench rollout`; newest last. Random-weight Qwen2.5 architecture, "
                 "FastRolloutEngine, EOS ignored.", bench_command(args, "rollout"), facts, table + "\n\n" + summary)


def main(argv: list[str] | None = None) -> int:
    return bench_main("rollout", __doc__, add_bench_rollout_arguments, run_bench_rollout, argv)


if __name__ == "__main__":
    sys.exit(main())
