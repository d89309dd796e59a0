"""Rollout/training mismatch of each number format on a model, before any training (`quarl bench mismatch`).

Which rollout format suits this model? The run config (its model, data and rollout settings) gives held-out
prompts; the model in full precision samples one answer to each at the rollout temperature (reference engine);
then, for every format and activation setting asked for, the same model's split-flow rollout copy scores the
same tokens. Per answer token, the exact KL(mu || pi) = sum_v mu(v) (log mu(v) - log pi(v)) over the vocabulary,
with mu the rollout model's and pi the full-precision model's next-token distribution at the rollout temperature
(top-p / top-k not applied): close to what a training run's first steps log as `mismatch/kl`, which estimates the
same divergence from the rollout model's own samples. Also the share of
answer tokens where both models' most likely next token agree.

Large values mean a rollout policy far from the trained one (BRIEF §4): more truncated importance weights, slower
learning (bench/results/quality.md). W8A8 rows quantize activations per token as the rollout does; weight-only
rows (W8A16, W4A16) keep activations in the compute dtype, which on small models with activation outliers is
often most of the difference. W8A8 rows are unsmoothed unless --smooth-alpha adds smoothed ones; an int8 training
run smooths by default (`precision.smooth_alpha`).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from quarl.bench import add_output_arguments, append_entry, bench_command, bench_main

DEFAULT_RESULTS = os.path.join("bench", "results", "mismatch.md")
DEFAULT_FORMATS = "int8,fp8,fp8-block,nvfp4,mxfp4"
ACTIVATIONS = ("quantized", "weight-only")


def add_bench_mismatch_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `quarl bench mismatch`."""
    parser.add_argument("config", nargs="?", help="run config YAML (default: the built-in defaults, i.e. the "
                                                  "embedded SmolLM2-135M-Instruct on the arithmetic task)")
    parser.add_argument("overrides", nargs="*", help="dotted run-config overrides, e.g. data.train=gsm8k")
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help=f"comma list of rollout formats ({DEFAULT_FORMATS}, "
                                                                   "fp8-tensor)")
    parser.add_argument("--activations", default="both", choices=["both", *ACTIVATIONS],
                        help="quantized (W8A8 as the rollout runs it), weight-only (W8A16 / W4A16), or both; "
                             "formats that exist only weight-only (fp4) get that row alone")
    parser.add_argument("--problems", type=int, default=64, help="held-out prompts (one sampled answer each)")
    parser.add_argument("--smooth-alpha", type=float, default=0.0,
                        help="also measure each W8A8 setting with SmoothQuant smoothing of this strength in (0, 1) "
                             "(precision.smooth_alpha; calibrated on the first training prompts); 0 = not. The "
                             "plain rows are unsmoothed; an int8 training run smooths by default, so pass 0.5 to "
                             "see the setting it trains with")
    add_output_arguments(parser, DEFAULT_RESULTS)


def parse_formats(text: str) -> list[str]:
    from quarl.precision import QUANT_FORMATS

    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in QUANT_FORMATS]
    if unknown or not names:
        raise ValueError(f"--formats={text!r}: choose a comma list from {', '.join(QUANT_FORMATS)}")
    return names


def settings_to_measure(formats: list[str], activations: str) -> list[tuple[str, bool]]:
    """(format, weight_only) pairs in table order; W4A4 does not exist for the fp4 formats (weight-only only)."""
    from quarl.precision import WEIGHT_ONLY_FORMATS

    modes = ACTIVATIONS if activations == "both" else (activations,)
    pairs = []
    for fmt in formats:
        for mode in modes:
            weight_only = mode == "weight-only"
            if fmt in WEIGHT_ONLY_FORMATS and not weight_only:
                if activations == "quantized":
                    pairs.append((fmt, True))  # the only way this format runs
                continue
            pairs.append((fmt, weight_only))
    return pairs


