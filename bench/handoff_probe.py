"""The codes handoff at decode batch sizes: exactness on a small model, and the decode step's time on the 7B shapes.

The fused decoder's norm and SiLU·mul kernels can write the next linear's 8-bit activation codes, so the GEMM
skips its own quantization pass (`kernels.codes_handoff`). Two rules are compared:
  restricted  codes only to cuBLAS FP8 and the persistent TMA W8A8 kernel (rollout batches; the rule before
              2026-11-30 session 16);
  shipped     also to every int8 / fp8 W8A8 GEMM and GEMV in prequant mode (the small-M plans), which take the
              codes with their own scales (the unit-scale cuBLAS product stays with cuBLAS / TMA plans).

Part 1, one decode step of a small random model (3 layers): max and mean |fused - module path| of the logits, the
argmax agreement, and how many GEMMs took handed codes. The codes are `quarl.formats`' codes of the kernels' bf16
outputs, so the GEMM sees what it would have quantized itself: the gap must not grow over the restricted rule's.
Part 2, the Qwen2.5-7B architecture (seeded random weights): the engine's captured decode step (ms) at a few
batch sizes with each rule.

    PYTHONPATH=.:tests python3 bench/handoff_probe.py [--formats int8,fp8] [--batches 1,16,64]
"""

from __future__ import annotations

import argparse

import torch

from quarl import kernels
from quarl.model.precision_apply import apply_precision
from quarl.precision import PrecisionConfig
from quarl.rollout.fast_engine import FastRolloutEngine
from quarl.rollout.fused_decode import both_decode_logits


def restricted(fmt, plan) -> bool:
    """The handoff rule before the small-M plans took codes."""
    if plan.kind == "scaled_mm":
        return fmt in ("fp8", "fp8-block")
    return fmt == "fp8" and plan.kind == "w8a8" and plan.x_mode == "prequant" and plan.cfg is not None \
        and plan.cfg.tma and not plan.cfg.swap_ab  # the persistent (prefill) TMA kernel only


RULES = {"restricted": restricted, "shipped": kernels._takes_codes}


def with_rule(name: str, fn):
    kernels._takes_codes = RULES[name]
    try:
        return fn()
    finally:
        kernels._takes_codes = RULES["shipped"]


def exactness(fmt: str, batches: list[int]) -> None:
    from tiny_models import small_qwen2

    torch.manual_seed(0)
    model = small_qwen2(vocab_size=4096, num_layers=3, device="cuda")
    apply_precision(model, PrecisionConfig(flow="split", format=fmt))
    engine = FastRolloutEngine(model, None, max_batch_size=64)
    engine.generate([[1, 2, 3, 4]] * 8, n=1, max_new_tokens=4, temperature=0.0)  # allocates the cache
    real = kernels.matmul_from_codes
    handed = []
    kernels.matmul_from_codes = lambda *a: handed.append(1) or real(*a)
    try:
        for batch in batches:
            torch.manual_seed(batch)
            tokens = torch.randint(0, 4096, (batch,), device="cuda")
            positions = torch.randint(0, 60, (batch,), device="cuda")
            for rule in RULES:
                handed.clear()
                want, got = with_rule(rule, lambda: both_decode_logits(model, engine, tokens, positions))
                gap = (got.float() - want.float()).abs()
                agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
                print(f"| {fmt} | {batch} | {rule} | {len(handed)} | {float(gap.max()):.3e} | {float(gap.mean()):.3e} "
                      f"| {agree:.2f} |")
    finally:
        kernels.matmul_from_codes = real


def decode_step_ms(model, batches: list[int]) -> list[float]:
    """Mean ms of the engine's captured decode step at each batch size (slots mid-generation at 256 columns)."""
    from quarl.rollout.sampling import SamplingParams

    params = SamplingParams(1.0)
    engine = FastRolloutEngine(model, None, max_batch_size=max(batches), max_seq_len=320)
    engine.generate([[1, 2, 3, 4]] * max(batches), n=1, max_new_tokens=4, temperature=1.0)
    st = engine.state
    out = []
    with torch.no_grad():
        model.set_rollout(True)
        try:
            for batch in batches:
                st.slot_len[:batch] = 256
                st.num_generated[:batch] = 0
                st.done[:batch] = False
                st.max_new.fill_(2**40)
                gen = torch.Generator(device="cuda").manual_seed(0)
                kv_len = engine.kv_bound(300)
                for _ in range(3):
                    engine.step(batch, kv_len, params, gen)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(30):
                    engine.step(batch, kv_len, params, gen)
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 30)
        finally:
            model.set_rollout(False)
    return out


def step_times(fmt: str, batches: list[int]) -> None:
    from quarl.bench.rollout import build_model, configure_precision

    model = build_model("7b")
    configure_precision(model, fmt)
    for rule in RULES:
        times = with_rule(rule, lambda m=model: decode_step_ms(m, batches))
        print(f"| {fmt} | {rule} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="int8,fp8")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    formats = args.formats.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    if not args.skip_exactness:
        print("\n| format | rows | rule | GEMMs on handed codes | max abs(fused - module) | mean | argmax agree |")
        print("|---|---:|---|---:|---:|---:|---:|")
        for fmt in formats:
            exactness(fmt, sorted({3, 12, 16, 40, 64, *batches}))
    if not args.skip_timing:
        print("\n| format | rule | " + " | ".join(f"step ms @ {b} rows" for b in batches) + " |")
        print("|---|---|" + "---:|" * len(batches))
        for fmt in formats:
            step_times(fmt, batches)


if __name__ == "__main__":
    main()
