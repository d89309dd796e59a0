"""A synthetic arithmetic task ("What is 37 + 48?") for fast CPU demos and tests with small models.

Difficulty is set by the operand range, the number of operands and the operators. Examples are a pure
function of the seed; `arithmetic_splits` returns train and held-out sets that share no expression.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from quarl.tasks.datasets import Example

SUPPORTED_OPS = ("+", "-", "*")
DEFAULT_TEMPLATE = "What is {expression}?"


def _evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Value with the usual precedence (* before + and -), left to right otherwise."""
    terms = [operands[0]]
    signs = [1]
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def _check(n, min_operand, max_operand, ops, num_operands, template):
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} must be a non-negative int")
    if not isinstance(min_operand, int) or not isinstance(max_operand, int) or min_operand > max_operand:
        raise ValueError(f"need integer min_operand <= max_operand; got {min_operand!r}, {max_operand!r}")
    if isinstance(ops, str):
        raise ValueError(f"ops must be a sequence of operators such as ('+', '-'), not the string {ops!r}")
    if not ops or any(op not in SUPPORTED_OPS for op in ops):
        raise ValueError(f"ops={tuple(ops)!r}: choose a non-empty subset of {SUPPORTED_OPS}")
    if isinstance(num_operands, bool) or not isinstance(num_operands, int) or num_operands < 2:
        raise ValueError(f"num_operands={num_operands!r} must be an int >= 2")
    if "{expression}" not in template:
        raise ValueError(f"template {template!r} must contain '{{expression}}'")


def arithmetic_examples(n: int, seed: int, *, min_operand: int = 0, max_operand: int = 99,
                        ops: Sequence[str] = ("+", "-"), num_operands: int = 2, allow_negative: bool = False,
                        template: str = DEFAULT_TEMPLATE, exclude: Iterable[str] = (),
                        id_prefix: str = "arith") -> list[Example]:
    """`n` distinct arithmetic problems, deterministic in `seed`.

    Args:
        n: number of examples.
        seed: random seed (the same arguments always give the same list).
        min_operand / max_operand: inclusive operand range (difficulty knob).
        ops: operators drawn uniformly per position, from "+", "-", "*".
        num_operands: operands per expression (≥ 2).
        allow_negative: False redraws expressions whose value is negative (easier for small models).
        template: the prompt, with "{expression}" where the expression goes.
        exclude: expressions (as in meta["expression"], e.g. "37 + 48") that must not be produced — how
            held-out sets stay disjoint from training sets.
        id_prefix: ids are f"{id_prefix}-{seed}-{i}".
    Returns:
        list of Example with gold the integer value as a string and gold_format "plain"; meta holds
        "expression", "operands", "ops".
    Raises:
        ValueError for bad arguments, or when the range cannot supply n distinct problems.
    """
    _check(n, min_operand, max_operand, ops, num_operands, template)
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[Example] = []
    attempts, max_attempts = 0, 50 * n + 1000
    while len(out) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(f"found only {len(out)} of {n} distinct problems with operands in "
                             f"[{min_operand}, {max_operand}], ops {tuple(ops)}, {num_operands} operands "
                             f"(allow_negative={allow_negative}, {len(seen) - len(out)} excluded); widen the range "
                             "or ask for fewer")
        operands = [rng.randint(min_operand, max_operand) for _ in range(num_operands)]
        chosen_ops = [rng.choice(tuple(ops)) for _ in range(num_operands - 1)]
        value = _evaluate(operands, chosen_ops)
        if value < 0 and not allow_negative:
            continue
        # negative operands in parentheses so "5 - -3" never appears
        shown = [f"({v})" if v < 0 else str(v) for v in operands]
        expression = shown[0] + "".join(f" {op} {v}" for op, v in zip(chosen_ops, shown[1:]))
        if expression in seen:
            continue
        seen.add(expression)
        out.append(Example(id=f"{id_prefix}-{seed}-{len(out)}", prompt=template.format(expression=expression),
                           gold=str(value), gold_format="plain",
                           meta={"expression": expression, "operands": operands, "ops": chosen_ops}))
    return out


def arithmetic_splits(n_train: int, n_test: int, seed: int = 0, **kwargs) -> tuple[list[Example], list[Example]]:
    """Disjoint train and held-out arithmetic sets: different seeds (seed and seed + 1_000_003) and the
    held-out set excludes every training expression. kwargs go to `arithmetic_examples`."""
    if "exclude" in kwargs:
        raise ValueError("arithmetic_splits sets `exclude` itself; call arithmetic_examples for custom exclusions")
    train = arithmetic_examples(n_train, seed, id_prefix="arith-train", **kwargs)
    test = arithmetic_examples(n_test, seed + 1_000_003, exclude=[e.meta["expression"] for e in train],
                               id_prefix="arith-test", **kwargs)
    return train, test
