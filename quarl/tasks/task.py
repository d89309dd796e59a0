"""A training task: train/held-out examples, how a question becomes a prompt, and how an answer is scored."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from quarl.tasks.datasets import Example, load_examples
from quarl.tasks.rewards import format_reward, load_reward_function, math_reward, validate_reward_function
from quarl.tasks.synthetic import arithmetic_splits


@dataclass
class TaskData:
    """Examples plus the two functions the trainer needs: `render` (example -> prompt text) and `reward`."""

    train_examples: list[Example]
    eval_examples: list[Example]
    render_fn: Callable[[Example], str]
    reward_fn: Callable[[str, Example], float]
    correct_fn: Callable[[str, Example], float]  # correctness alone (no format bonus): 1 = correct
    seed: int = 0
    _orders: dict = field(default_factory=dict, repr=False)
    _data_cfg: Any = field(default=None, repr=False)  # for set_tokenizer

    def render(self, example: Example) -> str:
        return self.render_fn(example)

    def set_tokenizer(self, tokenizer) -> None:
        """Bind the tokenizer prompts are rendered with: for a task loaded before the model
        (`load_task(data_cfg, reward_cfg, tokenizer=None)`, which checks the data and the reward function early)."""
        if self._data_cfg is None:
            raise ValueError("this TaskData was built without its data config; build it with load_task")
        self.render_fn = make_renderer(self._data_cfg, tokenizer)

    def reward(self, completion: str, example: Example) -> float:
        return float(self.reward_fn(completion, example))

    def correct(self, completion: str, example: Example) -> bool:
        """Held-out scoring: the task's answer check (or user reward) >= 1, without the format bonus."""
        return float(self.correct_fn(completion, example)) >= 1.0

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.train_examples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: batches are requested in order
        return self._orders[epoch]

    def train_batch(self, step: int, attempt: int, size: int) -> list[Example]:
        """Examples for RL step `step`. Attempt 0 walks shuffled epochs (a pure function of step, so a resumed run
        sees the same data); refill attempts (dynamic sampling) draw from a generator seeded by (step, attempt)."""
        n = len(self.train_examples)
        if attempt > 0:
            rng = random.Random((self.seed, step, attempt).__hash__())
            return [self.train_examples[i] for i in rng.sample(range(n), min(size, n))]
        out = []
        for pos in range(step * size, step * size + size):
            epoch, idx = divmod(pos, n)
            out.append(self.train_examples[self._epoch_order(epoch)[idx]])
        return out


def make_renderer(data_cfg, tokenizer) -> Callable[[Example], str]:
    from quarl.model.tokenizer import apply_chat

    template = data_cfg.prompt_template
    if "{prompt}" not in template:
        raise ValueError(f"data.prompt_template must contain {{prompt}}; got {template!r}")

    def render(example: Example) -> str:
        user = template.format(prompt=example.prompt)
        if data_cfg.chat_template:
            if tokenizer is None:
                raise ValueError("the task was loaded without a tokenizer (load_task(..., tokenizer=None)); call "
                                 "task.set_tokenizer(tokenizer) once the model is loaded, before rendering prompts")
            return apply_chat(tokenizer, user, system=data_cfg.system_prompt)
        return user if data_cfg.system_prompt is None else f"{data_cfg.system_prompt}\n\n{user}"

    return render


def make_reward(reward_cfg, example: Example | None = None) -> tuple[Callable[[str, Example], float],
                                                                     Callable[[str, Example], float]]:
    """(training reward, correctness): the reward adds the optional format bonus to the correctness check.

    With `example` (the first training example) a user reward.function is called once on it, with its gold answer
    as the completion (`validate_reward_function`): a broken function fails here with one line naming it.
    """
    if reward_cfg.function:
        if example is not None:
            user_fn = validate_reward_function(reward_cfg.function, example)
        else:
            user_fn = load_reward_function(reward_cfg.function)
        base = lambda text, ex: float(user_fn(text, ex.__dict__))  # noqa: E731
    else:
        base = lambda text, ex: math_reward(text, ex.gold, ex.gold_format)  # noqa: E731
    if reward_cfg.format_weight == 0:
        return base, base
    w, pattern = reward_cfg.format_weight, reward_cfg.format_pattern
    return (lambda text, ex: base(text, ex) + w * format_reward(text, pattern)), base


def load_task(data_cfg, reward_cfg, tokenizer=None, seed: int = 0) -> TaskData:
    """Build the task of a run config's `data` and `reward` sections.

    Loads the examples (bad records, e.g. a non-numeric gold answer for a numeric gold format, fail here with the
    file, record and field) and checks a user reward.function once on the first training example. `tokenizer`
    may be None to do this before the model loads; call `task.set_tokenizer(tokenizer)` afterwards (a chat
    template needs it).
    """
    d = data_cfg
    if d.train == "arithmetic":
        # The question is the bare expression ("7 + 5"); data.prompt_template wraps it.
        train, held_out = arithmetic_splits(
            d.num_train, d.num_eval, seed=seed, min_operand=d.min_operand, max_operand=d.max_operand,
            ops=tuple(d.ops), template="{expression}",
        )
    else:
        if d.eval is None and os.path.exists(d.train):
            raise ValueError(
                f"data.train={d.train!r} is a local file, which has no held-out split: set data.eval to a held-out "
                "file or benchmark (e.g. data.eval=gsm8k), or turn evaluation off (eval.before/after=false)"
            )
        fields = dict(prompt_field=d.prompt_field, answer_field=d.answer_field, gold_format=d.gold_format,
                      data_dir=d.data_dir)
        train = load_examples(d.train, d.train_split, limit=d.limit, **fields)
        held_out = load_examples(d.eval or d.train, d.eval_split, limit=d.eval_limit, **fields)
    if d.eval_limit is not None:
        held_out = held_out[: d.eval_limit]
    if not train:
        raise ValueError(f"data.train={d.train!r} gave no training examples")
    reward, correct = make_reward(reward_cfg, train[0])
    return TaskData(train, held_out, make_renderer(d, tokenizer), reward, correct, seed=seed, _data_cfg=d)
