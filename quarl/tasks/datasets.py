"""Task data: question/answer examples from the bundled benchmarks, local files or the Hugging Face hub.

`load_examples(source, split)` understands
  * "gsm8k" | "math500" | "aime24": `<data_dir or $QUARL_DATA_DIR>/<name>/<split>.jsonl`; when that file is
    missing, GSM8K falls back to the samples shipped in quarl/data/ (200 train / 100 test lines) with a warning;
  * a local .jsonl / .json / .parquet file, with the question and answer fields given or auto-detected;
  * a hub dataset id "org/name" (or "org/name:config") through `datasets.load_dataset` (optional dependency).

Every example carries the question text without any chat template (the trainer applies the tokenizer's
template) and the gold answer with the format `quarl.tasks.rewards.math_reward` needs to read it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from quarl.tasks.rewards import GOLD_FORMATS, extract_gsm8k_gold

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "QUARL_DATA_DIR"
# Field names tried, in order, when the caller does not name them. "answer" precedes "solution": in MATH-style
# data "answer" is the short final answer and "solution" the worked text.
PROMPT_FIELDS = ("prompt", "question", "problem", "query", "input", "instruction")
ANSWER_FIELDS = ("answer", "final_answer", "gold", "target", "solution", "output", "label")
ID_FIELDS = ("id", "unique_id", "idx", "uid")

# name -> (sub-folder, splits, prompt field, answer field, gold format, id field)
BENCHMARKS: dict[str, tuple[str, tuple[str, ...], str, str, str, str | None]] = {
    "gsm8k": ("gsm8k", ("train", "test"), "question", "answer", "gsm8k", None),
    "math500": ("math500", ("test",), "problem", "answer", "boxed", "unique_id"),
    "aime24": ("aime24", ("test",), "problem", "answer", "plain", "id"),
}
SAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
SHIPPED_SAMPLES = {("gsm8k", "train"): "gsm8k_train_sample.jsonl", ("gsm8k", "test"): "gsm8k_test_sample.jsonl"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(?::[\w.-]+)?$")
_NUMBER = re.compile(r"^-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$")
# What a numeric gold answer may look like. gsm8k: a number (commas already removed). plain: a number or an
# arithmetic expression of numbers ("3/4", "-2.5", "2^{10}", "\frac{1}{2}", "3\sqrt{2}", "10%").
_GSM8K_GOLD = re.compile(r"^[-+\u2212]?(?:\d+(?:\.\d*)?|\.\d+)$")
_PLAIN_LATEX = re.compile(r"\\(?:[dt]?frac|sqrt|pi|cdot|times|div|left|right|[,;!: ])")
_PLAIN_CHARS = re.compile(r"^[\d\s.,+\-\u2212*/^()\[\]{}%]*$")


@dataclass
class Example:
    """One task instance.

    id: stable identifier; prompt: the user question, no template; gold: the gold answer (for GSM8K the number
    after "####"); gold_format: how `math_reward` reads gold ("gsm8k" | "boxed" | "plain"); meta: the record's
    other fields (e.g. the worked solution, subject, level).
    """

    id: str
    prompt: str
    gold: str
    gold_format: str = "plain"
    meta: dict[str, Any] = field(default_factory=dict)
    # conversational records: the prompt's chat messages as given (system turn included); `prompt` is the last
    # user turn, the one data.prompt_template wraps. None for plain-text prompts.
    messages: list[dict[str, Any]] | None = None
    # the record's fields other than the prompt, as given (reward functions get them as TRL's columns); None for
    # examples not read from records (e.g. the arithmetic task): then {"answer": gold, **meta}
    columns: dict[str, Any] | None = None

    def reward_columns(self) -> dict[str, Any]:
        """The dataset columns a reward function receives for this example (TRL's `**kwargs`)."""
        return dict(self.columns) if self.columns is not None else {"answer": self.gold, **self.meta}


def load_examples(source: str, split: str = "train", *, prompt_field: str | None = None,
                  answer_field: str | None = None, gold_format: str | None = None, limit: int | None = None,
                  data_dir: str | None = None, math_answers: bool = True) -> list[Example]:
    """Load question/answer examples (see the module docstring for the accepted sources).

    Args:
        source: "gsm8k" | "math500" | "aime24", a path to .jsonl/.json/.parquet, or a hub id "org/name[:config]".
        split: benchmark split ("train"/"test"); for hub datasets the split name passed to load_dataset;
            ignored for local files.
        prompt_field / answer_field: record fields holding the question and the gold answer; None = detect
            (PROMPT_FIELDS / ANSWER_FIELDS, first present).
        gold_format: "gsm8k" | "boxed" | "plain"; None = the benchmark's, or detected from the answers
            ("####" -> gsm8k, a plain number -> plain, anything else -> boxed).
        limit: keep the first `limit` examples.
        data_dir: folder holding gsm8k/, math500/, aime24/; default $QUARL_DATA_DIR.
        math_answers: False when user reward functions score the answers: the answer field may then be missing
            and is not checked against the gold format.
    Raises:
        ValueError for unknown sources/splits/formats and for missing fields (listing the available fields);
        FileNotFoundError for missing files; RuntimeError when a hub dataset cannot be loaded.
    """
    if gold_format is not None and gold_format not in GOLD_FORMATS:
        raise ValueError(f"gold_format={gold_format!r} is unknown; choose one of {GOLD_FORMATS}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit={limit!r} must be a non-negative int or None")
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be a non-empty string; got {source!r}")

    if source.lower() in BENCHMARKS:
        return _load_benchmark(source.lower(), split, prompt_field, answer_field, gold_format, limit, data_dir,
                               math_answers)
    path = os.path.expanduser(source)
    if os.path.exists(path) or path.lower().endswith((".jsonl", ".json", ".parquet")):
        if os.path.isdir(path):
            raise ValueError(f"dataset source {path!r} is a folder; pass a .jsonl, .json or .parquet file")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dataset file {path!r} does not exist")
        records = _read_file(path)
        name = os.path.splitext(os.path.basename(path))[0]
        return _to_examples(records, name, prompt_field, answer_field, gold_format, limit, id_field=None,
                            where=path, math_answers=math_answers)
    if _HUB_ID.match(source):
        records = _read_hub(source, split, limit)
        name = source.replace("/", "-").replace(":", "-")
        return _to_examples(records, name, prompt_field, answer_field, gold_format, limit, id_field=None,
                            where=f"hub dataset {source} (split {split})", math_answers=math_answers)
    raise ValueError(f"dataset source {source!r} is not a benchmark name {tuple(BENCHMARKS)}, an existing "
                     ".jsonl/.json/.parquet file, or a hub id like 'org/name'")


def _load_benchmark(name, split, prompt_field, answer_field, gold_format, limit, data_dir,
                    math_answers=True) -> list[Example]:
    folder, splits, p_field, a_field, fmt, id_field = BENCHMARKS[name]
    if split not in splits:
        raise ValueError(f"{name} has the split(s) {splits}; got split={split!r}")
    root = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    path = os.path.join(root, folder, f"{split}.jsonl") if root else None
    if path is not None and os.path.isfile(path):
        records = _read_jsonl(path)
        origin = path
    else:
        sample = SHIPPED_SAMPLES.get((name, split))
        where = f"{path!r} not found" if path else f"no data_dir given and ${DATA_DIR_ENV} is not set"
        if sample is None:
            raise FileNotFoundError(f"{name}/{split}: {where}; put the data at <data_dir>/{folder}/{split}.jsonl "
                                    f"and pass data_dir= or set ${DATA_DIR_ENV}")
        records = _read_jsonl(os.path.join(SAMPLES_DIR, sample))
        origin = os.path.join(SAMPLES_DIR, sample)
        msg = (f"{name}/{split}: {where}; using the {len(records)}-example sample shipped with quarl "
               f"(quarl/data/{sample}). Set ${DATA_DIR_ENV} or pass data_dir= for the full set.")
        warnings.warn(msg, stacklevel=3)
        logger.warning(msg)
    return _to_examples(records, f"{name}-{split}", prompt_field or p_field, answer_field or a_field,
                        gold_format or fmt, limit, id_field=id_field, where=origin, math_answers=math_answers)


def examples_from(data: Any, split: str = "train", *, prompt_field: str | None = None,
                  answer_field: str | None = None, gold_format: str | None = None, limit: int | None = None,
                  data_dir: str | None = None, math_answers: bool = True, what: str = "dataset") -> list[Example]:
    """Examples of a dataset given in Python: a `datasets.Dataset` (or anything with `to_list()`), a pandas
    DataFrame, a list of dicts, a dict of equal-length columns, or a str / os.PathLike source for `load_examples`
    (file, benchmark name, hub id). The other arguments are `load_examples`'s; `what` names the argument in errors.

    Raises ValueError (one line) for anything else, an empty dataset, records that are not dicts, a DatasetDict
    (pick a split) and the `load_examples` errors (e.g. no prompt column).
    """
    fields = dict(prompt_field=prompt_field, answer_field=answer_field, gold_format=gold_format, limit=limit)
    if isinstance(data, (str, os.PathLike)):
        return load_examples(os.fspath(data), split, data_dir=data_dir, math_answers=math_answers, **fields)
    if isinstance(data, dict):
        if data and all(hasattr(v, "column_names") for v in data.values()):  # datasets.DatasetDict
            raise ValueError(f"{what} is a DatasetDict with the splits {sorted(data)}; pass one split, e.g. "
                             f"{what}=ds[{sorted(data)[0]!r}]")
        if not data or not all(isinstance(v, (list, tuple)) for v in data.values()):
            raise ValueError(f"{what} is a dict: give columns of equal-length lists ({{'prompt': [...], "
                             "'answer': [...]}), or a list of records")
        n = len(next(iter(data.values())))
        if any(len(v) != n for v in data.values()):
            raise ValueError(f"{what}: the columns have different lengths "
                             f"{ {k: len(v) for k, v in data.items()} }; give equal-length lists")
        records = [{k: v[i] for k, v in data.items()} for i in range(n)]
    elif hasattr(data, "to_list") and hasattr(data, "column_names"):  # datasets.Dataset
        records = data.to_list()
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        records = [{k: _plain(v) for k, v in r.items()} for r in data.to_dict(orient="records")]
    elif isinstance(data, (list, tuple)):
        records = list(data)
    else:
        raise ValueError(f"{what} is a {type(data).__name__}; give a datasets.Dataset, a list of dicts (one per "
                         "example, e.g. {'prompt': ..., 'answer': ...}), or a .jsonl/.json/.parquet path")
    if not records:
        raise ValueError(f"{what} is empty; give at least one example")
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"{what}: record {bad} is a {type(records[bad]).__name__}; every record must be a dict "
                         "such as {'prompt': ..., 'answer': ...}")
    return _to_examples(records, what, prompt_field, answer_field, gold_format, limit, id_field=None,
                        where=what, math_answers=math_answers)


