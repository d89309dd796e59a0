"""Held-out evaluation: accuracy (greedy or sampled), avg@k and pass@k over a list of examples."""

from __future__ import annotations

import inspect
import time
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _takes_progress(engine) -> bool:
    try:
        return "progress" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def evaluate(engine, task, examples, *, n: int = 1, temperature: float = 0.0, max_new_tokens: int = 256,
             seed: int = 0, stop: list[str] | None = None, batch_prompts: int = 64, progress: bool | None = None,
             desc: str = "evaluating", records: list | None = None, first_index: int = 0) -> dict[str, float]:
    """Score `n` answers per example with the task's correctness check (no format bonus).

    Returns {"accuracy": mean reward of the first answer, "avg@n": mean over all answers,
    "pass@n": fraction of problems with at least one correct answer (unbiased), "num_examples": count}
    (`metrics_of_records` of the records).

    progress: a tqdm bar on stderr counting problems (True: always, False: never, None: only on a terminal).
    records: a list that receives one dict per problem: id, prompt (as rendered), gold, completions, scores.
    Sampling: example i of the list draws from its own stream, seeded seed + first_index + i, so a share of a
    larger list (first_index = where it starts) gets the answers it would get in the whole list.
    """
    from tqdm import tqdm

    if not examples:
        raise ValueError("evaluate: no examples to evaluate")
    if n < 1:
        raise ValueError(f"evaluate: n must be >= 1, got {n}")
    if n > 1 and temperature == 0:
        raise ValueError("evaluate: n > 1 needs sampling (temperature > 0); greedy answers would all be equal")
    mine: list[dict] = []  # this call's records
    first = 0.0
    with tqdm(total=len(examples), desc=desc, unit="problem", disable=None if progress is None else not progress,
              dynamic_ncols=True, leave=False) as bar:
        extra = {}
        if not bar.disable and _takes_progress(engine):
            # The engine generates a whole chunk at once: its token count keeps the bar alive within a chunk.
            tokens = [0, time.monotonic()]

            def on_tokens(count: int) -> None:
                tokens[0] += count
                if time.monotonic() - tokens[1] >= 0.5:
                    tokens[1] = time.monotonic()
                    bar.set_postfix_str(f"{tokens[0]} tokens", refresh=True)

            extra["progress"] = on_tokens
        for start in range(0, len(examples), batch_prompts):
            chunk = examples[start : start + batch_prompts]
            prompts = [task.render(ex) for ex in chunk]
            seeds = [seed + first_index + start + i for i in range(len(chunk))]
            outputs = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                                      stop=stop, seeds=seeds, **extra)
            for ex, prompt, out in zip(chunk, prompts, outputs):
                scores = [bool(task.correct(c.text, ex)) for c in out.completions]
                first += scores[0]
                mine.append({"id": ex.id, "prompt": prompt, "gold": ex.gold,
                             "completions": [c.text for c in out.completions],
                             "scores": [float(s) for s in scores], "correct": scores[0]})
            bar.update(len(chunk))
            bar.set_postfix_str(f"accuracy {first / (start + len(chunk)):.3f}", refresh=False)
    if records is not None:
        records.extend(mine)
    return metrics_of_records(mine, n)


def metrics_of_records(records: list[dict], n: int) -> dict[str, float]:
    """{"accuracy", "avg@n", "pass@n", "num_examples"} of `evaluate`'s per-problem records (each with n scores):
    the first answer's mean correctness, the mean over all answers, and the unbiased pass@n."""
    if not records:
        raise ValueError("metrics_of_records: no records")
    m = len(records)
    first = sum(float(r["scores"][0]) for r in records)
    mean_all = sum(sum(r["scores"]) / n for r in records)
    passed = sum(pass_at_k(n, int(sum(r["scores"])), n) for r in records)
    return {"accuracy": first / m, f"avg@{n}": mean_all / m, f"pass@{n}": passed / m, "num_examples": float(m)}
