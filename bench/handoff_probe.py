"""Does handing FP8 codes to the small-M W8A8 plans change the fused decoder's logits by more than rounding?

One decode step of a small random fp8 model (3 layers) at a few batch sizes: the mean |fused - module path| of the
logits with the codes handoff as shipped (TMA and cuBLAS plans only) and with it extended to every prequant W8A8
plan (the small-M transposed tiles), against how far the module path's own logits move when the embeddings are
perturbed by one relative bf16 rounding (2^-9). A misapplied scale or a wrong code would move them by the
activations' size, far beyond that.

    PYTHONPATH=.:tests python3 bench/handoff_probe.py
"""

from __future__ import annotations

import torch
from quarl import kernels
from quarl.model.precision_apply import apply_precision
from quarl.precision import PrecisionConfig
from quarl.rollout.fast_engine import FastRolloutEngine
from quarl.rollout.fused_decode import both_decode_logits
from tiny_models import small_qwen2


def mean_gap(a, b) -> float:
    return float((a.float() - b.float()).abs().mean())


def main() -> None:
    torch.manual_seed(0)
    model = small_qwen2(vocab_size=4096, num_layers=3, device="cuda")
    apply_precision(model, PrecisionConfig(flow="split", format="fp8"))
    engine = FastRolloutEngine(model, None, max_batch_size=64)
    engine.generate([[1, 2, 3, 4]] * 8, n=1, max_new_tokens=4, temperature=0.0)  # allocates the cache
    shipped = kernels._takes_rowwise_codes
    extended = lambda plan: plan.kind == "w8a8" and plan.x_mode == "prequant"  # noqa: E731
    print("| rows | handoff | mean |fused - module| | argmax agree | perturbation baseline |")
    print("|---:|---|---:|---:|---:|")
    for batch in (3, 12, 16, 40, 64):
        torch.manual_seed(batch)
        tokens = torch.randint(0, 4096, (batch,), device="cuda")
        positions = torch.randint(0, 60, (batch,), device="cuda")
        emb = model.model.embed_tokens.weight
        saved = emb.detach().clone()
        want, _ = both_decode_logits(model, engine, tokens, positions)
        with torch.no_grad():
            emb.copy_((emb.float() * (1 + 2.0**-9 * torch.randn_like(emb, dtype=torch.float32))).to(emb.dtype))
        perturbed, _ = both_decode_logits(model, engine, tokens, positions)
        with torch.no_grad():
            emb.copy_(saved)
        baseline = mean_gap(perturbed, want)
        for name, rule in (("shipped", shipped), ("extended", extended)):
            kernels._takes_rowwise_codes = rule
            try:
                want, got = both_decode_logits(model, engine, tokens, positions)
            finally:
                kernels._takes_rowwise_codes = shipped
            agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
            print(f"| {batch} | {name} | {mean_gap(got, want):.3e} | {agree:.2f} | {baseline:.3e} |")


if __name__ == "__main__":
    main()
