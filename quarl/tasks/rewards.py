"""Rewards: math answer checking with math-verify, regex format rewards, and user reward functions.

math-verify protects its sympy parsing/comparison with `signal.alarm` timeouts, which only work in the main
thread (elsewhere `signal.signal` raises and math-verify would score every answer 0, or — with timeouts off —
an adversarial answer could hang the run). `math_reward` therefore passes timeouts in the main thread and
disables them in other threads, where the guard is a length cap on the extracted answer instead (see
`MAX_ANSWER_CHARS`). For hard isolation in threaded code, score in a process pool: each worker process runs
its tasks in its own main thread, where the timeouts work.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import re
import threading
import traceback
from typing import Any, Callable

logger = logging.getLogger(__name__)

GOLD_FORMATS = ("gsm8k", "boxed", "plain")
# Longest extracted answer handed to sympy. Real final answers (MATH-500's longest is a few hundred
# characters) stay well below; this bounds sympy's work where no timeout can interrupt it.
MAX_ANSWER_CHARS = 1000
DEFAULT_TIMEOUT_S = 5

# A number: thousands groups "1,234,567" or plain digits, optional decimals. The sign is decided separately
# (see _last_number) so that "10 - 5" does not yield −5.
_NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _timeout() -> int | None:
    """math-verify timeouts use SIGALRM: only the main thread may install the handler."""
    return DEFAULT_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def extract_gsm8k_gold(answer_text: str) -> str:
    """The final answer of a GSM8K solution: the text after the last "####", commas removed.

    "... so he made 70,000\\n#### 70,000" -> "70000". Raises ValueError when there is no "####".
    """
    if not isinstance(answer_text, str) or "####" not in answer_text:
        raise ValueError(f"a GSM8K answer ends with '#### <number>'; got {str(answer_text)[-80:]!r}")
    tail = answer_text.rsplit("####", 1)[1].strip()
    tail = tail.splitlines()[0] if tail else ""
    return tail.replace(",", "").strip()


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
        # unbalanced (answer cut off): try the previous one
    return None


def _last_number(text: str) -> str | None:
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    number = m.group(0).replace(",", "")
    # A minus touching the digits is a sign ("is -5", "x=-5") unless it touches an operand on its left too
    # ("10-5", "(a)-5"); with a space after it ("10 - 5") it is never part of the number.
    j = m.start() - 1
    if j >= 0 and text[j] in "-\u2212":
        if j == 0 or not (text[j - 1].isalnum() or text[j - 1] in ")]}"):
            number = "-" + number
    return number


def extract_answer(completion: str) -> tuple[str, str] | None:
    """The answer a completion gives: ("latex", content of its last \\boxed{}) or else ("number", last number).

    None when there is neither.
    """
    boxed = last_boxed(completion)
    if boxed is not None:
        return "latex", boxed
    number = _last_number(completion)
    return ("number", number) if number is not None else None


def _math_verify():
    try:
        import math_verify
    except ImportError as e:  # a hard dependency, but say what to do
        raise ImportError("quarl's math rewards need math-verify: pip install 'math-verify>=0.7'") from e
    return math_verify


def _parse_latex(content: str, timeout: int | None) -> list:
    mv = _math_verify()
    return mv.parse("\\boxed{" + content + "}", extraction_config=[mv.LatexExtractionConfig()],
                    extraction_mode="first_match", parsing_timeout=timeout)


def _parse_expr(content: str, timeout: int | None) -> list:
    mv = _math_verify()
    return mv.parse(content, extraction_config=[mv.ExprExtractionConfig()], extraction_mode="first_match",
                    parsing_timeout=timeout)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, gold_format: str, timeout: int | None) -> tuple:
    """Parsed gold answer, cached: the G answers of a group share one gold."""
    if gold_format == "gsm8k":
        text = extract_gsm8k_gold(gold) if "####" in gold else gold.replace(",", "").strip()
        parsed = _parse_expr(text, timeout) or _parse_latex(text, timeout)
    elif gold_format == "plain":
        text = gold.strip()
        parsed = _parse_expr(text, timeout) or _parse_latex(text, timeout)
    else:  # boxed: a LaTeX answer, or a whole solution whose last \boxed{} holds it
        boxed = last_boxed(gold)
        text = boxed if boxed is not None else gold.strip()
        parsed = _parse_latex(text, timeout)
    if not parsed:
        logger.warning("gold answer %r (format %s) could not be parsed; answers to it score 0", gold[:200],
                       gold_format)
    return tuple(parsed)


def math_reward(completion: str, gold: str, gold_format: str = "plain") -> float:
    """1.0 if the completion's final answer equals the gold answer mathematically, else 0.0.

    The completion's answer is its last \\boxed{...} (parsed as LaTeX) or, without one, its last number.
    The gold is read by `gold_format`:
      "gsm8k" — a GSM8K solution ending in "#### N" (or N itself), commas ignored;
      "boxed" — a LaTeX answer as in MATH-500's "answer" field, or a full solution whose last \\boxed{} holds it;
      "plain" — a plain number or expression ("204", "3/4").
    Comparison is math_verify.verify (symbolic and numeric equality, sets, intervals, matrices).
    Never raises for odd completions and never hangs (see the module docstring).
    """
    if gold_format not in GOLD_FORMATS:
        raise ValueError(f"gold_format={gold_format!r} is unknown; choose one of {GOLD_FORMATS}")
    if not isinstance(completion, str) or not isinstance(gold, str):
        raise TypeError(f"math_reward takes str completion and gold; got {type(completion).__name__}, "
                        f"{type(gold).__name__}")
    timeout = _timeout()
    gold_parsed = _parse_gold(gold, gold_format, timeout)
    if not gold_parsed:
        return 0.0
    found = extract_answer(completion)
    if found is None:
        return 0.0
    kind, text = found
    if not text.strip() or len(text) > MAX_ANSWER_CHARS:
        return 0.0
    answer = _parse_latex(text, timeout) if kind == "latex" else _parse_expr(text, timeout)
    if not answer:
        return 0.0
    mv = _math_verify()
    return 1.0 if mv.verify(list(gold_parsed), answer, timeout_seconds=timeout) else 0.0


@functools.lru_cache(maxsize=256)
def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"format pattern {pattern!r} is not a valid regular expression: {e}") from e


def format_reward(completion: str, pattern: str | re.Pattern, *, match: str = "search") -> float:
    """1.0 if the completion has the required format, else 0.0.

    `pattern` is a regular expression compiled with re.DOTALL ("." spans lines), or a compiled pattern used
    as is. match="search": the pattern may occur anywhere (anchor it with \\A ... \\Z to constrain the whole
    text); match="full": it must match the whole completion, leading/trailing whitespace ignored.
    Example: r"<think>.*?</think>\\s*<answer>.*?</answer>" with match="full".
    """
    if match not in ("search", "full"):
        raise ValueError(f"match={match!r}; choose 'search' (anywhere) or 'full' (the whole completion)")
    regex = pattern if isinstance(pattern, re.Pattern) else _compile(pattern)
    if match == "full":
        return 1.0 if regex.fullmatch(completion.strip()) else 0.0
    return 1.0 if regex.search(completion) else 0.0


class RewardFunctionError(ValueError):
    """A user reward function (reward.function) that cannot be used. The message is one line naming the function
    ("module:function") and the problem. Subclasses also derive from AttributeError / TypeError, so callers that
    catch those keep working, while the command line reports every case as a one-line error."""


class RewardAttributeError(RewardFunctionError, AttributeError):
    """The module has no such attribute."""


class RewardTypeError(RewardFunctionError, TypeError):
    """Not callable, a signature that cannot take (completion, example), or a result that is not a number."""


def _one_line(text: Any, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _raised_at(err: BaseException, code_file: str | None = None) -> str:
    """" (at file.py:12 in fn)": the deepest frame of the traceback in `code_file` (the user's file), else the
    deepest frame of all; "" without a traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    mine = [f for f in frames if code_file and os.path.abspath(f.filename) == os.path.abspath(code_file)]
    f = (mine or frames)[-1]
    return f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"


def _import_target(target: str, spec: str):
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"reward spec {spec!r}: no Python file at {path}")
        name = "quarl_user_reward_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # a syntax error, a failing import or statement in the user's file
            raise RewardFunctionError(
                f"reward spec {spec!r}: running {path} failed with {type(e).__name__}: {_one_line(e)}"
                f"{_raised_at(e, path)}; fix the file"
            ) from e
        return module
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise ImportError(f"reward spec {spec!r}: cannot import module {target!r} ({_one_line(e)}); make it "
                          "importable (installed or on PYTHONPATH) or give a file path: "
                          "'path/to/rewards.py:function'") from e
    except Exception as e:  # the module exists but importing it fails (syntax error, failing statement)
        raise RewardFunctionError(
            f"reward spec {spec!r}: importing module {target!r} failed with {type(e).__name__}: {_one_line(e)}"
            f"{_raised_at(e)}; fix the module"
        ) from e