class _Records(list):
    """Records read from JSON Lines, with the line number of each (`lines`), for error messages."""

    lines: list[int]


def _read_jsonl_text(text: str, where: str) -> list[dict]:
    records = _Records()
    records.lines = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}, line {lineno}: not valid JSON ({e})") from e
        if not isinstance(record, dict):
            raise ValueError(f"{where}, line {lineno}: expected a JSON object per line, got {type(record).__name__}")
        records.append(record)
        records.lines.append(lineno)
    return records


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return _read_jsonl_text(f.read(), path)


def _read_file(path: str) -> list[dict]:
    lower = path.lower()
    if lower.endswith(".jsonl"):
        return _read_jsonl(path)
    if lower.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return _read_jsonl_text(text, path)  # JSON Lines saved as .json
        if isinstance(data, dict):
            for key in ("data", "examples", "rows", "train", "test"):
                if isinstance(data.get(key), list):
                    data = data[key]
                    break
            else:
                if data and all(isinstance(v, list) for v in data.values()):  # columnar {"q": [...], "a": [...]}
                    n = len(next(iter(data.values())))
                    if any(len(v) != n for v in data.values()):
                        raise ValueError(f"{path}: columnar JSON with columns of different lengths")
                    data = [{k: v[i] for k, v in data.items()} for i in range(n)]
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ValueError(f"{path}: expected a list of objects, an object with a 'data'/'examples' list, or "
                             "columns of equal-length lists")
        return data
    if lower.endswith(".parquet"):
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("reading .parquet needs pandas and pyarrow: pip install 'quarl[data]'") from e
        try:
            frame = pd.read_parquet(path)
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
        return [{k: _plain(v) for k, v in r.items()} for r in frame.to_dict(orient="records")]
    raise ValueError(f"{path}: unsupported file type; use .jsonl, .json or .parquet")


