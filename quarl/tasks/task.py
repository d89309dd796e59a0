"""A training task: train/held-out examples, how a question becomes a prompt, and how an answer is scored."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from quarl.tasks.datasets import Example, examples_from, load_examples
from quarl.tasks.rewards import (
    RewardFunctionError,
    RewardFunctions,
    format_reward,
    load_reward_function,
    math_reward,
    validate_reward_function,
)
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
    # scores many answers in one call (user reward functions in Python); None -> reward_fn per answer
    batch_reward_fn: Callable[[list[str], list[Example]], list[float]] | None = None

    def render(self, example: Example) -> str:
        return self.render_fn(example)

    def rewards(self, completions: list[str], examples: list[Example]) -> list[float]:
        """Training rewards of answers `completions[i]` to `examples[i]`, in one call where the task can batch."""
        if self.batch_reward_fn is not None:
            return [float(v) for v in self.batch_reward_fn(completions, examples)]
        return [self.reward(c, ex) for c, ex in zip(completions, examples)]

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
        if data_cfg.chat_template and tokenizer is None:
            raise ValueError("the task was loaded without a tokenizer (load_task(..., tokenizer=None)); call "
                             "task.set_tokenizer(tokenizer) once the model is loaded, before rendering prompts")
        if example.messages is not None:  # a conversational record: every turn, its system turn included
            messages = chat_messages(example, user, data_cfg.system_prompt)
            if data_cfg.chat_template and getattr(tokenizer, "chat_template", None):
                return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            text = "\n\n".join(m["content"] for m in messages)  # apply_chat's plain-text form, turn by turn
            return text + "\n" if data_cfg.chat_template else text
        if data_cfg.chat_template:
            return apply_chat(tokenizer, user, system=data_cfg.system_prompt)
        return user if data_cfg.system_prompt is None else f"{data_cfg.system_prompt}\n\n{user}"

    return render


def chat_messages(example: Example, user: str, system_prompt: str | None) -> list[dict]:
    """The chat of a conversational example with its last user turn replaced by `user` (the templated question);
    data.system_prompt is added in front only when the record has no system turn of its own."""
    messages = [dict(m) for m in example.messages]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last_user]["content"] = user
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def reward_prompt(example: Example) -> Any:
    """The prompt a reward function receives: as the dataset gave it (chat messages or text), as in TRL."""
    return [dict(m) for m in example.messages] if example.messages is not None else example.prompt


def make_batch_reward(fns: RewardFunctions, reward_cfg, example: Example):
    """(batched training reward, per-answer training reward, correctness) of user reward callables; the format bonus
    of reward_cfg is added to the training reward. The functions are checked on `example` (the first training
    example, its gold answer as the completion): a broken one fails here with one line naming it."""
    fns.check_signatures(list(example.reward_columns()))

    def base(completions: list[str], examples: list[Example]) -> list[float]:
        return fns(completions, [reward_prompt(ex) for ex in examples], [ex.reward_columns() for ex in examples])

    try:
        base([example.gold], [example])
    except RewardFunctionError as e:
        raise type(e)(f"{e} (checked when the task loads, on the first training example, id {example.id!r}, with "
                      f"its answer {example.gold[:40]!r} as the completion)") from e
    w, pattern = reward_cfg.format_weight, reward_cfg.format_pattern

    def batch(completions: list[str], examples: list[Example]) -> list[float]:
        scores = base(completions, examples)
        if w == 0:
            return scores
        return [s + w * format_reward(c, pattern) for s, c in zip(scores, completions)]

    return batch, (lambda text, ex: batch([text], [ex])[0]), (lambda text, ex: base([text], [ex])[0])


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


def load_task(data_cfg, reward_cfg, tokenizer=None, seed: int = 0, *, reward_fns=None, reward_weights=None,
              dataset=None, eval_dataset=None) -> TaskData:
    """Build the task of a run config's `data` and `reward` sections.

    Loads the examples (bad records, e.g. a non-numeric gold answer for a numeric gold format, fail here with the
    file, record and field) and checks a user reward.function once on the first training example. `tokenizer`
    may be None to do this before the model loads; call `task.set_tokenizer(tokenizer)` afterwards (a chat
    template needs it).

    Python callers may pass instead of (or besides) the config:
        reward_fns / reward_weights: callables and their weights (`quarl.tasks.rewards.RewardFunctions`), in place of
            the built-in math check and of reward.function; the answer column is then optional.
        dataset: the training examples, in place of data.train (anything `examples_from` takes); data.prompt_field,
            answer_field, gold_format and limit apply to it.
        eval_dataset: the held-out examples, in place of data.eval; when `dataset` is given without it, held-out
            examples come from data.eval if set, else there are none (no held-out evaluation).
    """
    d = data_cfg
    if reward_fns is not None and reward_cfg.function:
        raise ValueError(f"both reward_fns and reward.function={reward_cfg.function!r} are set; give the reward "
                         "functions one way (reward_fns for Python callables)")
    user_fns = RewardFunctions(reward_fns, reward_weights) if reward_fns is not None else None
    if user_fns is None and reward_weights is not None:
        raise ValueError("reward_weights were given without reward_fns; pass the functions they weigh")
    math_answers = user_fns is None  # reward.function reads ex.gold: its answers are checked as for math_reward
    fields = dict(prompt_field=d.prompt_field, answer_field=d.answer_field, gold_format=d.gold_format,
                  data_dir=d.data_dir, math_answers=math_answers)
    held_out = None
    if eval_dataset is not None:
        held_out = examples_from(eval_dataset, d.eval_split, limit=d.eval_limit, what="eval_dataset", **fields)
    if dataset is not None:
        train = examples_from(dataset, d.train_split, limit=d.limit, what="dataset", **fields)
        if held_out is None:
            held_out = load_examples(d.eval, d.eval_split, limit=d.eval_limit, **fields) if d.eval else []
    elif d.train == "arithmetic":
        # The question is the bare expression ("7 + 5"); data.prompt_template wraps it.
        train, generated = arithmetic_splits(
            d.num_train, d.num_eval, seed=seed, min_operand=d.min_operand, max_operand=d.max_operand,
            ops=tuple(d.ops), template="{expression}",
        )
        held_out = generated if held_out is None else held_out
    else:
        if held_out is None and d.eval is None and os.path.exists(d.train):
            raise ValueError(
                f"data.train={d.train!r} is a local file, which has no held-out split: set data.eval to a held-out "
                "file or benchmark (e.g. data.eval=gsm8k), or turn evaluation off (eval.before/after=false)"
            )
        train = load_examples(d.train, d.train_split, limit=d.limit, **fields)
        if held_out is None:
            held_out = load_examples(d.eval or d.train, d.eval_split, limit=d.eval_limit, **fields)
    if d.eval_limit is not None:
        held_out = held_out[: d.eval_limit]
    if not train:
        raise ValueError(f"data.train={d.train!r} gave no training examples")
    if user_fns is not None:
        batch, reward, correct = make_batch_reward(user_fns, reward_cfg, train[0])
        return TaskData(train, held_out, make_renderer(d, tokenizer), reward, correct, seed=seed, _data_cfg=d,
                        batch_reward_fn=batch)
    reward, correct = make_reward(reward_cfg, train[0])
    return TaskData(train, held_out, make_renderer(d, tokenizer), reward, correct, seed=seed, _data_cfg=d)
