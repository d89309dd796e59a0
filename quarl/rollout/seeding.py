"""Per-answer random streams: uniform draws that depend only on (answer seed, token index, column).

A `generate(..., seed=s)` call draws every sequence's tokens from one torch.Generator, so an answer's tokens
depend on which other prompts shared the call. With `seeds=[...]` (one per prompt) each answer j of prompt i has
its own stream instead: draw t of that answer is a pure function of (answer_seed(seeds[i], j), t), computed by a
counter-based hash in plain integer tensor ops (no generator state), on any device and inside any batch. The same
prompt with the same seed then gives the same answers alone or among any other prompts, on any rank: what lets a
run on N ranks reproduce a run on one (docs/DISTRIBUTED.md).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # < 2**27: products of 32-bit values stay below 2**59, exact in int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (int64 tensor of values in [0, 2**32) -> same)."""
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def answer_seed(prompt_seed: int, answer_index: int) -> int:
    """The seed of answer `answer_index` of a prompt seeded with `prompt_seed` (a non-negative int < 2**62)."""
    return (int(prompt_seed) * 1_000_003 + int(answer_index) * 7_919 + 17) % (2**62)


def counter_uniform(seeds: torch.Tensor, draws: torch.Tensor, width: int = 1) -> torch.Tensor:
    """Uniform draws in (0, 1): float32 [B, width], entry [b, c] a function of (seeds[b], draws[b], c) alone.

    seeds: int64 [B] non-negative answer seeds; draws: int64 [B], the index of the draw in the answer (its token
    index). Values are multiples of 2**-24 offset by half a step, so never 0 or 1.
    """
    seeds, draws = seeds.to(torch.int64), draws.to(torch.int64)
    h = _mix32(seeds & _MASK32)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32))
    h = _mix32(h ^ (draws & _MASK32))  # [B]
    cols = torch.arange(width, device=seeds.device, dtype=torch.int64)
    h = _mix32(h[:, None] ^ _mix32(cols + 0x9E3779B9 & _MASK32)[None, :])  # [B, width]
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