def _as_number(value: Any, spec: str) -> float:
    """`value` as a float: numbers (bool, int, float, numpy / one-element torch scalars) only; a string, None or a
    list is an error even when float() would accept it ("1.0" is text, not a reward). NaN passes."""
    if type(value) is float:
        return value
    kind = type(value)
    if isinstance(value, (str, bytes)) or not (hasattr(kind, "__float__") or hasattr(kind, "__index__")):
        raise RewardTypeError(f"reward function {spec!r} returned {_one_line(repr(value), 80)} (a {kind.__name__}); "
                              "it must return a number (float, int or bool)")
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise RewardTypeError(f"reward function {spec!r} returned {_one_line(repr(value), 80)} (a {kind.__name__}, "
                              f"{_one_line(e, 80)}); it must return a number (float, int or bool)") from e


def load_reward_function(spec: str) -> Callable[[str, dict], float]:
    """Load a user reward `fn(completion: str, example: dict) -> float` from "module:function" or "file.py:function".

    The returned callable converts the result to float. It raises RewardTypeError (a ValueError and a TypeError),
    naming the spec, if the user function returns something that is not a number (None, a string, a list ...;
    bool and int are fine, NaN passes), and RewardFunctionError, naming the spec, the exception and where it was
    raised, if the user function raises.
    Loading errors are one line each: ImportError (module missing), FileNotFoundError (file missing),
    RewardAttributeError (no such attribute), RewardTypeError (not callable, wrong signature), RewardFunctionError
    (the module fails to import). See `validate_reward_function` to check a function once before training.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"reward spec {spec!r} must look like 'package.module:function' or "
                         "'path/to/rewards.py:function'")
    target, _, attr = spec.rpartition(":")
    if not target or not attr.isidentifier():
        raise ValueError(f"reward spec {spec!r} must look like 'package.module:function' or "
                         "'path/to/rewards.py:function' (function name after the last ':')")
    module = _import_target(target, spec)
    fn = getattr(module, attr, None)
    if fn is None:
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardAttributeError(f"reward spec {spec!r}: {target!r} has no attribute {attr!r}; callables there: "
                                   f"{available}")
    if not callable(fn):
        raise RewardTypeError(f"reward spec {spec!r}: {attr!r} is a {type(fn).__name__}, not a function; point "
                              "reward.function at a function fn(completion: str, example: dict) -> float")
    try:
        inspect.signature(fn).bind("completion", {})
    except TypeError as e:
        raise RewardTypeError(f"reward spec {spec!r}: {attr} must accept (completion: str, example: dict); "
                              f"its signature is {attr}{inspect.signature(fn)}") from e
    except ValueError:
        pass  # builtins without a signature: trust the caller
    code_file = getattr(getattr(fn, "__code__", None), "co_filename", None)

    @functools.wraps(fn)
    def reward(completion: str, example: dict[str, Any]) -> float:
        try:
            value = fn(completion, example)
        except Exception as e:  # the user's bug: one line with where it happened (the traceback stays chained)
            raise RewardFunctionError(
                f"reward function {spec!r} raised {type(e).__name__}: {_one_line(e)}{_raised_at(e, code_file)} on "
                f"the completion {_one_line(repr(completion), 60)}; it must return a number for any completion"
            ) from e
        return _as_number(value, spec)

    return reward


def validate_reward_function(spec: str | Callable[[str, dict], float], example: Any,
                             completion: str | None = None) -> Callable[[str, dict], float]:
    """Load the user reward `spec` ("module:function" / "file.py:function") and call it once, so that a broken
    function fails when the task loads, not in the middle of the first rollout.

    Args:
        spec: the reward spec (or a function already returned by `load_reward_function`).
        example: the first training example (a `quarl.tasks.datasets.Example` or the dict the function receives);
            the function gets a copy, so the check cannot change it.
        completion: the text to score; default the example's gold answer (a plausible completion).
    Returns:
        the loaded function (`load_reward_function(spec)`), to be used for training.
    Raises:
        one-line errors naming the function: ImportError / FileNotFoundError (module or file missing),
        RewardFunctionError (a ValueError; also AttributeError / TypeError for a missing attribute, a
        non-callable, a wrong signature or a non-number result) when it cannot be loaded, raises, or returns
        something that is not a number. Booleans and ints are fine; NaN passes (the trainer guards non-finite
        rewards).
    """
    fn = load_reward_function(spec) if isinstance(spec, str) else spec
    name = spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
    record = copy.deepcopy(example if isinstance(example, dict) else dict(vars(example)))
    if completion is None:
        completion = str(record.get("gold", ""))
    where = f"checked when the task loads, on the first training example (id {record.get('id')!r})"
    try:
        _as_number(fn(completion, record), name)
    except RewardFunctionError as e:
        msg = str(e)
        if "on the completion" not in msg:
            where += f" with the completion {_one_line(repr(completion), 60)}"
        raise type(e)(f"{msg} ({where})") from e
    except Exception as e:  # a plain callable (not from load_reward_function) that raises
        raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {_one_line(e)}"
                                  f"{_raised_at(e)} on the completion {_one_line(repr(completion), 60)} ({where})"
                                  ) from e
    return fn


# ------------------------------------------------------------------------------------------------ Python callables
# Reward functions given in Python (quarl.train(reward_fns=...)) use TRL's signature:
#     fn(completions: list[str], prompts: list, **columns) -> list[float | None]
# called with keywords, once per batch of completions; `columns` are the dataset's other columns as lists aligned
# with the completions. A callable whose `batched` attribute is False (see `per_sample`) is called once per
# completion instead: fn(completion: str, prompt, **columns) -> float | None. None means "does not apply to this
# completion" (as in TRL): it adds nothing to the weighted sum.

RESERVED_ARGS = ("completions", "prompts", "completion", "prompt")


def per_sample(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a reward function that scores one completion per call: `fn(completion: str, prompt, **columns) ->
    float`. Use as a decorator (`@quarl.per_sample`) or a wrapper (`quarl.per_sample(fn)`); the returned callable has
    `batched = False`, which is how quarl tells it from a batched (TRL-style) function."""
    if not callable(fn):
        raise TypeError(f"per_sample takes a function, got a {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper.batched = False
    return wrapper


def reward_name(fn: Any) -> str:
    """A readable name of a reward callable for messages and metrics."""
    inner = getattr(fn, "__wrapped__", fn)
    return getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None) or type(inner).__name__


