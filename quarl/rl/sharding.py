"""FSDP2 sharding of the trained model and the weight sync from its shards into each rank's rollout copy.

On many ranks (docs/DISTRIBUTED.md) the trainer keeps two models per process:

  * the trained model, sharded with `torch.distributed.fsdp.fully_shard` per decoder layer plus the root
    (embeddings, final norm, lm_head): each rank holds 1/N of the float32 master weights, their gradients and
    AdamW moments; on a GPU the forward and backward compute in bf16 (`MixedPrecisionPolicy`) and gradients are
    reduced in float32;
  * a full rollout copy, which the rank's own rollout engine reads. Its quantized linears keep only their codes
    and scales (a frozen quantized base, `make_rollout_copy`), everything else is in the compute dtype. It never
    takes gradients.

`ShardedRolloutSync` brings the rollout copy up to date after an optimizer step: decoder layer by decoder layer it
all-gathers the trained parameters (rounded to the compute dtype first, so the transfer is half the size of the
float32 masters and the values are those the single-process sync quantizes) and quantizes each gathered weight
straight into the copy's codes in place (or copies it, for full-precision tensors). At no time is more than one
layer gathered, and no bf16 weight of a quantized linear outlives its own re-quantization.
"""

from __future__ import annotations

import torch
from torch import nn

from quarl.model.qlinear import ROLLOUT_BUFFERS, QuantLinear


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) parameter, the tensor itself otherwise."""
    return t.to_local() if _is_dtensor(t) else t


def full_value(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor of a sharded parameter (an all-gather: every rank must call it), in `dtype` if given."""
    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.full_tensor() if _is_dtensor(t) else t


