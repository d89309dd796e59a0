"""The reference rollout engine: batched, KV-cached sampling of n completions per prompt with behaviour log-probs.

How a call runs (correctness first, plain PyTorch, fast enough for CPU RL on small models):
  1. prompts are tokenised and split into chunks of at most max_batch_size // n prompts;
  2. each chunk is left-padded and prefilled ONCE (one forward over all its prompts, positions counted from the
     mask); the KV cache rows and last logits are then repeated n times, one row per sample;
  3. decode: sample a token for every active row (recording its log-prob under the distribution it was drawn
     from), check EOS / stop strings / length, drop finished rows from the cache, and run a one-token forward
     for the rest. Finished sequences cost nothing afterwards.
The model runs in rollout mode (`set_rollout(True)`: quantized linears, AQN noise) and is put back into training
mode afterwards, also on errors. With `record_routing` (MoE models) every completion carries the experts each of
its tokens was routed to (`Completion.routing`), for router replay in the training forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from quarl.model.moe import ExpertRouting
from quarl.model.tokenizer import encode_prompt, eos_token_ids
from quarl.rollout.kv_cache import KVCache
from quarl.rollout.sampling import SamplingParams, sample_tokens
from quarl.rollout.seeding import answer_seed, counter_uniform


@dataclass
class Completion:
    """One sampled answer. `logprobs[t]` is the behaviour log-prob of `token_ids[t]`.

    finish_reason: "eos" (the EOS token is the last entry of token_ids/logprobs but not part of `text`), "stop"
    (a stop string appeared: `text` ends before it; token_ids end with the token that completed it) or "length"
    (max_new_tokens reached). `text` is decoded with special tokens kept and no clean-up of spaces.
    routing (engines that record MoE routing): int16 [len(prompt) + len(token_ids) - 1, num_moe_layers, k], the
    experts of every token the engine fed through the model (the prompt, then every sampled token but the last).
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    routing: torch.Tensor | None = None


@dataclass
class RequestOutput:
    """All n completions of one prompt (in sample order)."""

    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)


class _Sequence:
    """Decode state of one sample."""

    __slots__ = ("token_ids", "logprobs", "finish_reason", "text", "routing")

    def __init__(self):
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.routing: list[torch.Tensor] = []  # int16 [tokens, num_moe_layers, k] pieces, in feeding order


def _answer_seeds(seeds, num_prompts: int, n: int) -> torch.Tensor | None:
    """int64 [num_prompts * n] per-answer seeds (prompt-major) from one seed per prompt, or None."""
    if seeds is None:
        return None
    seeds = [int(x) for x in seeds]
    if len(seeds) != num_prompts or any(x < 0 for x in seeds):
        raise ValueError(f"seeds must give one non-negative integer per prompt ({num_prompts}), got {len(seeds)}")
    return torch.tensor([answer_seed(x, j) for x in seeds for j in range(n)], dtype=torch.int64)


def _sample_seeded(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, draw: int):
    """Inverse-CDF draws from each row's own stream (`quarl.rollout.seeding`): (tokens long [B], logprobs [B])."""
    from quarl.rollout.fast_step import sample_next

    noise = None
    if not params.greedy:
        noise = counter_uniform(seeds, torch.full_like(seeds, draw), 1)
    return sample_next(logits, params, noise)


