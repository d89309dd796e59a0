"""Activation smoothing of W8A8 rollouts (SmoothQuant): move activation outliers into the weights.

A per-token 8-bit activation quantizer spends its range on a few outlier channels, and on small models that is
most of the rollout/training mismatch (bench/results/mismatch.md). Smoothing divides each input channel j of a
linear's activations by s_j and multiplies the weight's column j by s_j, which leaves x @ W^T unchanged in exact
arithmetic but flattens the activations the quantizer sees:

    y = Q(x / s) @ Q(W diag(s))^T,   s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha)

with max|x_j| measured once on calibration inputs (the run's first prompts, in full precision) and max|W[:, j]|
over every linear that reads the same input (q/k/v share one s, gate/up another). Only the rollout copy is
smoothed (`QuantLinear.rollout_smoothing`): the training forward and the master weights never see s; the rollout
copy's sync quantizes W diag(s) from the current weights.
"""

from __future__ import annotations

import torch
from torch import nn

from quarl.model.qlinear import QuantLinear

# Training prompts a run calibrates on (with their gold answers): a few full-precision forwards
CALIBRATION_PROMPTS = 64
MIN_FACTOR = 1e-5  # smoothing factors stay within [1e-5, 1e5]


def input_groups(model: nn.Module) -> list[list[QuantLinear]]:
    """The linears of every decoder layer grouped by the input they read (`layer_input_groups`), layer by layer."""
    return [group for layer in model.model.layers for group in layer_input_groups(layer)]


def layer_input_groups(layer: nn.Module) -> list[list[QuantLinear]]:
    """A decoder layer's linears grouped by the input they read, in forward order: [q, k, v], [o], and for a dense
    MLP [gate, up], [down] (mixture-of-experts blocks are left out)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj]]
    if hasattr(mlp, "gate_proj"):
        groups += [[mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
    return groups


@torch.no_grad()
def input_absmax(model: nn.Module, groups: list[list[QuantLinear]], batches) -> list[torch.Tensor]:
    """max |x_j| per input channel of each group's first linear (float32 [in]) over full-precision forwards of
    `batches`: an iterable of (input_ids long [B, T], attention_mask [B, T]); padding positions are left out."""
    from quarl.model.precision_apply import full_precision

    maxima: list[torch.Tensor | None] = [None] * len(groups)
    batch = {}  # the current batch's real (not padding) positions, bool [B * T]

    def hook(index):
        def record(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            x = x[batch["real"]] if batch["real"].numel() == x.shape[0] else x
            m = x.abs().amax(0).float() if x.shape[0] else torch.zeros(x.shape[-1], device=x.device)
            maxima[index] = m if maxima[index] is None else torch.maximum(maxima[index], m)
        return record

    handles = [group[0].register_forward_pre_hook(hook(i)) for i, group in enumerate(groups)]
    try:
        with full_precision(model):
            for ids, mask in batches:
                batch["real"] = mask.to(torch.bool).reshape(-1)
                model.hidden_states(ids, attention_mask=mask)  # the linears' inputs; no vocabulary-wide logits
    finally:
        for h in handles:
            h.remove()
    if any(m is None for m in maxima):
        raise ValueError("smoothing calibration saw no input: pass at least one batch of token ids")
    return maxima


def smoothing_factors(x_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [in] float32 = max|x_j|^alpha / max_i |W[i, j]|^(1 - alpha) over all `weights` [out_k, in] (one input);
    channels where either maximum is 0 keep s = 1; s is kept within [MIN_FACTOR, 1 / MIN_FACTOR]."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"smoothing alpha must be in (0, 1), got {alpha}")
    w_absmax = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)
    x_absmax = x_absmax.float().to(w_absmax.device)
    s = x_absmax.pow(alpha) / w_absmax.pow(1.0 - alpha)
    s = torch.where((x_absmax > 0) & (w_absmax > 0) & torch.isfinite(s), s, torch.ones_like(s))
    # bounded as SmoothQuant bounds it: a channel tiny in calibration must not blow x / s up later
    return s.clamp(min=MIN_FACTOR, max=1.0 / MIN_FACTOR)


def smooth_rollout(model: nn.Module, batches, alpha: float, combine=None) -> int:
    """Calibrate on `batches` (see `input_absmax`) and give every dense decoder linear with a W8A8 rollout copy its
    group's smoothing factors (`QuantLinear.set_rollout_smoothing`, which re-quantizes the copy). combine: maps
    each group's max|x| (float32 [in]) to the one to use, e.g. the maximum over ranks, so that every rank smooths
    alike; None = as measured. Returns the number of linears smoothed."""
    groups = [g for g in input_groups(model) if all(lin.smoothable for lin in g)]
    if not groups:
        return 0
    maxima = input_absmax(model, groups, batches)
    if combine is not None:
        maxima = [combine(m) for m in maxima]
    for group, x_absmax in zip(groups, maxima):
        # one tensor on the weights' device for the whole group: its linears share the factors' memory, which the
        # fused decoder's stacked projections check
        s = smoothing_factors(x_absmax, [lin.weight for lin in group], alpha).to(group[0].weight.device)
        for lin in group:
            lin.set_rollout_smoothing(s)
    return sum(len(g) for g in groups)


def calibration_batches(sequences: list[list[int]], device, batch_size: int = 8):
    """(input_ids long [B, T], attention_mask long [B, T]) batches of `sequences` (token-id lists), right-padded
    with 0s: what `input_absmax` reads."""
    from quarl.model.tokenizer import right_padded

    for i in range(0, len(sequences), batch_size):
        ids, mask = right_padded(sequences[i:i + batch_size])
        yield ids.to(device), mask.to(device)


def calibration_sequences(task, tokenizer, count: int) -> list[list[int]]:
    """Token ids of the first `count` training prompts (rendered as the rollout renders them), each followed by its
    gold answer: calibration inputs that cover prompt and answer positions without generating. A task that renders
    its prompts to token ids (as the engine also accepts them) gives them as they are, without an answer."""
    from quarl.model.tokenizer import encode_prompt

    sequences = []
    for ex in task.train_batch(0, 0, count):
        prompt = task.render(ex)
        if not isinstance(prompt, str):
            sequences.append([int(t) for t in prompt])
            continue
        answer = list(tokenizer(str(ex.gold), add_special_tokens=False).input_ids) if ex.gold else []
        sequences.append(encode_prompt(tokenizer, prompt) + answer)
    return sequences