def shard_model(model: nn.Module, device: torch.device, compute_dtype: torch.dtype) -> nn.Module:
    """fully_shard every decoder layer of a QuarlForCausalLM, then the root; returns the model (now an FSDPModule).

    FSDP averages gradients over the ranks; each rank's loss is already normalised by the whole minibatch (tokens or
    sequences of all ranks), as in the single-process update, so the trainer multiplies it by the world size
    and the average is the single-process gradient. On a GPU the parameters are gathered in
    `compute_dtype` for the forward and gradients reduced in float32; on the CPU everything stays float32.
    Frozen parameters (a LoRA base) are sharded like the others: FSDP gathers them for the forward and never
    reduces their (absent) gradients. A frozen quantized (qlora) base is a buffer, which FSDP leaves whole on
    every rank. MoE blocks stop packing their experts' weights (`SparseMoeBlock.pack_experts`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from quarl.model.moe import SparseMoeBlock

    for module in model.modules():
        if isinstance(module, SparseMoeBlock):  # FSDP swaps the experts' weights in from its own buffers
            module.pack_experts = False
    kwargs = {}
    if device.type == "cuda" and compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def make_rollout_copy(model: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
    """A rollout-only copy of the (not yet sharded) trained model: no gradients, in `compute_dtype` (LoRA adapters
    stay float32, as on one process), and every quantized linear turned into a frozen quantized base, so the copy
    holds 1 (int8 / fp8) or about 0.56 (nvfp4) bytes per weight instead of the 2 of a bf16 weight (plus a
    `compute_dtype` copy of the dequantized weights where the unified flow multiplies bf16 GEMMs, `bf16_gemms`).
    Its codes are quantized from the weights rounded to `compute_dtype`, as on one process. Full-precision linears
    (the bf16 flow, lm_head) keep their weights. A frozen qlora base is not copied: both models read the same
    buffers (its dequantized copy, when kept, cast to `compute_dtype` first)."""
    import copy

    # The copy's tensors are made in their final dtype as the structure is copied (no second float32 model, not
    # even for a moment): floating tensors in compute_dtype, LoRA adapters kept float32.
    memo = {}
    for name, p in model.named_parameters():
        adapter = name.rsplit(".", 1)[-1] in ("lora_A", "lora_B")
        value = p.detach().to(torch.float32 if adapter else compute_dtype, copy=True)
        memo[id(p)] = nn.Parameter(value, requires_grad=False)
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.frozen_base:  # a qlora base is shared below, never copied
            if m.weight_dequant is not None and m.weight_dequant.dtype != compute_dtype:
                # the dequantized base both forwards multiply (`bf16_gemms`), once, in the dtype they multiply
                m.weight_dequant = m.weight_dequant.to(compute_dtype)
            for b in (m.qweight_data, m.qweight_scale, m.qweight_global_scale, m.weight_dequant):
                if b is not None:
                    memo[id(b)] = b
    factors = {}  # smoothing factors by address: the linears of one input group share one tensor's memory
    for name, b in model.named_buffers(remove_duplicate=False):
        if not b.is_floating_point() or id(b) in memo:
            continue
        kind = name.rsplit(".", 1)[-1]
        if kind == "rollout_smoothing":  # float32, as the rollout divides by them, and shared as in the model
            if b.data_ptr() not in factors:
                factors[b.data_ptr()] = b.to(torch.float32, copy=True)
            memo[id(b)] = factors[b.data_ptr()]
        else:  # AQN noise stays float32 as RMSNorm keeps it (noise is added to the norm weight in float32)
            memo[id(b)] = b.to(torch.float32 if kind == "rollout_noise" else compute_dtype, copy=True)
    rollout = copy.deepcopy(model, memo).requires_grad_(False)
    for m, source in zip(rollout.modules(), model.modules()):
        if isinstance(m, QuantLinear) and source.frozen_base:  # a qlora base never changes: share its codes
            m.qweight_data, m.qweight_scale = source.qweight_data, source.qweight_scale
            m.qweight_global_scale, m.weight_dequant = source.qweight_global_scale, source.weight_dequant
        if not isinstance(m, QuantLinear) or m.weight is None or m.rollout_format is None:
            continue
        lora = {k: getattr(m, k) for k in ("lora_A", "lora_B")}
        smoothing, weight = m.rollout_smoothing, m.weight.detach()
        settings = dict(m._settings, frozen_base=True, train_format=None, quantized_backward=False)
        m.configure(**settings)  # re-quantizes from the compute-dtype weight, then drops it
        for k, p in lora.items():  # configure re-initialised the adapters: keep the trained ones
            if p is not None:
                setattr(m, k, p)
        if smoothing is not None:  # configure forgot the factors (SmoothQuant): the base is Q(W diag(s))
            m.rollout_smoothing = smoothing
            m.load_frozen_base(weight)
    return rollout.requires_grad_(False)


def drop_unused_rollout_buffers(model: nn.Module) -> None:
    """Free the quantized rollout buffers of the trained model's linears that train their weight: on many ranks the
    rollout copy holds the quantized weights, and the training forward never reads these (a frozen qlora base,
    which the training forward does read, keeps its buffers)."""
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.weight is not None and not m.frozen_base:
            for name in ROLLOUT_BUFFERS:
                setattr(m, name, None)
            m._qdtypes = m._rollout_source = None


class ShardedRolloutSync:
    """Callable: gather the trained shards layer by layer into the rollout copy and re-quantize it in place.

    trained: the sharded QuarlForCausalLM; rollout: its full, unsharded copy (same module names). Only parameters
    that take gradients travel (a frozen LoRA base never changes, so it is quantized once, when the copy is made).
    Every rank must call it at the same point (it runs collectives).
    """

    def __init__(self, trained: nn.Module, rollout: nn.Module):
        self.trained, self.rollout = trained, rollout
        modules = dict(rollout.named_modules())
        self.groups: list[tuple[list[tuple[torch.Tensor, torch.Tensor | QuantLinear]], list[QuantLinear]]] = []
        layer_names = [f"model.layers.{i}." for i in range(len(trained.model.layers))]
        claimed: set[str] = set()
        for prefix in layer_names + [""]:
            pairs = []  # (trained parameter, rollout parameter it is copied into, or frozen base it quantizes into)
            for name, p in trained.named_parameters():
                if not p.requires_grad or name in claimed or not name.startswith(prefix):
                    continue
                owner, _, attr = name.rpartition(".")
                target = modules.get(owner)
                if target is None:
                    raise RuntimeError(f"the rollout copy has no module {owner}: it was not made from this model")
                claimed.add(name)
                base = isinstance(target, QuantLinear) and attr == "weight" and target.weight is None
                pairs.append((p, target if base else getattr(target, attr)))
            linears = [m for n, m in rollout.named_modules()
                       if isinstance(m, QuantLinear) and f"{n}.".startswith(prefix) and id(m) not in
                       {id(x) for _, ls in self.groups for x in ls}]
            self.groups.append((pairs, linears))

    @torch.no_grad()
    def __call__(self) -> None:
        for pairs, linears in self.groups:
            for trained_param, target in pairs:
                if isinstance(target, QuantLinear):  # gathered in the compute dtype, quantized in place
                    target.load_frozen_base(full_value(trained_param, target.compute_dtype))
                else:
                    target.copy_(full_value(trained_param, target.dtype))
            for m in linears:
                m.refresh(only_if_changed=True)  # weights just copied changed their version; a frozen base did not