def _plain(value: Any) -> Any:
    """numpy scalars/arrays from parquet -> python values (so meta stays JSON-friendly)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return value


def _read_hub(source: str, split: str, limit: int | None) -> list[dict]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"loading the hub dataset {source!r} needs the 'datasets' package: "
                          "pip install 'quarl[data]'") from e
    name, _, config = source.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # offline, missing, gated, bad split: one clear message
        raise RuntimeError(f"could not load hub dataset {name!r} (config={config or None!r}, split={split!r}): "
                           f"{type(e).__name__}: {e}. Offline? Download it once (or export it to .jsonl/"
                           ".parquet) and pass the local file path instead.") from e
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return [dict(r) for r in ds]


def _detect(records: list[dict], given: str | None, candidates: tuple[str, ...], role: str, arg: str) -> str:
    available = sorted(records[0].keys())
    if given is not None:
        if given not in records[0]:
            raise ValueError(f"the {role} field {given!r} is not in the records; available fields: {available}")
        return given
    for name in candidates:
        if name in records[0]:
            return name
    raise ValueError(f"could not find the {role} field (tried {candidates}); available fields: {available}; "
                     f"pass {arg}= (data.{arg} in a run config) naming it")


def _prompt_text(value: Any, index: int | str, field_name: str) -> tuple[str, list[dict] | None]:
    """(the question text, the chat messages or None). Conversational records (TRL style: a list of
    {"role": ..., "content": ...}) keep every message (system turn included); the question is the last user turn."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        messages = [{"role": m.get("role", "user"), "content": m["content"]} for m in value]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise ValueError(f"{_label(index)}: the chat messages of field {field_name!r} have no user turn (roles: "
                             f"{[m['role'] for m in messages]}); add the question as a 'user' message")
        if not all(isinstance(m["content"], str) for m in messages):
            raise ValueError(f"{_label(index)}: every chat message of field {field_name!r} needs a string "
                             "'content'")
        return messages[users[-1]]["content"], messages
    raise ValueError(f"{_label(index)}: field {field_name!r} must be a string (or a list of chat messages); "
                     f"got {type(value).__name__}")


