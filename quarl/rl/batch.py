"""Turn rollout outputs into padded training tensors, and compute per-token log-probs of answers.

Layout: each row is prompt + answer, right-padded. Column t of the [B, T-1] log-prob tensors scores token t+1,
so answer token j of a row whose prompt has length P sits in column P-1+j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quarl.rl.mismatch import entropy_from_logits


@dataclass
class RolloutBatch:
    """B sequences (prompt + answer) of one RL step, right-padded to T tokens.

    input_ids [B, T] int64; attention_mask [B, T] int64 (1 = real token); answer_mask [B, T-1] float32 (1 = answer
    token that counts in the loss); behaviour_logprobs [B, T-1] float32 (log μ, 0 outside answers);
    advantages [B] float32; rewards [B] float32; group_index [B] int64 (which prompt the row answers).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    answer_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | list[int]) -> "RolloutBatch":
        """The given rows, trimmed to their longest real sequence (saves compute in micro-batches)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        length = int(self.attention_mask[rows].sum(1).max())
        return RolloutBatch(
            input_ids=self.input_ids[rows, :length],
            attention_mask=self.attention_mask[rows, :length],
            answer_mask=self.answer_mask[rows, : length - 1],
            behaviour_logprobs=self.behaviour_logprobs[rows, : length - 1],
            advantages=self.advantages[rows],
            rewards=self.rewards[rows],
            group_index=self.group_index[rows],
        )


def build_batch(
    prompt_ids: list[list[int]],
    answer_ids: list[list[int]],
    behaviour_logprobs: list[list[float]],
    counts: list[bool],
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    group_index: list[int],
    pad_id: int,
) -> RolloutBatch:
    """Assemble B rows. counts[i] = False masks row i out of the loss entirely (e.g. DAPO overlong filter)."""
    rows = len(answer_ids)
    if not (len(prompt_ids) == len(behaviour_logprobs) == len(counts) == rows):
        raise ValueError("build_batch: prompt_ids, answer_ids, behaviour_logprobs and counts must have equal length")
    total = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids))
    total = max(total, 2)
    input_ids = torch.full((rows, total), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(rows, total, dtype=torch.long)
    answer_mask = torch.zeros(rows, total - 1)
    behaviour = torch.zeros(rows, total - 1)
    for i, (p, a, lp) in enumerate(zip(prompt_ids, answer_ids, behaviour_logprobs)):
        if len(lp) != len(a):
            raise ValueError(f"row {i}: {len(a)} answer tokens but {len(lp)} behaviour log-probs")
        n = len(p) + len(a)
        input_ids[i, :n] = torch.tensor(p + a, dtype=torch.long)
        attention_mask[i, :n] = 1
        start = len(p) - 1
        behaviour[i, start : start + len(a)] = torch.tensor(lp, dtype=torch.float32)
        if counts[i]:
            answer_mask[i, start : start + len(a)] = 1.0
    return RolloutBatch(
        input_ids, attention_mask, answer_mask, behaviour,
        advantages.float(), rewards.float(), torch.tensor(group_index, dtype=torch.long),
    )


def answer_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every next token under logits / temperature, like the rollout engine scores it.

    input_ids, attention_mask [B, T] -> (logprobs [B, T-1] float32, entropy [B, T-1] float32 or None).
    Autograd flows through logprobs when grad is enabled; entropy is always detached.
    """
    logits = model(input_ids, attention_mask=attention_mask)[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].to(logits.device).unsqueeze(-1)
    logprobs = (logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1))
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    return logprobs, entropy