def answer_batch(prompt_ids: list[list[int]], answer_ids: list[list[int]], pad_id: int, device):
    """Left-padded prompt + answer tokens and the positions that predict answer tokens.

    Returns (ids long [B, L], attention mask long [B, L], predicts bool [B, L]): predicts[b, t] is True where
    position t's next-token distribution is the one answer token t + 1 of row b was drawn from.
    """
    L = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids))
    B = len(prompt_ids)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    predicts = torch.zeros(B, L, dtype=torch.bool)
    for b, (p, a) in enumerate(zip(prompt_ids, answer_ids)):
        start = L - len(p) - len(a)
        ids[b, start:] = torch.tensor(p + a)
        mask[b, start:] = 1
        predicts[b, L - len(a) - 1:L - 1] = True
    return ids.to(device), mask.to(device), predicts.to(device)


@torch.no_grad()
def next_token_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, predicts: torch.Tensor,
                        temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at the `predicts` positions of one micro-batch: float32 [n, vocab]
    (n = predicts.sum()); only those rows are cast to float32."""
    logits = model(ids, attention_mask=mask)[predicts]
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def token_kl(rollout_logp: torch.Tensor, train_logp: torch.Tensor) -> torch.Tensor:
    """KL(mu || pi) per position, float32 [N], from log-probabilities [N, vocab] (mu = rollout, pi = training).
    Terms where mu is 0 contribute 0 (also where pi is 0 there)."""
    mu = rollout_logp.exp()
    diff = torch.where(mu > 0, rollout_logp - train_logp, torch.zeros_like(mu))
    return (mu * diff).sum(-1)


def measure(cfg, pairs: list[tuple[str, bool]], problems: int, seed: int = 0, log=print,
            micro_batch: int = 8, smooth_alpha: float = 0.0) -> dict:
    """Sample the answers in full precision, then score them with each (format, weight_only) rollout copy, and,
    with smooth_alpha > 0, each W8A8 one again with its activations smoothed (`quarl.model.smoothing`).

    Returns {"rows": [{format, weight_only, smooth_alpha, kl_mean, kl_p90, kl_max, top1_agree, seconds}],
    "tokens": N, "answers": B, "mean_answer_tokens": float, "dtype": the models' dtype}.
    """
    from quarl.model.smoothing import CALIBRATION_PROMPTS, calibration_batches, calibration_sequences, smooth_rollout
    from quarl.devices import resolve_device, set_cpu_threads
    from quarl.model.loading import load_model
    from quarl.model.precision_apply import apply_precision, full_precision, rollout_mode
    from quarl.precision import PrecisionConfig
    from quarl.rollout.engine import RolloutEngine
    from quarl.tasks.task import load_task

    if problems < 1:
        raise ValueError(f"--problems={problems} must be >= 1")
    if smooth_alpha:
        PrecisionConfig(flow="split", format="int8", smooth_alpha=smooth_alpha).validate()  # before the slow part
    device = resolve_device(cfg.model.device)
    set_cpu_threads(device)
    dtype = cfg.precision.torch_dtype(device)
    task = load_task(cfg.data, cfg.reward, None, seed=cfg.train.seed)
    model, tokenizer = load_model(cfg.model.name, device=str(device), dtype=dtype, gguf_file=cfg.model.gguf_file,
                                  revision=cfg.model.revision)
    model = model.to(device=device, dtype=dtype).eval()
    task.set_tokenizer(tokenizer)
    examples = task.eval_examples[:problems]
    if not examples:
        raise ValueError("the run config's data has no held-out examples to measure on (set data.eval or "
                         "data.num_eval)")
    r = cfg.rollout
    log(f"[quarl] sampling {len(examples)} answers in full precision (temperature {r.temperature})")
    outputs = RolloutEngine(model, tokenizer).generate(
        [task.render(ex) for ex in examples], n=1, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
        top_p=r.top_p, top_k=r.top_k, stop=r.stop, seed=seed)
    kept = [(o.prompt_token_ids, o.completions[0].token_ids) for o in outputs if o.completions[0].token_ids]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask, predicts = answer_batch([p for p, _ in kept], [a for _, a in kept], pad, device)
    rows = []
    settings = [(fmt, weight_only, 0.0) for fmt, weight_only in pairs]
    settings += [(fmt, False, smooth_alpha) for fmt, weight_only in pairs if smooth_alpha and not weight_only]
    if any(alpha for _, _, alpha in settings):  # as a training run calibrates
        calibration = calibration_sequences(task, tokenizer, CALIBRATION_PROMPTS)
    for fmt, weight_only, alpha in settings:
        t0 = time.perf_counter()
        apply_precision(model, PrecisionConfig(flow="split", format=fmt, weight_only=weight_only,
                                               smooth_alpha=alpha).validate())
        if alpha:
            smooth_rollout(model, calibration_batches(calibration, device), alpha)
        # per micro-batch, both policies over the same tokens: only [tokens] results are kept, never [tokens, vocab]
        kls, agrees = [], []
        for i in range(0, ids.shape[0], micro_batch):
            part = (ids[i:i + micro_batch], mask[i:i + micro_batch], predicts[i:i + micro_batch], r.temperature)
            with full_precision(model):
                train_logp = next_token_logprobs(model, *part)
            with rollout_mode(model):
                rollout_logp = next_token_logprobs(model, *part)
            kls.append(token_kl(rollout_logp, train_logp).cpu())
            agrees.append((rollout_logp.argmax(-1) == train_logp.argmax(-1)).cpu())
        kl, agree = torch.cat(kls), torch.cat(agrees).float().mean().item()
        row = dict(format=fmt, weight_only=weight_only, smooth_alpha=alpha, kl_mean=kl.mean().item(),
                   kl_p90=torch.quantile(kl, 0.9).item(), kl_max=kl.max().item(), top1_agree=agree,
                   seconds=time.perf_counter() - t0)
        rows.append(row)
        log(f"[quarl] {fmt} {_activations_text(row)}: KL {row['kl_mean']:.4f}, top-1 agreement {agree:.3f}")
    return dict(rows=rows, tokens=int(predicts.sum()), answers=len(kept), dtype=str(dtype).replace("torch.", ""),
                mean_answer_tokens=float(predicts.sum()) / max(len(kept), 1))


def _kl_text(x: float) -> str:
    return f"{x:.4f}" if x >= 1e-3 else f"{x:.1e}"


def _activations_text(row: dict) -> str:
    if row["weight_only"]:
        return "weight-only"
    return f"quantized, smoothed (alpha {row['smooth_alpha']})" if row.get("smooth_alpha") else "quantized"


def format_table(result: dict) -> str:
    lines = ["| format | activations | mean KL(mu‖pi) per token | p90 | max | top-1 agreement |",
             "|---|---|---:|---:|---:|---:|"]
    for r in sorted(result["rows"], key=lambda r: r["kl_mean"]):
        act = _activations_text(r)
        lines.append(f"| {r['format']} | {act} | {_kl_text(r['kl_mean'])} | {_kl_text(r['kl_p90'])} | "
                     f"{_kl_text(r['kl_max'])} | {r['top1_agree']:.3f} |")
    return "\n".join(lines)


def run_bench_mismatch(args) -> int:
    from quarl.config import config_and_overrides, load_config

    cfg = load_config(*config_and_overrides(args.config, args.overrides))
    pairs = settings_to_measure(parse_formats(args.formats), args.activations)
    result = measure(cfg, pairs, args.problems, seed=args.seed, smooth_alpha=args.smooth_alpha)
    table = format_table(result)
    print(table)
    if not args.no_save:
        r = cfg.rollout
        facts = [f"model {cfg.model.name}, data {cfg.data.train} (held-out prompts), {result['answers']} answers "
                 f"sampled in full precision at temperature {r.temperature}, max {r.max_new_tokens} new tokens, "
                 f"{result['tokens']} answer tokens; weights and compute in {result['dtype']}"]
        append_entry(args.out, "Rollout/training mismatch per format, before training",
                     "Exact per-token KL(mu || pi) between each split-flow rollout copy (mu) and the full-precision "
                     "model (pi) on answers the full-precision model sampled (quarl/bench/mismatch.py).",
                     bench_command(args, "mismatch"), facts, table)
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("mismatch", __doc__, add_bench_mismatch_arguments, run_bench_mismatch, argv)


if __name__ == "__main__":
    raise SystemExit(main())