def _answer_text(value: Any, index: int | str, field_name: str) -> str:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{_label(index)}: answer field {field_name!r} is {value!r}; expected a string or number")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(f"{_label(index)}: answer field {field_name!r} must be a string or number; "
                     f"got {type(value).__name__}")


def _label(index: int | str) -> str:
    return f"record {index}" if isinstance(index, int) else index


def is_numeric_gold(gold: str, gold_format: str) -> bool:
    """Whether `gold` is a gold answer the numeric formats can score: for "gsm8k" a number, for "plain" a number
    or an arithmetic expression of numbers ("3/4", "2^{10}", "\\frac{1}{2}"). "boxed" (LaTeX / text) is always
    accepted."""
    text = gold.replace(",", "").strip()
    if gold_format == "gsm8k":
        return bool(_GSM8K_GOLD.match(text))
    if gold_format == "plain":
        bare = _PLAIN_LATEX.sub(" ", text).replace("\u03c0", " ").replace("pi", " ")
        return any(c.isdigit() for c in text) and bool(_PLAIN_CHARS.match(bare))
    return True


def detect_gold_format(answer: str) -> str:
    """"gsm8k" if the answer holds "####", "plain" if it is a plain number, else "boxed" (LaTeX)."""
    if "####" in answer:
        return "gsm8k"
    return "plain" if _NUMBER.match(answer.strip()) else "boxed"


