"""Token sampling with the behaviour log-prob of each draw (BRIEF §1 step 2, §7).

The log-prob recorded for a sampled token is taken from the distribution it was actually drawn from: logits
divided by the temperature, restricted to the top-k tokens and to the top-p nucleus, renormalised. Greedy
decoding (temperature 0) has no sampling distribution; it reports the log-softmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature >= 0 (0 = greedy), top_p in (0, 1], top_k >= 0 (0 = off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def validate(self) -> "SamplingParams":
        if not (self.temperature >= 0):  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution as log-probs: [N, V], -inf outside the top-k / top-p support.

    logits: [N, V] (any float dtype; computed in float32, or float64 for float64 logits). For greedy params, the
    log-softmax of the raw logits.
    """
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / params.temperature
    V = scaled.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))  # ties with the k-th value are kept
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already hold >= top_p of the mass: the kept set is the
        # smallest prefix whose mass reaches top_p (the top token is always kept).
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: [N, V] next-token logits (float32 preferred).
        params: sampling parameters (validated by the caller).
        generator: a torch.Generator on logits' device for reproducible draws.
    Returns:
        (tokens long [N], logprobs float32 [N]) with logprobs[i] = log q_i(tokens[i]) under the distribution q_i
        the token was drawn from (see module docstring).
    """
    logprobs = filtered_logprobs(logits, params)
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
