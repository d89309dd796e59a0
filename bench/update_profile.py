"""Time and profile one micro-batch of the RL update (forward + backward of the answer log-probs) per precision
setting, on a random-weight Qwen2.5 architecture cut to a few layers: where the update's time goes (B3).

    PYTHONPATH=. python3 bench/update_profile.py --model-size 7b --layers 4 --lora-rank 32 --checkpointing

Settings: bf16 (full precision training), unified-qb (unified flow, fp8-block, precision.quantized_backward:
Jet-RL's FP8 forward and gradient GEMMs) and unified-qb-head (lm_head quantized too). The optional paths below
(fields of the model's `quarl.fast_paths.FastPaths`) are off in a setting unless a suffix turns them on (whatever
their defaults): "+rope" the fused training rotary embedding (`fused_rope`), "+lp" the fused answer log-probs
(`fused_logprobs`), "+share" one quantization of the input shared by q/k/v and by gate/up (`share_input_codes`),
"+lorastack" one stacked first LoRA GEMM per group (`stack_lora`, off by default);
"+kv" makes the training attention mimic an FP8 KV cache, as the unified flow does with precision.kv_cache=fp8 (B3's
FP8 setting). E.g. `--settings bf16+rope+lp,unified-qb-head+kv+rope+lp+share`. Prints ms per micro-batch and, with
--top N, the N CUDA kernels with the most total time in one profiled micro-batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from quarl.bench.rollout import model_config
from quarl.fast_paths import FastPaths
from quarl.model import layers
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.precision_apply import apply_precision
from quarl.precision import LoraConfig, PrecisionConfig
from quarl.rl.batch import answer_logprobs

SETTINGS = {
    "bf16": dict(flow="bf16"),
    "unified-qb": dict(flow="unified", format="fp8-block", quantized_backward=True),
    "unified-qb-head": dict(flow="unified", format="fp8-block", quantized_backward=True, quantize_lm_head=True),
}


def setting_paths(setting: str) -> FastPaths:
    """The fast paths of `setting`: each on only where a suffix names it (see the module docstring); the fused
    decode's paths do not enter the update."""
    suffixes = set(setting.split("+")[1:])
    return FastPaths(fused_rope="rope" in suffixes, fused_logprobs="lp" in suffixes,
                     share_input_codes="share" in suffixes, stack_lora="lorastack" in suffixes)


def build(args, setting: str) -> QuarlForCausalLM:
    """A cut-down random-weight model configured for `setting` (its name before any "+" suffix, its fast paths
    from the suffixes)."""
    cfg = dataclasses.replace(model_config(args.model_size), num_layers=args.layers)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = QuarlForCausalLM(cfg, init_std=None, fast_paths=setting_paths(setting))
    model = model.to(torch.bfloat16)
    model.materialize(args.device, 0.02, None)
    model.requires_grad_(True)
    precision = PrecisionConfig(**SETTINGS[setting.split("+")[0]], lora=LoraConfig(rank=args.lora_rank))
    apply_precision(model, precision)
    if "kv" in setting.split("+")[1:]:
        for module in model.modules():
            if isinstance(module, layers.Attention):
                module.kv_quant = "fp8"  # as the trainer sets it for the unified flow with an FP8 KV cache
    model.gradient_checkpointing = args.checkpointing
    return model.train()


def micro_batch(model, ids, mask, width):
    """Forward and backward of the answer log-probs of ids [rows, T] (every answer `width` tokens long)."""
    lengths = torch.full((ids.shape[0],), width, dtype=torch.long)
    logprobs, _ = answer_logprobs(model, ids, mask, 1.0, width, answer_lengths=lengths)
    logprobs.mean().backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-size", default="7b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--rows", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--answer-len", type=int, default=1024)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--settings", default="bf16,unified-qb")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--top", type=int, default=0, help="profile one micro-batch and print its top N kernels")
    p.add_argument("--profile-out", default=None, help="write the kernel tables to this file instead of stdout")
    args = p.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"GPU: {name}; torch {torch.__version__}; {args.model_size} cut to {args.layers} "
          f"layers, LoRA rank {args.lora_rank}, {args.rows} x {args.prompt_len + args.answer_len} tokens, "
          f"checkpointing {args.checkpointing}")
    times = {}
    for setting in args.settings.split(","):
        model = build(args, setting)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (args.rows, args.prompt_len + args.answer_len), device=args.device)
        mask = torch.ones_like(ids)
        for _ in range(2):
            micro_batch(model, ids, mask, args.answer_len)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            micro_batch(model, ids, mask, args.answer_len)
        sync()
        times[setting] = (time.perf_counter() - t0) / args.iters * 1e3
        print(f"{setting}: {times[setting]:.1f} ms per micro-batch", flush=True)
        if args.top:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                micro_batch(model, ids, mask, args.answer_len)
                sync()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=90)
            if args.profile_out:
                with open(args.profile_out, "a") as f:
                    f.write(f"## {setting}: {times[setting]:.1f} ms per micro-batch\n{table}\n")
            else:
                print(table)
        del model
        torch.cuda.empty_cache()
    base = times.get("bf16")
    if base:
        for s, t in times.items():
            print(f"| {s} | {t:.1f} ms | {base / t:.2f}x |")


if __name__ == "__main__":
    main()