class RolloutEngine:
    """Generates groups of completions with a `QuarlForCausalLM` (see the module docstring)."""

    def __init__(self, model, tokenizer, max_batch_size: int = 256, record_routing: bool = False):
        """max_batch_size: most sequences decoded together. A prompt's n samples always share one batch, so a
        single prompt with n > max_batch_size still runs (as one batch of n). record_routing: fill
        `Completion.routing` (needs a MoE model)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if record_routing and not getattr(model, "is_moe", False):
            raise ValueError("record_routing=True needs a mixture-of-experts model (e.g. qwen3_moe); this model has "
                             "no MoE layers")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = int(max_batch_size)
        self.record_routing = bool(record_routing)

    # ------------------------------------------------------------------ public
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop: list[str] | None = None,
                 seed: int | None = None, progress: Callable[[int], None] | None = None, *,
                 seeds: Sequence[int] | None = None) -> list[RequestOutput]:
        """Sample n completions for every prompt.

        Args:
            prompts: texts (tokenised with the tokenizer's special tokens, BOS never doubled) or token-id lists.
            n: completions per prompt (a GRPO group).
            max_new_tokens: cap on generated tokens per completion (finish_reason "length").
            temperature: 0 = greedy; otherwise logits are divided by it before top-k / top-p.
            top_p: nucleus mass in (0, 1]; top_k: keep the k most likely tokens (0 = off).
            stop: strings that end a completion (finish_reason "stop").
            seed: seeds the engine's own torch.Generator (same seed + same inputs = same outputs); None draws
                the seed from torch's global RNG, so torch.manual_seed also makes runs repeatable.
            progress: called after each decode step with the number of tokens generated in that step.
            seeds: one seed per prompt instead of `seed`: answer j of prompt i then draws from its own stream
                (`quarl.rollout.seeding`, inverse-CDF sampling), the same whichever prompts share the call.
        Returns:
            one RequestOutput per prompt, in input order.
        """
        params = SamplingParams(float(temperature), float(top_p), int(top_k)).validate()
        prompt_ids = self._encode(prompts)
        self._check(prompt_ids, n, max_new_tokens, stop)
        n, max_new_tokens, stop = int(n), int(max_new_tokens), list(stop or [])
        eos = set(eos_token_ids(self.tokenizer, self.model.config))
        device = self.model.device
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        answer_seeds = _answer_seeds(seeds, len(prompt_ids), n)  # [P * n] (prompt-major) or None

        outputs = [RequestOutput(p if isinstance(p, str) else None, ids) for p, ids in zip(prompts, prompt_ids)]
        per_chunk = max(1, self.max_batch_size // n)
        self.model.set_rollout(True)
        try:
            with torch.no_grad():
                for c0 in range(0, len(prompt_ids), per_chunk):
                    chunk = prompt_ids[c0:c0 + per_chunk]
                    chunk_seeds = None if answer_seeds is None else answer_seeds[c0 * n:(c0 + len(chunk)) * n]
                    seqs = self._generate_chunk(chunk, n, max_new_tokens, params, stop, eos, gen, progress,
                                                chunk_seeds)
                    for i in range(len(chunk)):
                        outputs[c0 + i].completions = [
                            Completion(s.token_ids, s.text, s.logprobs, s.finish_reason,
                                       torch.cat(s.routing) if self.record_routing else None)
                            for s in seqs[i * n:(i + 1) * n]
                        ]
        finally:
            self.model.set_rollout(False)
        return outputs

    # ------------------------------------------------------------------ input handling
    def _encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists "
                             f"(got {type(prompts).__name__}{' of length 0' if not prompts else ''})")
        vocab = self.model.config.vocab_size
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token-id lists or give the engine one")
                ids = encode_prompt(self.tokenizer, p)
            elif isinstance(p, torch.Tensor):
                ids = [int(t) for t in p.flatten().tolist()]
            else:
                ids = [int(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty (no tokens); every prompt needs at least one token")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            out.append(ids)
        return out

    def _check(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, stop) -> None:
        if int(n) != n or n < 1:
            raise ValueError(f"n (completions per prompt) must be an integer >= 1, got {n}")
        if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
        if stop is not None:
            if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
                raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
            if stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer to decode completions; give the engine one")
        context = self.model.config.max_position_embeddings
        limit = context - max_new_tokens
        for i, ids in enumerate(prompt_ids):
            if len(ids) > limit:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens, but the context of {context} minus max_new_tokens="
                    f"{max_new_tokens} leaves room for {max(limit, 0)}; shorten the prompt or lower max_new_tokens"
                )

    # ------------------------------------------------------------------ decoding
    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # token-id prompts without a tokenizer: completions carry ids only
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _generate_chunk(self, chunk: list[list[int]], n: int, max_new_tokens: int, params: SamplingParams,
                        stop: list[str], eos: set[int], gen: torch.Generator, progress,
                        answer_seeds: torch.Tensor | None = None) -> list[_Sequence]:
        """Prefill `chunk` once, then decode n samples per prompt. Returns P*n finished sequences (prompt-major).
        answer_seeds: int64 [P*n], each answer's own stream (see `generate`'s seeds), else `gen` draws all."""
        model, device = self.model, self.model.device
        P, L = len(chunk), max(len(ids) for ids in chunk)
        input_ids = torch.zeros(P, L, dtype=torch.long)
        mask = torch.zeros(P, L, dtype=torch.long)
        for i, ids in enumerate(chunk):  # left padding: every row's last prompt token sits in column L-1
            input_ids[i, L - len(ids):] = torch.tensor(ids)
            mask[i, L - len(ids):] = 1
        cache = KVCache.for_model(model, P, L + max_new_tokens)
        routing = ExpertRouting(record=True) if self.record_routing else None
        logits = model(input_ids.to(device), attention_mask=mask.to(device), kv_cache=cache, logits_to_keep=1,
                       routing=routing)[:, -1]
        cache.repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)

        seqs = [_Sequence() for _ in range(P * n)]
        if routing is not None:  # each prompt's routing (padding columns dropped), shared by its n samples
            prompt_routing = routing.stacked().to(device="cpu", dtype=torch.int16)
            for g, s in enumerate(seqs):
                s.routing.append(prompt_routing[g // n, L - len(chunk[g // n]):])
        active = list(range(P * n))  # global sample index of each cache row
        # A stop string of c characters spans at most 4c byte-level tokens; a few more absorb a split character.
        window = 4 * max((len(s) for s in stop), default=0) + 4
        for step in range(max_new_tokens):
            if answer_seeds is None:
                tokens, logprobs = sample_tokens(logits, params, gen)
            else:
                tokens, logprobs = _sample_seeded(logits, params, answer_seeds[active].to(device), step)
            keep_rows = []
            for row, (g, tok, lp) in enumerate(zip(active, tokens.tolist(), logprobs.tolist())):
                s = seqs[g]
                s.token_ids.append(tok)
                s.logprobs.append(lp)
                if tok in eos:
                    s.finish_reason, s.text = "eos", self._decode(s.token_ids[:-1])
                elif stop and self._hit_stop(s, stop, window):
                    pass  # _hit_stop filled finish_reason and text
                elif len(s.token_ids) >= max_new_tokens:
                    s.finish_reason, s.text = "length", self._decode(s.token_ids)
                else:
                    keep_rows.append(row)
            if progress is not None:
                progress(len(active))
            if not keep_rows:
                break
            if len(keep_rows) < len(active):  # finished rows leave the batch and the cache
                idx = torch.tensor(keep_rows, device=device)
                cache.select(idx)
                tokens = tokens.index_select(0, idx)
                active = [active[r] for r in keep_rows]
            routing = ExpertRouting(record=True) if self.record_routing else None
            logits = model(tokens[:, None], kv_cache=cache, routing=routing)[:, -1]
            if routing is not None:
                fed = routing.stacked().to(device="cpu", dtype=torch.int16)  # [rows, 1, moe layers, k]
                for row, g in enumerate(active):
                    seqs[g].routing.append(fed[row])
        return seqs

    def _hit_stop(self, s: _Sequence, stop: list[str], window: int) -> bool:
        """True (and the sequence finished with reason "stop") if the newest token completed a stop string."""
        tail = self._decode(s.token_ids[-window:])
        if not any(x in tail for x in stop):
            return False
        text = self._decode(s.token_ids)
        cut = min((i for i in (text.find(x) for x in stop) if i >= 0), default=-1)
        if cut < 0:  # the window decoded differently from the full text; trust the full text
            return False
        s.finish_reason, s.text = "stop", text[:cut]
        return True
