"""Turn rollout outputs into padded training tensors, and compute per-token log-probs of answers.

Layout: each row is prompt + answer, LEFT-padded so that every row ends in the last column. Column t of the
[B, T-1] log-prob tensors scores token t+1, so all answer tokens lie in the last `answer_width` columns: the
training forward only needs logits there (`logits_to_keep`), which saves most of the lm_head work and memory on
long prompts. Answer token j of a row with an answer of length A sits in column T-1-A+j.

MoE models: `expert_indices` holds the rollout's routing of every token it fed through the model (the prompt and
every answer token but the last), in the same left-padded layout, for router replay and the routing-mismatch metric.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quarl import kernels
from quarl.fast_paths import FastPaths, fast_paths_of
from quarl.model.layers import DecodeStart
from quarl.model.moe import ExpertRouting
from quarl.rl.mismatch import entropy_from_logits


@dataclass
class RolloutBatch:
    """B sequences (prompt + answer) of one RL step, left-padded to T tokens (every row ends in column T-1).

    input_ids [B, T] int64; attention_mask [B, T] int64 (1 = real token); answer_mask [B, T-1] float32 (1 = answer
    token that counts in the loss); behaviour_logprobs [B, T-1] float32 (log μ, 0 outside answers);
    advantages [B] float32 (one per answer) or [B, T-1] float32 (per token, GAE); rewards [B] float32 (the reward
    the advantages come from: the task's plus DAPO's overlong penalty); group_index [B] int64 (which prompt the
    row answers); answer_lengths [B] int64; with a critic (loss.advantage_estimator=gae) also returns [B, T-1]
    float32 (GAE's value targets) and values [B, T-1] float32 (V_old, the critic's values before the update).
    expert_indices int16 [B, T, num_moe_layers, k] or None (MoE rollouts): the experts the rollout routed each token
    to (-1 where it has no record: padding, and each row's last token, which the rollout never fed back).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    answer_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor
    answer_lengths: torch.Tensor
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None
    expert_indices: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def answer_width(self) -> int:
        """Number of trailing log-prob columns that hold every answer token of these rows (>= 1)."""
        return max(1, int(self.answer_lengths.max())) if len(self.answer_lengths) else 1

    def answer_advantages(self, width: int) -> torch.Tensor:
        """The advantages as the loss takes them: [B] per answer, or the last `width` columns [B, width] per token."""
        return self.advantages if self.advantages.dim() == 1 else self.advantages[:, -width:]

    def select(self, rows: torch.Tensor | list[int]) -> "RolloutBatch":
        """The given rows, trimmed on the left to their longest real sequence (saves compute in micro-batches)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        length = max(2, int(self.attention_mask[rows].sum(1).max()))
        columns = lambda t: None if t is None else t[rows, -(length - 1):]  # noqa: E731  ([B, T-1] tensors)
        return RolloutBatch(
            input_ids=self.input_ids[rows, -length:],
            attention_mask=self.attention_mask[rows, -length:],
            answer_mask=columns(self.answer_mask),
            behaviour_logprobs=columns(self.behaviour_logprobs),
            advantages=self.advantages[rows] if self.advantages.dim() == 1 else columns(self.advantages),
            rewards=self.rewards[rows],
            group_index=self.group_index[rows],
            answer_lengths=self.answer_lengths[rows],
            returns=columns(self.returns),
            values=columns(self.values),
            expert_indices=None if self.expert_indices is None else self.expert_indices[rows, -length:],
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
    routing: list[torch.Tensor] | None = None,
) -> RolloutBatch:
    """Assemble B rows. counts[i] = False masks row i out of the loss entirely (e.g. DAPO overlong filter).

    routing (MoE rollouts): per row, integer [len(prompt) + len(answer) - 1, num_moe_layers, k], the experts of every
    token but the last (`Completion.routing`); becomes `expert_indices`.
    """
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
        if not p:
            raise ValueError(f"row {i}: empty prompt (the first answer token needs a token to condition on)")
        n = len(p) + len(a)
        input_ids[i, total - n :] = torch.tensor(p + a, dtype=torch.long)
        attention_mask[i, total - n :] = 1
        if not a:
            continue
        start = total - 1 - len(a)
        behaviour[i, start:] = torch.tensor(lp, dtype=torch.float32)
        if counts[i]:
            answer_mask[i, start:] = 1.0
    expert_indices = None
    if routing is not None:
        if len(routing) != rows or any(r is None for r in routing):
            raise ValueError("build_batch: routing must give one record per row (every completion of a MoE rollout)")
        layers, k = routing[0].shape[1:]
        expert_indices = torch.full((rows, total, layers, k), -1, dtype=torch.int16)
        for i, (p, a, r) in enumerate(zip(prompt_ids, answer_ids, routing)):
            n = len(p) + len(a)
            if tuple(r.shape) != (n - 1, layers, k):
                raise ValueError(f"row {i}: routing of shape {tuple(r.shape)}, expected {(n - 1, layers, k)} (every "
                                 "token but the last)")
            expert_indices[i, total - n:total - 1] = r.to(torch.int16)
    return RolloutBatch(
        input_ids, attention_mask, answer_mask, behaviour,
        advantages.float(), rewards.float(), torch.tensor(group_index, dtype=torch.long),
        torch.tensor([len(a) for a in answer_ids], dtype=torch.long), expert_indices=expert_indices,
    )


def _fused_logprobs_ok(model: torch.nn.Module, input_ids: torch.Tensor, enabled: bool) -> bool:
    """Whether `answer_logprobs` takes `quarl.kernels.token_logprobs`: `enabled` (`FastPaths.fused_logprobs`; the
    log-probs and entropy from the model-dtype logits by one Triton pass forward and one backward instead of a
    float32 copy and log-softmax of the [tokens, vocab] logits), a CUDA bf16/fp16 model and the kernel's first-use
    check passed."""
    dtype = getattr(model, "dtype", None)
    return enabled and input_ids.is_cuda and dtype in (torch.bfloat16, torch.float16) \
        and kernels.training_kernel_ok("token_logprobs", input_ids.device, dtype)


def answer_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    width: int,
    with_entropy: bool = False,
    answer_lengths: torch.Tensor | None = None,
    fast_paths: FastPaths | None = None,
    routing: ExpertRouting | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each of the last `width` tokens under logits / temperature, like the rollout engine scores it.

    input_ids, attention_mask [B, T] (left-padded) -> (logprobs [B, width] float32, entropy [B, width] float32 or
    None): the last `width` columns of the [B, T-1] layout. Autograd flows through logprobs when grad is enabled;
    entropy is always detached. answer_lengths [B] tells the model where each row's decoding began (the last
    prompt token, column T-1-A), which attention layers that mimic an FP8 KV cache need. fast_paths: whose
    `fused_logprobs` decides the path; None = the model's (`QuarlForCausalLM.fast_paths`, which the trainer sets
    from the run's config). routing: a `quarl.model.moe.ExpertRouting` for MoE models (router replay over input_ids'
    [B, T] tokens, and/or a record of the routing); None = own top-k.
    """
    T = input_ids.shape[1]
    width = min(width, T - 1)
    # With its maximum read here once: attention layers that mimic an FP8 KV cache slice by it without a sync.
    decode_start = None if answer_lengths is None else DecodeStart.of(T - 1 - answer_lengths, input_ids.device)
    paths = fast_paths_of(model) if fast_paths is None else fast_paths
    if _fused_logprobs_ok(model, input_ids, paths.fused_logprobs):
        from quarl.kernels.token_logprobs import token_logprobs

        h = model.hidden_states(input_ids, attention_mask=attention_mask, decode_start=decode_start,
                                routing=routing)
        logits = model.lm_head(h[:, -(width + 1):-1])  # [B, width, vocab] in the model dtype, no float32 copy
        t = temperature if temperature > 0 else 1.0
        return token_logprobs(logits, input_ids[:, -width:].to(logits.device), t, with_entropy)
    logits = model(input_ids, attention_mask=attention_mask, logits_to_keep=width + 1,
                   decode_start=decode_start, routing=routing)[:, :-1]  # float32 (float64, float64 model)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -width:].to(logits.device).unsqueeze(-1)
    logprobs = (logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1))
    entropy = None
    if with_entropy:
        with torch.no_grad():  # row by row: the softmax temporaries of a whole micro-batch can be gigabytes
            entropy = torch.cat([entropy_from_logits(row.detach()) for row in logits.split(1)]) \
                if logits.shape[0] else entropy_from_logits(logits.detach())
    return logprobs, entropy