class RewardFunctions:
    """A weighted sum of user reward callables (TRL's signature, or `per_sample` ones): `self(completions, prompts,
    columns)` -> one float per completion.

    Args:
        fns: a callable or a list of them.
        weights: one finite number per function (default 1.0 each).
    Raises ValueError (one line) for an empty list, a non-callable, weights of the wrong number or kind, and a
    signature that cannot take the keywords it will be called with.
    """

    def __init__(self, fns: Callable | list[Callable], weights: list[float] | None = None):
        fns = [fns] if callable(fns) else fns
        if not isinstance(fns, (list, tuple)) or not fns:
            raise ValueError(f"reward_fns must be a callable or a non-empty list of callables, got {fns!r}")
        for i, fn in enumerate(fns):
            if not callable(fn):
                hint = ("; in Python pass the function itself (a 'module:function' string is for the YAML key "
                        "reward.function)") if isinstance(fn, str) else ""
                raise ValueError(f"reward_fns[{i}] is a {type(fn).__name__}, not a function{hint}")
        if weights is None:
            weights = [1.0] * len(fns)
        if not isinstance(weights, (list, tuple)) or len(weights) != len(fns):
            raise ValueError(f"reward_weights must be a list with one weight per reward function ({len(fns)}), got "
                             f"{weights!r}")
        for i, w in enumerate(weights):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w != w or abs(w) == float("inf"):
                raise ValueError(f"reward_weights[{i}]={w!r} must be a finite number")
        self.fns = list(fns)
        self.weights = [float(w) for w in weights]
        self.names = [reward_name(fn) for fn in self.fns]

    @staticmethod
    def batched(fn: Any) -> bool:
        return getattr(fn, "batched", True) is not False

    def check_signatures(self, column_names: list[str]) -> None:
        """RewardTypeError when a function cannot be called with its keywords and these dataset columns."""
        clash = [c for c in column_names if c in RESERVED_ARGS]
        if clash:
            raise ValueError(f"the dataset column(s) {clash} clash with the reward function arguments "
                             f"{RESERVED_ARGS[:2]}; rename the column(s)")
        sample = {c: None for c in column_names}
        for fn, name in zip(self.fns, self.names):
            args = dict(completion="", prompt="") if not self.batched(fn) else dict(completions=[], prompts=[])
            try:
                inspect.signature(fn).bind(**args, **sample)
            except TypeError:
                kind = "per-sample" if not self.batched(fn) else "batched (TRL-style)"
                raise RewardTypeError(
                    f"reward function {name!r} ({kind}) is called as {name}({', '.join(f'{k}=' for k in args)}, "
                    f"**columns) with the columns {column_names}, but its signature is "
                    f"{name}{inspect.signature(fn)}; add **kwargs to take the columns it does not use") from None
            except ValueError:
                pass  # builtins without a signature: trust the caller

    def _call(self, fn, name: str, completions: list[str], prompts: list, columns: dict[str, list]) -> list:
        """One function's values (float or None) for every completion, checked."""
        n = len(completions)
        code_file = getattr(getattr(getattr(fn, "__wrapped__", fn), "__code__", None), "co_filename", None)
        try:
            if self.batched(fn):
                values = fn(completions=completions, prompts=prompts, **columns)
            else:
                values = [fn(completion=c, prompt=p, **{k: v[i] for k, v in columns.items()})
                          for i, (c, p) in enumerate(zip(completions, prompts))]
        except RewardFunctionError:
            raise
        except Exception as e:  # the user's bug: one line, where it happened (the traceback stays chained)
            raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {_one_line(e)}"
                                      f"{_raised_at(e, code_file)}; it must return a score for any completion"
                                      ) from e
        if self.batched(fn):
            if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):
                values = values.tolist()  # numpy arrays, tensors
            if not isinstance(values, (list, tuple)):
                raise RewardTypeError(
                    f"reward function {name!r} returned {_one_line(repr(values), 60)} (a {type(values).__name__}), "
                    "not a list of one score per completion; a function that scores a single completion must be "
                    "wrapped with quarl.per_sample")
            if len(values) != n:
                raise RewardTypeError(f"reward function {name!r} returned {len(values)} values for {n} completions; "
                                      "it must return one per completion, in order")
        return [None if v is None else _as_number(v, name) for v in values]

    def __call__(self, completions: list[str], prompts: list, columns: list[dict[str, Any]]) -> list[float]:
        """The weighted sum per completion; `columns` holds one dict of dataset columns per completion."""
        keys = list(dict.fromkeys(k for c in columns for k in c))
        by_column = {k: [c.get(k) for c in columns] for k in keys}
        total = [0.0] * len(completions)
        for fn, name, w in zip(self.fns, self.names, self.weights):
            for i, v in enumerate(self._call(fn, name, completions, prompts, by_column)):
                if v is not None:
                    total[i] += w * v
        return total
