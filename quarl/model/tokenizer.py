"""Tokenizer loading and chat formatting.

The rollout engine and the trainer only need `encode`/`decode` and the special-token ids of a Hugging Face
tokenizer; this module loads one (HF directory, hub id, or GGUF file) and formats chat prompts.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(name_or_path: str, *, gguf_file: str | None = None, revision: str | None = None):
    """Load a Hugging Face tokenizer.

    Args:
        name_or_path: a local directory with tokenizer files (or holding `gguf_file`), or a hub model id.
        gguf_file: file name inside `name_or_path` of a GGUF checkpoint whose embedded tokenizer to use.
        revision: hub revision (branch, tag or commit).
    Raises:
        FileNotFoundError: a local directory without tokenizer files (names them).
        ValueError: local tokenizer files (or a GGUF's embedded tokenizer) that cannot be read (one line naming them).
    """
    from transformers import AutoTokenizer

    if gguf_file is not None:
        if os.path.isdir(name_or_path) and not os.path.isfile(os.path.join(name_or_path, gguf_file)):
            raise FileNotFoundError(f"GGUF file {gguf_file!r} not found in {name_or_path}")
        where = os.path.join(name_or_path, gguf_file)
        with _clear_errors(where, "re-download the file"):
            return AutoTokenizer.from_pretrained(name_or_path, gguf_file=gguf_file, revision=revision)
    if os.path.isdir(name_or_path):
        if not any(os.path.isfile(os.path.join(name_or_path, f)) for f in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"no tokenizer files in {name_or_path} (looked for {', '.join(TOKENIZER_FILES)}); copy the "
                "tokenizer of the base model into this directory (tokenizer.save_pretrained(dir))"
            )
        with _clear_errors(name_or_path, "the tokenizer files are corrupt or incomplete: copy those of the base "
                                         "model into it (tokenizer.save_pretrained(dir))"):
            return AutoTokenizer.from_pretrained(name_or_path, revision=revision)
    return AutoTokenizer.from_pretrained(name_or_path, revision=revision)


@contextmanager
def _clear_errors(where: str, fix: str):
    """Turn a library's error while reading local tokenizer files into one line naming them (ValueError)."""
    try:
        yield
    except (FileNotFoundError, ImportError):
        raise
    except Exception as e:  # tokenizers' JSON errors, sentencepiece's, transformers' OSError ...
        detail = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"could not load the tokenizer from {where} ({type(e).__name__}: {detail}); {fix}") from e


def apply_chat(tokenizer, user_text: str, system: str | None = None) -> str:
    """The prompt text for one user turn, ready for generation.

    Uses the tokenizer's chat template with `add_generation_prompt=True` (the assistant header is appended). A
    tokenizer without a template gets a plain-text fallback: "{system}\\n\\n{user_text}\\n" (system part only if
    given), i.e. the model simply continues the text.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_text}
        ]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return (f"{system}\n\n" if system else "") + f"{user_text}\n"


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt: the tokenizer's special tokens are added (e.g. BOS) unless the text already starts
    with them (a chat template that writes BOS itself), so BOS never appears twice."""
    ids = list(tokenizer(text, add_special_tokens=True).input_ids)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


def right_padded(sequences: list[list[int]]):
    """(input_ids long [B, T], attention_mask long [B, T]) on the CPU: token-id lists right-padded with 0s to the
    longest (T >= 1), mask 1 on real tokens."""
    import torch

    width = max([len(seq) for seq in sequences] + [1])
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, :len(seq)] = 1
    return ids, mask


def eos_token_ids(tokenizer, config=None) -> list[int]:
    """The ids that end a completion: the tokenizer's eos plus the model config's eos ids (deduplicated)."""
    ids: list[int] = []
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tok_eos is not None:
        ids.append(int(tok_eos))
    for e in getattr(config, "eos_token_ids", None) or []:
        if int(e) not in ids:
            ids.append(int(e))
    return ids
