"""Held-out evaluation: accuracy (greedy or sampled), avg@k and pass@k over a list of examples."""

from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(engine, task, examples, *, n: int = 1, temperature: float = 0.0, max_new_tokens: int = 256,
             seed: int = 0, stop: list[str] | None = None, batch_prompts: int = 64) -> dict[str, float]:
    """Score `n` answers per example with the task's correctness check (no format bonus).

    Returns {"accuracy": mean reward of the first answer, "avg@n": mean over all answers,
    "pass@n": fraction of problems with at least one correct answer (unbiased), "num_examples": count}.
    """
    if not examples:
        raise ValueError("evaluate: no examples to evaluate")
    if n < 1:
        raise ValueError(f"evaluate: n must be >= 1, got {n}")
    if n > 1 and temperature == 0:
        raise ValueError("evaluate: n > 1 needs sampling (temperature > 0); greedy answers would all be equal")
    first, mean_all, passed = 0.0, 0.0, 0.0
    for start in range(0, len(examples), batch_prompts):
        chunk = examples[start : start + batch_prompts]
        outputs = engine.generate([task.render(ex) for ex in chunk], n=n, max_new_tokens=max_new_tokens,
                                  temperature=temperature, stop=stop, seed=seed + start)
        for ex, out in zip(chunk, outputs):
            scores = [task.correct(c.text, ex) for c in out.completions]
            first += scores[0]
            mean_all += sum(scores) / n
            passed += pass_at_k(n, sum(scores), n)
    m = len(examples)
    return {"accuracy": first / m, f"avg@{n}": mean_all / m, f"pass@{n}": passed / m, "num_examples": float(m)}
