"""Sparse mixture-of-experts MLP (Qwen3-MoE) and router replay.

A `SparseMoeBlock` replaces the dense MLP in the MoE layers of a `qwen3_moe` model, computing what transformers'
`Qwen3MoeSparseMoeBlock` computes:

    logits = x @ W_router^T                   [N, E], in the compute dtype (the router is never quantized)
    probs = softmax(logits) in float32        [N, E]
    experts = top-k of probs                  long [N, k]   (or the replayed experts, see below)
    w = probs[experts], / sum(w) if norm_topk_prob, cast to the compute dtype
    y = sum_j w_j * expert_{experts_j}(x),    expert_e(x) = down_e(silu(gate_e(x)) * up_e(x))

Every expert projection is a `QuantLinear` (HF names `experts.{e}.gate_proj` ...), so the precision flow quantizes
each expert on its own exactly as it does a dense MLP; the router (`gate`, a `TopKRouter`) is not a linear module
and stays in full precision under every flow.

Expert computation is grouped: the N x k (token, expert) pairs are sorted by expert, each expert runs once on its
contiguous slice of rows, and the weighted rows are added back into their tokens. `grouped_swiglu` (the reference:
one call per expert that owns rows, each projection a QuantLinear in its current mode, so every precision flow
applies), `grouped_gemm_swiglu` (one grouped GEMM per projection over all experts, torch's grouped_mm; used on
Hopper GPUs for experts whose linears compute plain x @ W^T) and `grouped_w8a8_swiglu` (one grouped W8A8 kernel
launch per projection; used in int8 / fp8 W8A8 rollouts on CUDA) compute the same thing; `expert_path` picks one
(`FastPaths.grouped_experts` turns both grouped paths off).

Router replay (R3): an `ExpertRouting` handed to the forward can carry recorded experts per token and MoE layer;
the block then uses them instead of its own top-k, with the gate weights recomputed from its own router (softmax
over all experts, gathered at the recorded ones, renormalised), so gradients still reach the router. The same
object records, per MoE layer, the experts used and the block's own top-k (for the routing-mismatch metric).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from quarl.fast_paths import DEFAULT as DEFAULT_FAST_PATHS, FastPaths
from quarl.kernels.availability import format_kernels_available
from quarl.model.config import ModelConfig
from quarl.model.qlinear import QuantLinear


class ExpertRouting:
    """Routing instructions and records of one forward through the MoE layers.

    replay: integer [B, T, num_moe_layers, k] (any integer dtype) or None: the experts each token uses in each MoE
        layer (in order of `ModelConfig.moe_layers`). A token whose entry holds a negative value (no record: padding,
        or the last generated token, which the rollout never fed back) uses the layer's own top-k.
    record: keep what each MoE layer did in `used` and `own` (moe ordinal -> long [B, T, k]): the experts it used
        (replayed or its own) and its own top-k. A layer recomputed by activation checkpointing overwrites its
        entries with the same values.
    """

    def __init__(self, replay: torch.Tensor | None = None, record: bool = False):
        if replay is not None and (replay.dim() != 4 or replay.is_floating_point()):
            raise ValueError("ExpertRouting.replay must be an integer tensor [batch, seq_len, moe_layers, k], got "
                             f"{replay.dtype} of shape {tuple(replay.shape)}")
        self.replay = replay
        self.record = bool(record)
        self.used: dict[int, torch.Tensor] = {}
        self.own: dict[int, torch.Tensor] = {}

    def stacked(self, which: str = "used") -> torch.Tensor:
        """The record as long [*tokens, num_moe_layers, k] ("used" or "own"; tokens = [B, T] in a full forward, [B]
        in a decode step: [B, 1]); needs record=True and a forward."""
        table = self.used if which == "used" else self.own
        if not table:
            raise ValueError("no routing was recorded: pass ExpertRouting(record=True) to a forward of a MoE model")
        return torch.stack([table[i] for i in sorted(table)], dim=-2)


class TopKRouter(nn.Module):
    """The router of a MoE layer: weight [num_experts, hidden] (HF's `mlp.gate.weight`).

    Deliberately not a linear module: the precision flow configures every `QuantLinear` (and checks every
    nn.Linear), and the router must stay in full precision (a few quantized logits flip top-k choices).
    """

    def __init__(self, hidden_size: int, num_experts: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> router logits [N, num_experts] in x's dtype."""
        return F.linear(x, self.weight.to(x.dtype))


def routing_weights(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                    experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts and gate weights of every token.

    Args:
        logits: router logits [N, E] (any float dtype).
        top_k: k, experts per token.
        norm_topk_prob: renormalise the k weights to sum to 1.
        experts: integer [N, k] experts to use (router replay; rows with a negative entry use their own top-k),
            or None = every token's own top-k.
    Returns:
        (experts long [N, k], weights [N, k] in float32 (float64 for float64 logits), own top-k long [N, k]).
        The weights are differentiable w.r.t. logits (softmax over all E, gathered at the chosen experts).
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(dtype), dim=-1)
    own = torch.topk(probs, top_k, dim=-1).indices
    if experts is None:
        chosen = own
    else:
        if experts.shape != own.shape:
            raise ValueError(f"replayed experts have shape {tuple(experts.shape)}, but this layer routes "
                             f"{tuple(own.shape)} (tokens x top-k); the record belongs to another batch or model")
        experts = experts.to(device=own.device, dtype=torch.long)
        if bool((experts >= logits.shape[-1]).any()):
            raise ValueError(f"replayed expert ids reach {int(experts.max())}, but this layer has "
                             f"{logits.shape[-1]} experts; the record belongs to another model")
        recorded = (experts >= 0).all(-1, keepdim=True)
        chosen = torch.where(recorded, experts, own)
    weights = probs.gather(-1, chosen)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return chosen, weights, own


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert.

    experts: long [N, k]. Returns (order long [N*k]: flat pair indices sorted by expert, stable, so each expert's
    rows keep token order; counts long [num_experts]: pairs per expert). Pair p belongs to token p // k. No host
    sync (a scatter-add rather than bincount, whose output size depends on the values).
    """
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def grouped_swiglu(x_sorted: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleList,
                   every_expert_gradient: bool = False) -> torch.Tensor:
    """SwiGLU of each expert over its contiguous rows: rows counts[:e].sum() ... counts[:e+1].sum() go through
    experts[e] (down(silu(gate(x)) * up(x)), each projection a QuantLinear in its current mode).

    x_sorted: [M, hidden] rows sorted by expert; counts: long [E] with counts.sum() == M. Returns [M, hidden] in the
    experts' output dtype. The reference path, which serves every precision flow: one call per expert that owns
    rows (the counts are read on the host once). every_expert_gradient: also give the trainable parameters of the
    experts without rows a zero gradient (sharded training: FSDP reduces each layer's gradients as one collective,
    which must cover the same parameters on every rank). `grouped_gemm_swiglu` computes the same with one grouped GEMM per
    projection where the experts compute plain x @ W^T, `grouped_w8a8_swiglu` with one grouped W8A8 kernel launch
    per projection in int8 / fp8 rollouts.
    """
    out = x_sorted.new_empty(x_sorted.shape[0], experts[0].down_proj.out_features)
    start, idle = 0, []
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = x_sorted[start:start + n]
            out[start:start + n] = experts[e](rows)
            start += n
        else:
            idle.append(experts[e])
    if every_expert_gradient and idle and torch.is_grad_enabled():
        # a zero term that reaches every trainable parameter of the idle experts: each gets a (zero) gradient
        touch = [p.reshape(-1)[:1].sum() for expert in idle for p in expert.parameters() if p.requires_grad]
        if touch:
            out = out + (torch.stack(touch).sum() * 0).to(out.dtype)
    return out


def stacked_weights(weights: list[torch.Tensor]) -> torch.Tensor:
    """The experts' weights [out, in] as one [E, out, in] tensor: a view of their memory when they are consecutive
    slices of one packed tensor (`pack_expert_weights`), else a stacked copy (E times out x in elements, at every
    call: tens of GB per forward on a 30B MoE model)."""
    w0 = weights[0]
    if packed(weights):  # one storage holds them, in order: the view reads exactly the weights' current values
        return w0.detach().as_strided((len(weights), *w0.shape), (w0.numel(), w0.shape[1], 1))
    return torch.stack(weights)


def packed(weights: list[torch.Tensor]) -> bool:
    """Whether the [out, in] weights are consecutive slices of one storage, in order (`pack_expert_weights`)."""
    w0 = weights[0]
    n, storage = w0.numel(), w0.untyped_storage().data_ptr()
    return w0.is_contiguous() and all(
        w.is_contiguous() and w.shape == w0.shape and w.dtype == w0.dtype and w.device == w0.device
        and w.untyped_storage().data_ptr() == storage
        and w.data_ptr() == w0.data_ptr() + e * n * w0.element_size() for e, w in enumerate(weights))


@torch.inference_mode(False)  # a packed weight must stay a normal tensor: training saves it for backward
@torch.no_grad()  # (inside: inference_mode(False) would turn grad mode back on)
def pack_expert_weights(experts: nn.ModuleList) -> bool:
    """Move every expert's gate, up and down weights into one [E, out, in] tensor per projection, each expert's
    weight becoming a view of its slice (same values, same Parameter objects, so optimizers and their states are
    untouched), so the grouped GEMM reads them in place (`stacked_weights`). Skips projections already packed and
    those whose weights are absent (a qlora base), distributed tensors or unlike in shape, dtype or device. Never
    for a model FSDP shards (`SparseMoeBlock.pack_experts`): its forward swaps in unsharded weights that are views
    of FSDP's own gather buffers. A later `.to()` or an assigned state dict gives the weights new memory again;
    `stacked_weights` then stacks copies until the next packing. Returns whether anything moved. Not during
    CUDA-graph capture."""
    moved = False
    for name in PROJECTIONS:
        weights = [getattr(e, name).weight for e in experts]
        if any(w is None or type(w.data) is not torch.Tensor for w in weights):
            continue
        w0 = weights[0]
        if any(w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device for w in weights):
            continue
        if packed(weights):
            continue
        together = torch.stack([w.detach() for w in weights])
        for e, w in enumerate(weights):
            w.data = together[e]
        moved = True
    return moved


def _packed_key(experts: nn.ModuleList) -> tuple:
    """Where each projection's first and last expert weights live: changes when a `.to()` or an assigned state
    dict gave the weights new memory (a cheap test for re-packing; `stacked_weights` checks every expert)."""
    return tuple(None if getattr(experts[i], name).weight is None else getattr(experts[i], name).weight.data_ptr()
                 for name in PROJECTIONS for i in (0, -1))


class _GroupedLinear(torch.autograd.Function):
    """y[rows of group e] = x[rows of group e] @ W_e^T for contiguous row groups, one grouped GEMM each way.

    The experts' weights are read in place when packed (`pack_expert_weights`), else stacked on the fly; backward
    keeps the weights themselves (parameters, no memory) rather than a stacked copy, so autograd holds no second
    copy of every expert.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offsets, *weights)
        return F.grouped_mm(x, stacked_weights(weights).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = F.grouped_mm(grad, stacked_weights(weights), offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            # [out, M] @ [M, in] with groups along M -> [E, out, in]; an expert without rows gets zeros
            stacked = F.grouped_mm(grad.t(), x, offs=offsets)
            grad_w = [g if need else None for g, need in zip(stacked.unbind(0), ctx.needs_input_grad[2:])]
        return grad_x, None, *grad_w


def grouped_gemm_swiglu(x_sorted: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """What `grouped_swiglu` computes, with one grouped GEMM per projection over all experts (torch's grouped_mm)
    and no host sync. Only for experts whose projections compute plain x @ W^T (`plain_experts`); x_sorted's rows
    and every projection's sizes must span multiples of 16 bytes (grouped_mm's alignment). Differentiable w.r.t.
    x_sorted and the master weights. x_sorted [M, hidden], counts long [E] -> [M, hidden] in x_sorted's dtype."""
    offsets = counts.cumsum(0).to(torch.int32)
    gate = _GroupedLinear.apply(x_sorted, offsets, *[e.gate_proj.weight for e in experts])
    up = _GroupedLinear.apply(x_sorted, offsets, *[e.up_proj.weight for e in experts])
    return _GroupedLinear.apply(F.silu(gate) * up, offsets, *[e.down_proj.weight for e in experts])


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _projections(experts: nn.ModuleList):
    """Every expert's gate, up and down QuantLinear, expert by expert."""
    return (getattr(expert, name) for expert in experts for name in PROJECTIONS)


def plain_experts(experts: nn.ModuleList, x: torch.Tensor) -> bool:
    """Whether every expert projection computes plain x @ W^T in its current mode (a master weight in x's dtype,
    no bias, no adapter, no quantization in this mode) with sizes grouped_mm can align (multiples of 16 bytes)."""
    size = x.element_size()
    for lin in _projections(experts):
        fmt = lin.rollout_format if lin.rollout else lin.train_format
        if lin.weight is None or lin.weight.dtype != x.dtype or lin.bias is not None or lin.lora_rank or \
                fmt is not None or (lin.in_features * size) % 16 or (lin.out_features * size) % 16:
            return False
    return True


def grouped_gemm_ok(experts: nn.ModuleList, x: torch.Tensor, fast_paths: FastPaths) -> bool:
    """Whether `grouped_gemm_swiglu` serves x: `fast_paths.grouped_experts`, a CUDA bf16 x on a `grouped_mm_device`
    (grouped_mm's kernels), torch with grouped_mm, and plain experts."""
    return fast_paths.grouped_experts and x.dtype == torch.bfloat16 and grouped_mm_device(x.device) and \
        plain_experts(experts, x)


def grouped_mm_device(device: torch.device) -> bool:
    """Whether torch's grouped_mm runs its own kernels on `device`: a CUDA GPU of compute capability 9.x (Hopper) or
    10.x (datacenter Blackwell). Elsewhere torch loops over the groups after reading their sizes on the host, which
    a CUDA graph cannot capture."""
    from quarl.kernels.availability import capability

    return device.type == "cuda" and hasattr(F, "grouped_mm") and capability(device)[0] in (9, 10)


# Rollout formats the grouped W8A8 kernel computes: 8-bit codes with one scale per output channel and per token.
GROUPED_W8A8_FORMATS = ("int8", "fp8")


def grouped_w8a8_ok(experts: nn.ModuleList, x: torch.Tensor, fast_paths: FastPaths) -> bool:
    """Whether `grouped_w8a8_swiglu` serves x: `fast_paths.grouped_experts`, a CUDA bf16/fp16 x that needs no
    gradient (a rollout forward; the kernel has no backward), the format's Triton kernels available on x's device,
    and every expert projection a QuantLinear in rollout mode with the same W8A8 rollout format (int8 or fp8, not
    weight-only), no bias, no LoRA adapter and its rollout codes on x's device."""
    if not (fast_paths.grouped_experts and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    fmt = experts[0].gate_proj.rollout_format
    if not _w8a8_rollout_copies(experts, fmt, x.device) or not all(lin.rollout for lin in _projections(experts)):
        return False
    if experts[0].gate_proj.rollout_avoids_kernel():
        return False  # the unified flow on bf16 GEMMs: the rollout multiplies as training does, per expert
    if experts[0].gate_proj.kernel_forward and not _grouped_training_device(experts, x):
        # the unified flow: the rollout multiplies what training multiplies, so only where training takes the
        # grouped kernel too (else both take the per-expert kernels)
        return False
    return format_kernels_available(fmt, x.device)


def _w8a8_rollout_copies(experts: nn.ModuleList, fmt: str | None, device: torch.device) -> bool:
    """Whether every expert projection holds a W8A8 rollout copy in `fmt` (int8 or fp8, not weight-only) on `device`,
    with no bias and no LoRA adapter: what the grouped W8A8 kernel multiplies."""
    return fmt in GROUPED_W8A8_FORMATS and all(
        lin.rollout_format == fmt and not lin.weight_only and lin.bias is None and not lin.lora_rank and
        lin.qweight_data is not None and lin.qweight_data.device == device for lin in _projections(experts))


def _grouped_training_device(experts: nn.ModuleList, x: torch.Tensor) -> bool:
    """Whether x and the experts' sizes suit the grouped training path's backward (torch's grouped_mm): CUDA bf16 on
    a `grouped_mm_device`, every projection's rows a multiple of 16 bytes."""
    e = experts[0]
    return x.dtype == torch.bfloat16 and grouped_mm_device(x.device) and \
        all((n * 2) % 16 == 0 for lin in (e.gate_proj, e.down_proj) for n in (lin.in_features, lin.out_features))


def _expert_tables(experts: nn.ModuleList) -> tuple:
    """The gate, up and down `ExpertTable`s of the experts' rollout copies, kept on the ModuleList and rebuilt when
    any code or scale buffer moved. The sync re-quantizes the buffers in place (same addresses), so the tables
    stay valid across steps, and a CUDA graph that captured them reads the current codes."""
    from quarl.kernels.grouped_w8a8 import expert_table

    projections = [[getattr(e, name) for e in experts] for name in PROJECTIONS]
    fmt = projections[0][0].rollout_format
    key = (fmt, *(p for lins in projections for lin in lins
                  for p in (lin.qweight_data.data_ptr(), lin.qweight_scale.data_ptr())))
    cached = getattr(experts, "_grouped_w8a8_tables", None)
    if cached is None or cached[0] != key:
        tables = []
        for lins in projections:
            copies = [lin.qweight for lin in lins]  # typed views of the buffers (same addresses)
            tables.append(expert_table(fmt, [q.data for q in copies], [q.scale for q in copies]))
        cached = (key, tuple(tables))
        experts._grouped_w8a8_tables = cached
    return cached[1]


def grouped_w8a8_swiglu(x_sorted: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleList,
                        tables: tuple | None = None) -> torch.Tensor:
    """What `grouped_swiglu` computes in an int8 / fp8 W8A8 rollout, with one grouped W8A8 kernel launch per
    projection over all experts (`quarl.kernels.grouped_w8a8`) and no host sync (the caller checked
    `grouped_w8a8_ok`). gate and up share one quantization of x_sorted's rows; down quantizes silu(gate) * up.
    Per row the same codes, scales and epilogue as the dense W8A8 kernel without split-K.

    x_sorted [M, hidden] bf16/fp16 (rows sorted by expert, contiguous), counts long [E] (rows per expert, on the
    device) -> [M, hidden] in x_sorted's dtype. No gradient. tables: `_expert_tables(experts)` when the caller
    knows them current (skips checking every expert's buffers)."""
    from quarl.kernels.grouped_w8a8 import grouped_w8a8_matmul

    return _w8a8_swiglu(x_sorted, counts, tables if tables is not None else _expert_tables(experts),
                        lambda x, codes, ends, table, name: grouped_w8a8_matmul(*codes, ends, table, x.dtype))


def _w8a8_swiglu(x_sorted: torch.Tensor, counts: torch.Tensor, tables: tuple, project) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) of every expert over its rows, each projection by
    project(x, (codes, scales), ends, table, name): gate and up share one quantization of x_sorted's rows, down
    quantizes silu(gate) * up. x_sorted [M, hidden] (rows sorted by expert), counts long [E] on the device."""
    from quarl.kernels.act_quant import quantize_activation

    gate_t, up_t, down_t = tables
    ends = counts.cumsum(0).to(torch.int32)
    x_sorted = x_sorted.contiguous()
    with torch.no_grad():
        codes = quantize_activation(x_sorted.detach(), gate_t.fmt, gate_t.k)
    h = F.silu(project(x_sorted, codes, ends, gate_t, "gate_proj")) * project(x_sorted, codes, ends, up_t, "up_proj")
    h = h.contiguous()
    with torch.no_grad():
        codes = quantize_activation(h.detach(), down_t.fmt, down_t.k)
    return project(h, codes, ends, down_t, "down_proj")


def grouped_w8a8_training_ok(experts: nn.ModuleList, x: torch.Tensor, fast_paths: FastPaths) -> bool:
    """Whether `grouped_w8a8_training_swiglu` serves x: the unified flow's training forward on the rollout's int8 /
    fp8 W8A8 kernel (`QuantLinear.kernel_forward`) for every expert projection (same format, no bias, no LoRA
    adapter, no quantized backward, its rollout copy on x's device), `fast_paths.grouped_experts`, a CUDA bf16 x
    on a `grouped_mm_device` (the backward's grouped_mm) with sizes grouped_mm can align, and the kernels."""
    if not (fast_paths.grouped_experts and _grouped_training_device(experts, x)):
        return False
    fmt = experts[0].gate_proj.train_format
    if not _w8a8_rollout_copies(experts, fmt, x.device) or not all(
            not lin.rollout and lin.kernel_forward and not lin.quantized_backward and lin.train_format == fmt and
            lin.weight is not None for lin in _projections(experts)):
        return False
    return format_kernels_available(fmt, x.device)


class _GroupedKernelLinear(torch.autograd.Function):
    """Attach the straight-through gradients of each expert's y_e = Q(x_e) @ Q(W_e)^T to rows a grouped kernel
    computed: `QuantLinear`'s unified kernel forward (`_KernelLinear`) for all experts at once.

    Forward returns y [M, N] itself. Backward: x [M, K] gets g @ Q(W_e) row group by row group (one grouped GEMM of
    the experts' dequantized codes), W_e [N, K] gets g_e^T @ Q(x_e) (one grouped GEMM, Q(x) recomputed from x).
    offsets: int32 [E], the running row count after each expert. The experts' codes and scales are saved as
    tensors, so autograd refuses a backward after an in-place re-quantization of the rollout copies."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, fmt: str, experts: int,
                *tensors: torch.Tensor) -> torch.Tensor:
        weights, codes, scales = tensors[:experts], tensors[experts:2 * experts], tensors[2 * experts:]
        ctx.save_for_backward(x, offsets, *codes, *scales)
        ctx.fmt, ctx.experts, ctx.shape, ctx.weight_dtype = fmt, experts, weights[0].shape, weights[0].dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from quarl import kernels
        from quarl.formats import QuantizedTensor

        x, offsets, *rest = ctx.saved_tensors
        e = ctx.experts
        grad = grad.contiguous()
        grad_x, grad_w = None, [None] * e
        if ctx.needs_input_grad[1]:
            dequantized = torch.stack([kernels.dequantize(QuantizedTensor(ctx.fmt, "weight", c, s, None, ctx.shape),
                                                          grad.dtype) for c, s in zip(rest[:e], rest[e:])])
            grad_x = F.grouped_mm(grad, dequantized, offs=offsets)
        needs_w = ctx.needs_input_grad[5:5 + e]
        if any(needs_w):
            xq = kernels.fake_quantize_activation(x.detach(), ctx.fmt)
            # [N, M] @ [M, K] with groups along M -> [E, N, K]; an expert without rows gets zeros
            stacked = F.grouped_mm(grad.t(), xq, offs=offsets)
            grad_w = [g.to(ctx.weight_dtype) if need else None for g, need in zip(stacked.unbind(0), needs_w)]
        return None, grad_x, None, None, None, *grad_w, *([None] * (2 * e))


def _grouped_kernel_linear(x: torch.Tensor, codes: tuple, ends: torch.Tensor, table, linears: list) -> torch.Tensor:
    """One projection of every expert over its rows: the grouped W8A8 kernel on x's activation codes (xq, xs) and
    the experts' rollout copies, with `_GroupedKernelLinear`'s gradients to x and the master weights."""
    from quarl.kernels.grouped_w8a8 import grouped_w8a8_matmul

    with torch.no_grad():
        y = grouped_w8a8_matmul(*codes, ends, table, x.dtype)
    copies = [lin.qweight for lin in linears]
    return _GroupedKernelLinear.apply(y, x, ends, table.fmt, len(linears), *[lin.weight for lin in linears],
                                      *[q.data for q in copies], *[q.scale for q in copies])


def grouped_w8a8_training_swiglu(x_sorted: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """The unified flow's training forward of every expert (what `grouped_swiglu` computes through each
    `QuantLinear`'s kernel forward) with the rollout's grouped W8A8 kernel: the same codes, kernel and epilogue as
    `grouped_w8a8_swiglu`, so training computes the function the rollout sampled from, with straight-through
    gradients to x_sorted and the experts' master weights. Rollout copies an optimizer step made stale are
    re-quantized in place first, as `QuantLinear` does. x_sorted [M, hidden] bf16 (rows sorted by expert),
    counts long [E] on the device -> [M, hidden] bf16. The caller checked `grouped_w8a8_training_ok`."""
    with torch.no_grad():
        for lin in _projections(experts):
            if not lin._rollout_copy_current():
                lin.refresh()
    return _w8a8_swiglu(x_sorted, counts, _expert_tables(experts), lambda x, codes, ends, table, name:
                        _grouped_kernel_linear(x, codes, ends, table, [getattr(e, name) for e in experts]))


def expert_path(experts: nn.ModuleList, x: torch.Tensor, fast_paths: FastPaths):
    """The grouped SwiGLU that serves x in the experts' current mode: `grouped_gemm_swiglu` (plain experts in bf16
    on Hopper), `grouped_w8a8_swiglu` (int8 / fp8 W8A8 rollouts on CUDA), `grouped_w8a8_training_swiglu` (the
    unified flow's training forward on those kernels, on Hopper), else `grouped_swiglu` (the reference, which reads
    the per-expert counts on the host)."""
    if grouped_gemm_ok(experts, x, fast_paths):
        return grouped_gemm_swiglu
    if grouped_w8a8_ok(experts, x, fast_paths):
        return grouped_w8a8_swiglu
    if grouped_w8a8_training_ok(experts, x, fast_paths):
        return grouped_w8a8_training_swiglu
    return grouped_swiglu


def moe_experts(x: torch.Tensor, experts_idx: torch.Tensor, weights: torch.Tensor, experts: nn.ModuleList,
                swiglu=grouped_swiglu) -> torch.Tensor:
    """sum_j weights[:, j] * experts[experts_idx[:, j]](x), computed by sorting (token, expert) pairs by expert.

    x [N, hidden]; experts_idx long [N, k]; weights [N, k] (cast to x's dtype, as transformers does);
    swiglu: the grouped SwiGLU (x_sorted, counts, experts) -> rows, `expert_path`'s choice (default the reference,
    `grouped_swiglu`). Returns [N, hidden] in x's dtype.
    """
    N, k = experts_idx.shape
    order, counts = sort_by_expert(experts_idx, len(experts))
    token = order // k
    y = swiglu(x.index_select(0, token), counts, experts)
    y = y * weights.reshape(-1).index_select(0, order).to(y.dtype)[:, None]
    # back to (token, slot) order, then one sum over the k slots (at least float32): the same sum in the same order
    # on every call (an index_add over tokens accumulates with atomics on a GPU, in whichever order they land, so
    # eager and graph-replayed decoding, or two rollouts, could differ in the last bit). In bf16 this rounds once,
    # where transformers' index_add rounds after each expert: the two differ in the last bits.
    pairs = y.new_empty(N * k, y.shape[-1]).index_copy(0, order, y)
    return pairs.reshape(N, k, -1).sum(1, dtype=torch.promote_types(y.dtype, torch.float32)).to(x.dtype)


class Expert(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), every projection a QuantLinear (HF names gate/up/down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = QuantLinear(hidden_size, intermediate_size, bias=False)
        self.up_proj = QuantLinear(hidden_size, intermediate_size, bias=False)
        self.down_proj = QuantLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, hidden] -> [M, hidden]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse MLP (see the module docstring). `moe_index`: this block's ordinal among the MoE layers,
    which indexes `ExpertRouting` records."""

    def __init__(self, config: ModelConfig, moe_index: int, fast_paths: FastPaths = DEFAULT_FAST_PATHS):
        super().__init__()
        self.moe_index = moe_index
        self.fast_paths = fast_paths  # `grouped_experts` (set by the model: `QuarlForCausalLM.set_fast_paths`)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = TopKRouter(config.hidden_size, config.num_experts)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.rollout = False
        # set by a sharded trainer: every expert gets a gradient on every rank (see `grouped_swiglu`)
        self.every_expert_gradient = False
        self._rollout_swiglu: tuple | None = None  # (what it served, the SwiGLU chosen in this rollout, its copy)
        # pack the experts' weights for the grouped GEMM (`pack_expert_weights`); off in a model FSDP shards
        self.pack_experts = True
        self._packed_at: tuple | None = None  # where the expert weights were when last packed (`_pack_experts`)

    def set_rollout(self, on: bool) -> None:
        """Rollout mode on or off (`QuarlForCausalLM.set_rollout` calls every module's); either way the expert path
        is chosen again at the next forward."""
        self.rollout = bool(on)
        self._rollout_swiglu = None

    def _swiglu(self, x: torch.Tensor):
        """`expert_path`'s choice for x. In rollout mode it is chosen once per rollout, with the W8A8 kernel's
        address tables: the experts do not change while an engine serves, and checking each of every expert's
        projections (hundreds per layer) costs more host time than the layer's kernels at every decode step."""
        if not self.rollout:
            swiglu = expert_path(self.experts, x, self.fast_paths)
            if swiglu is grouped_swiglu and self.every_expert_gradient:
                return functools.partial(grouped_swiglu, every_expert_gradient=True)
            if swiglu is grouped_gemm_swiglu:
                self._pack_experts()
            return swiglu
        # the first projection's mode and rollout copy stand for all (full_precision() and configure() change every
        # one); the copy is kept referenced by the cache, so its id cannot pass to a new tensor
        first = self.experts[0].gate_proj
        key = (x.device, x.dtype, torch.is_grad_enabled() and x.requires_grad, self.fast_paths, first.rollout,
               first.rollout_format, id(first.qweight_data))
        if self._rollout_swiglu is None or self._rollout_swiglu[0] != key:
            swiglu = expert_path(self.experts, x, self.fast_paths)
            if swiglu is grouped_w8a8_swiglu:
                swiglu = functools.partial(grouped_w8a8_swiglu, tables=_expert_tables(self.experts))
            elif swiglu is grouped_gemm_swiglu:
                self._pack_experts()
            self._rollout_swiglu = (key, swiglu, first.qweight_data)
        return self._rollout_swiglu[1]

    def _pack_experts(self) -> None:
        """`pack_expert_weights` where `pack_experts` allows, unless the weights still sit where the last packing
        put them. Not while a CUDA graph is captured (its replays read the memory as it is) nor on a side stream
        (the fast engine's warm-up: the packed tensor would belong to that stream's memory pool)."""
        if not self.pack_experts:
            return
        key = _packed_key(self.experts)
        if key == self._packed_at:
            return
        if self.experts[0].gate_proj.weight is not None and self.experts[0].gate_proj.weight.is_cuda and (
                torch.cuda.is_current_stream_capturing()
                or torch.cuda.current_stream() != torch.cuda.default_stream()):
            return
        pack_expert_weights(self.experts)
        self._packed_at = _packed_key(self.experts)

    @property
    def rollout_path_host_free(self) -> bool:
        """Whether the expert path this rollout chose (at its first forward) runs without reading anything on the
        host, so a CUDA graph can capture the block: a grouped path, not the per-expert reference, which reads
        the token counts. False before the rollout's first forward."""
        return self._rollout_swiglu is not None and self._rollout_swiglu[1] is not grouped_swiglu

    def forward(self, x: torch.Tensor, routing: ExpertRouting | None = None) -> torch.Tensor:
        """x [..., hidden] (e.g. [B, T, hidden], or [B, hidden] in a decode step) -> the same shape and dtype.

        routing: replayed experts for these tokens (`replay[..., moe_index, :]` must have x's leading shape) and/or
        where to record the routing; None = own top-k, nothing recorded.
        """
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        replay = None
        if routing is not None and routing.replay is not None:
            replay = routing.replay[..., self.moe_index, :]
            if replay.shape[:-1] != lead:
                raise ValueError(f"router replay covers tokens {tuple(replay.shape[:-1])}, but this forward has "
                                 f"{tuple(lead)}; pass the record of exactly these input_ids")
            replay = replay.reshape(-1, replay.shape[-1])
        chosen, weights, own = routing_weights(self.gate(flat), self.top_k, self.norm_topk_prob, replay)
        if routing is not None and routing.record:
            routing.used[self.moe_index] = chosen.reshape(*lead, self.top_k)
            routing.own[self.moe_index] = own.reshape(*lead, self.top_k)
        # transformers casts the routing weights to the compute dtype before weighting the experts' outputs
        swiglu = self._swiglu(flat)
        return moe_experts(flat, chosen, weights.to(x.dtype), self.experts, swiglu).reshape(x.shape)


def routing_mismatch(recorded: torch.Tensor, computed: torch.Tensor) -> tuple[float, int]:
    """Fraction of routing decisions that differ: for every token with a record (no negative entry) and MoE layer,
    the recorded experts that are not among the computed ones, over all k choices.

    recorded, computed: integer [..., k] of the same shape (order within k ignored). Returns (fraction, number of
    decisions compared); (0.0, 0) when nothing was recorded.
    """
    if recorded.shape != computed.shape:
        raise ValueError(f"routing records differ in shape: {tuple(recorded.shape)} vs {tuple(computed.shape)}")
    recorded, computed = recorded.long(), computed.long().to(recorded.device)
    valid = (recorded >= 0).all(-1)
    if not bool(valid.any()):
        return 0.0, 0
    rec, com = recorded[valid], computed[valid]  # [M, k]
    found = (rec[:, :, None] == com[:, None, :]).any(-1)
    return float((~found).float().mean()), int(found.numel())
