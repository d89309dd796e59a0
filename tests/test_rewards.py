"""Math answer checking over every GSM8K test / MATH-500 / AIME24 gold, format rewards, user reward loading."""

import json
import os
import re
import threading

import pytest

import quarl.tasks.rewards as rewards_mod
from quarl.tasks.rewards import (MAX_ANSWER_CHARS, extract_answer, extract_gsm8k_gold, format_reward, last_boxed,
                                 load_reward_function, math_reward)


def _read(shared_data_dir, rel):
    with open(os.path.join(shared_data_dir, rel), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------------------
# every gold answer of the benchmarks (no subsampling: all of them take a few seconds)


def test_every_gsm8k_test_answer_scores_1_and_its_plus_one_perturbation_scores_0(shared_data_dir):
    rows = _read(shared_data_dir, "gsm8k/test.jsonl")
    assert len(rows) == 1319
    wrong, fooled = [], []
    for r in rows:
        solution = r["answer"]
        gold = extract_gsm8k_gold(solution)
        if math_reward(solution, solution, "gsm8k") != 1.0 or math_reward(solution, gold, "gsm8k") != 1.0:
            wrong.append(gold)
        perturbed = solution.rsplit("####", 1)[0] + f"#### {int(gold) + 1}"
        if math_reward(perturbed, solution, "gsm8k") != 0.0:
            fooled.append(gold)
    assert not wrong, f"{len(wrong)} GSM8K solutions not recognised: {wrong[:10]}"
    assert not fooled, f"{len(fooled)} perturbed GSM8K answers accepted: {fooled[:10]}"


def test_every_math500_answer_in_boxed_form(shared_data_dir):
    rows = _read(shared_data_dir, "math500/test.jsonl")
    assert len(rows) == 500
    answers = [r["answer"] for r in rows]
    wrong = [a for a in answers if math_reward(f"Thus the answer is $\\boxed{{{a}}}$.", a, "boxed") != 1.0]
    assert not wrong, f"{len(wrong)} MATH-500 answers not recognised in \\boxed{{}}: {wrong[:10]}"
    # the reference solutions themselves (their last \boxed{} holds the answer)
    wrong = [r["answer"] for r in rows if math_reward(r["solution"], r["answer"], "boxed") != 1.0]
    assert not wrong, f"{len(wrong)} MATH-500 solutions not recognised: {wrong[:10]}"
    # the full solution as gold works too
    assert all(math_reward(f"\\boxed{{{r['answer']}}}", r["solution"], "boxed") == 1.0 for r in rows[:50])
    fooled = [a for a in answers if math_reward(f"so \\boxed{{{a}+1}}", a, "boxed") != 0.0]
    assert not fooled, f"perturbed (+1) answers accepted: {fooled[:10]}"


def test_math500_answers_reject_their_neighbours(shared_data_dir):
    """Each answer against the next one in the file: must score 0 unless the two are the same answer.

    Excluded pairs (stated, not silent): identical strings after removing spaces, and "x=5" vs "5" — an
    equation's right-hand side is accepted by math-verify by design.
    """
    answers = [r["answer"] for r in _read(shared_data_dir, "math500/test.jsonl")]

    def norm(a):
        return re.sub(r"^[a-z]\s*=\s*", "", a.replace(" ", ""))

    fooled, skipped = [], 0
    for i, gold in enumerate(answers):
        other = answers[(i + 1) % len(answers)]
        if norm(gold) == norm(other):
            skipped += 1
            continue
        if math_reward(f"\\boxed{{{other}}}", gold, "boxed") != 0.0:
            fooled.append((gold, other))
    assert not fooled, fooled[:10]
    assert skipped < 10  # the exclusion stays narrow


def test_every_aime24_answer(shared_data_dir):
    rows = _read(shared_data_dir, "aime24/test.jsonl")
    assert len(rows) == 30
    for r in rows:
        a = str(r["answer"])
        assert math_reward(f"The answer is \\boxed{{{a}}}.", a, "plain") == 1.0, a
        assert math_reward(f"So the final answer is {a}.", a, "plain") == 1.0, a
        assert math_reward(f"\\boxed{{{int(a) + 1}}}", a, "plain") == 0.0, a


# ----------------------------------------------------------------------------------------------------------
# extraction details


def test_extract_gsm8k_gold():
    assert extract_gsm8k_gold("so 70,000\n#### 70,000") == "70000"
    assert extract_gsm8k_gold("a #### 1 then\n#### -3 ") == "-3"
    with pytest.raises(ValueError, match="####"):
        extract_gsm8k_gold("no marker 12")


def test_last_boxed_and_extract_answer():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert last_boxed(r"\boxed{2} and a cut-off \boxed{\frac{1}{") == "2"
    assert last_boxed("no box") is None
    assert extract_answer(r"x \fbox{7}") == ("latex", "7")
    assert extract_answer("1,234 apples and 5.5 pears") == ("number", "5.5")
    assert extract_answer("total 1,234,567") == ("number", "1234567")
    assert extract_answer("The answer is -5.") == ("number", "-5")
    assert extract_answer("10 - 5") == ("number", "5")  # a minus after an operand is subtraction
    assert extract_answer("x=-5") == ("number", "-5")
    assert extract_answer("no digits") is None


@pytest.mark.parametrize("completion,gold,fmt,expected", [
    (r"so \boxed{\frac{1}{2}}", "0.5", "plain", 1.0),
    (r"so \boxed{\dfrac{1}{2}}", r"\frac12", "boxed", 1.0),
    ("I think it's 1,000 dollars", "1000", "gsm8k", 1.0),
    ("The answer is -5", "#### -5", "gsm8k", 1.0),
    ("The answer is 5", "#### -5", "gsm8k", 0.0),
    (r"\boxed{3} but actually 4", "3", "plain", 1.0),  # the boxed answer wins over a later number
    ("no answer here", "3", "plain", 0.0),
    (r"\boxed{}", "3", "plain", 0.0),
    (r"\boxed{" + "1+" * MAX_ANSWER_CHARS + "1}", "3", "plain", 0.0),  # over-long answers are not parsed
    (r"\boxed{(1, 2)}", r"(1,2)", "boxed", 1.0),
    (r"\boxed{[1, 2)}", r"[1,2]", "boxed", 0.0),
])
def test_math_reward_cases(completion, gold, fmt, expected):
    assert math_reward(completion, gold, fmt) == expected


def test_math_reward_bad_arguments():
    with pytest.raises(ValueError, match="gold_format"):
        math_reward("1", "1", "latex")
    with pytest.raises(TypeError):
        math_reward(None, "1", "plain")


def test_timeouts_on_in_main_thread_off_in_worker_threads(monkeypatch):
    """math-verify's SIGALRM timeouts raise outside the main thread: we must pass None there, 5 s here."""
    seen = []
    real_parse, real_verify = rewards_mod._math_verify().parse, rewards_mod._math_verify().verify

    def parse(*args, parsing_timeout, **kwargs):
        seen.append(("parse", parsing_timeout))
        return real_parse(*args, parsing_timeout=parsing_timeout, **kwargs)

    def verify(*args, timeout_seconds, **kwargs):
        seen.append(("verify", timeout_seconds))
        return real_verify(*args, timeout_seconds=timeout_seconds, **kwargs)

    mv = rewards_mod._math_verify()
    monkeypatch.setattr(mv, "parse", parse)
    monkeypatch.setattr(mv, "verify", verify)
    rewards_mod._parse_gold.cache_clear()
    assert math_reward(r"\boxed{41}", "41", "plain") == 1.0
    assert seen and all(t == rewards_mod.DEFAULT_TIMEOUT_S for _, t in seen)
    seen.clear()
    results = []
    worker = threading.Thread(target=lambda: results.extend(
        [math_reward(r"\boxed{42}", "42", "plain"), math_reward(r"\boxed{43}", "42", "plain")]))
    worker.start()
    worker.join(60)
    assert results == [1.0, 0.0]
    assert seen and all(t is None for _, t in seen)


# ----------------------------------------------------------------------------------------------------------
# format rewards


def test_format_reward():
    pattern = r"<think>.*?</think>\s*<answer>.*?</answer>"
    good = "<think>\nstep 1\nstep 2\n</think>\n<answer>\n42\n</answer>\n"
    assert format_reward(good, pattern, match="full") == 1.0  # DOTALL: "." spans lines
    assert format_reward("preamble " + good, pattern, match="full") == 0.0
    assert format_reward("preamble " + good, pattern) == 1.0  # search: anywhere
    assert format_reward("<think>x</think>", pattern) == 0.0
    assert format_reward("ans: 4", re.compile(r"\d")) == 1.0
    with pytest.raises(ValueError, match="not a valid regular expression"):
        format_reward("x", "(unclosed")
    with pytest.raises(ValueError, match="match"):
        format_reward("x", "x", match="prefix")


# ----------------------------------------------------------------------------------------------------------
# user reward functions


USER_MODULE = '''
def length_reward(completion, example):
    return len(completion) / 10

def needs_three(completion, example, extra):
    return 0.0

def returns_text(completion, example):
    return "good"

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_rewards_mod.py"


def test_load_reward_function_from_module_and_file(user_module):
    fn = load_reward_function("my_rewards_mod:length_reward")
    assert fn("abcde", {"gold": "1"}) == 0.5 and isinstance(fn("abcde", {}), float)
    fn2 = load_reward_function(f"{user_module}:length_reward")
    assert fn2("a" * 20, {}) == 2.0
    assert load_reward_function("quarl.tasks.rewards:format_reward")  # any importable module


@pytest.mark.parametrize("spec,exc,needle", [
    ("no_colon_here", ValueError, "module:function"),
    ("my_rewards_mod:", ValueError, "function name"),
    ("surely_missing_module_xyz:f", ImportError, "cannot import module"),
    ("my_rewards_mod:missing", AttributeError, "length_reward"),  # lists what is there
    ("my_rewards_mod:NOT_CALLABLE", TypeError, "not a function"),
    ("my_rewards_mod:needs_three", TypeError, "must accept"),
    ("/nonexistent/dir/r.py:f", FileNotFoundError, "no Python file"),
])
def test_load_reward_function_errors(user_module, spec, exc, needle):
    with pytest.raises(exc, match=needle):
        load_reward_function(spec)


def test_user_reward_must_return_a_number(user_module):
    fn = load_reward_function("my_rewards_mod:returns_text")
    with pytest.raises(TypeError, match="must return a number"):
        fn("x", {})
