"""FSDP2 sharding of the trained model and the weight sync from its shards into each rank's rollout copy.

On many ranks (docs/DISTRIBUTED.md) the trainer keeps two models per process:

  * the trained model, sharded with `torch.distributed.fsdp.fully_shard` per decoder layer plus the root
    (embeddings, final norm, lm_head): each rank holds 1/N of the float32 master weights, their gradients and
    AdamW moments; on a GPU the forward and backward compute in bf16 (`MixedPrecisionPolicy`) and gradients are
    reduced in float32;
  * a full rollout copy in the compute dtype, quantized as the precision flow says, which the rank's own rollout
    engine reads. It never takes gradients.

`ShardedRolloutSync` brings the rollout copy up to date after an optimizer step: decoder layer by decoder layer it
all-gathers the trained parameters (rounded to the compute dtype first, so the transfer is half the size of the
float32 masters and the values are those the single-process sync quantizes) into the copy and re-quantizes that
layer's linears in place. At no time is more than one layer gathered.
"""

from __future__ import annotations

import torch
from torch import nn

from quarl.model.qlinear import QuantLinear


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
    (`loss_scale_for_ranks`) and the average is the single-process gradient. On a GPU the parameters are gathered in
    `compute_dtype` for the forward and gradients reduced in float32; on the CPU everything stays float32.
    Frozen parameters (a LoRA base) are sharded like the others: FSDP gathers them for the forward and never
    reduces their (absent) gradients. A frozen quantized (qlora) base is a buffer, which FSDP leaves whole on
    every rank.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if device.type == "cuda" and compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def drop_unused_rollout_buffers(model: nn.Module) -> None:
    """Free the quantized rollout buffers of the trained model's linears that train their weight: on many ranks the
    rollout copy holds the quantized weights, and the training forward never reads these (a frozen qlora base,
    which the training forward does read, keeps its buffers)."""
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.weight is not None and not m.frozen_base:
            m.qweight_data = m.qweight_scale = m.qweight_global_scale = m.weight_dequant = None
            m._qdtypes = m._rollout_source = None


class ShardedRolloutSync:
    """Callable: gather the trained shards layer by layer into the rollout copy and re-quantize it in place.

    trained: the sharded QuarlForCausalLM; rollout: its full, unsharded copy (same module names). Only parameters
    that take gradients travel (a frozen LoRA base never changes, so it is quantized once, when the copy is made).
    Every rank must call it at the same point (it runs collectives).
    """

    def __init__(self, trained: nn.Module, rollout: nn.Module):
        self.trained, self.rollout = trained, rollout
        rollout_params = dict(rollout.named_parameters())
        self.groups: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], list[QuantLinear]]] = []
        layer_names = [f"model.layers.{i}." for i in range(len(trained.model.layers))]
        claimed: set[str] = set()
        for prefix in layer_names + [""]:
            pairs = []
            for name, p in trained.named_parameters():
                if not p.requires_grad or name in claimed or not name.startswith(prefix):
                    continue
                if name not in rollout_params:
                    raise RuntimeError(f"the rollout copy has no parameter {name}: it was not made from this model")
                claimed.add(name)
                pairs.append((p, rollout_params[name]))
            linears = [m for n, m in rollout.named_modules()
                       if isinstance(m, QuantLinear) and f"{n}.".startswith(prefix) and id(m) not in
                       {id(x) for _, ls in self.groups for x in ls}]
            self.groups.append((pairs, linears))

    @torch.no_grad()
    def __call__(self) -> None:
        for pairs, linears in self.groups:
            for trained_param, rollout_param in pairs:
                rollout_param.copy_(full_value(trained_param, rollout_param.dtype))
            for m in linears:
                m.refresh(only_if_changed=True)  # weights just copied changed their version; a frozen base did not