def _to_examples(records, name, prompt_field, answer_field, gold_format, limit, id_field,
                 where: str | None = None, math_answers: bool = True) -> list[Example]:
    """Examples of the records. `where` (the file or dataset) is named in errors, with the JSONL line number of
    the record (or its 0-based index in other sources). math_answers=False (user reward functions score the
    answers): the answer field may be missing (gold "") and its values are not checked for a numeric gold format."""
    lines = getattr(records, "lines", None)
    where = where or name
    if limit is not None:
        records = records[:limit]
    if not records:
        return []
    p_field = _detect(records, prompt_field, PROMPT_FIELDS, "prompt (question)", "prompt_field")
    if math_answers or answer_field is not None:
        a_field = _detect(records, answer_field, ANSWER_FIELDS, "answer", "answer_field")
    else:
        a_field = next((f for f in ANSWER_FIELDS if f in records[0]), None)
    if id_field is None:
        id_field = next((f for f in ID_FIELDS if f in records[0] and f not in (p_field, a_field)), None)
    examples = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"record {i} of {where} is a {type(record).__name__}; every record must be a mapping "
                             "of field names to values (a dict)")
        missing = [f for f in (p_field, a_field) if f is not None and f not in record]
        if missing:
            raise ValueError(f"record {i} of {name} lacks field(s) {missing}; its fields: {sorted(record)}")
        label = f"{where}, " + (f"line {lines[i]}" if lines else f"record {i}")
        prompt, messages = _prompt_text(record[p_field], label, p_field)
        columns = {k: v for k, v in record.items() if k != p_field}
        value = record[a_field] if a_field is not None else None
        if not math_answers and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
            value = None  # no gold answer to read: user rewards read the columns themselves
        raw_answer = _answer_text(value, label, a_field) if value is not None or math_answers else ""
        fmt = gold_format or detect_gold_format(raw_answer)
        # GSM8K golds are stored as the final number; the worked solution stays in meta.
        gold = extract_gsm8k_gold(raw_answer) if fmt == "gsm8k" and "####" in raw_answer else raw_answer
        if math_answers and not is_numeric_gold(gold, fmt):
            shown = repr(raw_answer) if len(raw_answer) <= 60 else repr("..." + raw_answer[-57:])
            final = f" (final answer {gold!r})" if gold != raw_answer else ""
            need = "a number after '####'" if fmt == "gsm8k" else "a number or a numeric expression"
            raise ValueError(
                f"{label}: the answer field {a_field!r} is {' '.join(shown.split())}{final}, which is not numeric, but "
                f"gold_format={fmt} needs {need}; fix the record, or set the gold format (data.gold_format) to "
                "boxed for LaTeX / text answers"
            )
        meta = {k: v for k, v in record.items() if k not in (p_field, a_field)}
        if gold != raw_answer:
            meta["solution"] = raw_answer
        ex_id = str(record[id_field]) if id_field and record.get(id_field) is not None else f"{name}-{i}"
        examples.append(Example(id=ex_id, prompt=prompt, gold=gold, gold_format=fmt, meta=meta, messages=messages,
                                columns=columns))
    return examples
