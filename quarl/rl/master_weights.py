"""AdamW with float32 master weights for 16-bit models: mixed precision as every serious trainer does it.

The model keeps computing in its 16-bit dtype (bf16 on a GPU: the training forward, the rollout copies and the
quantizer all read those values), while the optimizer owns a float32 master copy of every 16-bit trainable
parameter:

    backward        the 16-bit gradient of each parameter is added into its master's float32 `.grad` as soon as
                    autograd has accumulated it (a post-accumulate hook), then freed;
    step            AdamW updates the float32 masters (float32 moments), then each 16-bit parameter is set to its
                    master rounded to nearest.

AdamW directly on bf16 parameters rounds most small updates away (a bf16 weight of 0.02 moves in steps of 1.2e-4,
so an lr of 1e-6 changes almost nothing); with masters the small updates accumulate in float32 until they move the
bf16 value. Float32 parameters (a CPU run, LoRA adapters, which are float32 already) are their own masters.

Memory per 16-bit trainable parameter: 2 bytes (the bf16 weight) + 4 (master) + 4 (float32 gradient) + 8 (AdamW
moments) = 18 bytes, against 8 for AdamW on the bf16 weights alone (bf16 weight, gradient and moments), plus the
rollout copy in every flow.
"""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


class MasterWeightAdamW:
    """AdamW over float32 masters of the given parameters (see the module docstring).

    The interface the trainer and checkpoints use: `param_groups`, `zero_grad`, `clip_grad_norm_`, `step`,
    `state_dict`, `load_state_dict`, and `masters` (the float32 tensors the optimizer updates, one per parameter,
    in order; a float32 parameter is its own master).
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0):
        self.params = list(params)
        if not self.params:
            raise ValueError("MasterWeightAdamW got no parameters to optimize")
        self.masters: list[torch.Tensor] = []
        self._hooks = []
        for p in self.params:
            if p.dtype in HALF_DTYPES:
                master = p.detach().float().clone().requires_grad_(True)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._move_grad_to(master)))
            else:
                master = p
            self.masters.append(master)
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, weight_decay=weight_decay)

    @staticmethod
    def _move_grad_to(master: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:  # moved already (e.g. by another optimizer's hook on the same parameter)
                return
            if master.grad is None:
                master.grad = grad.float()
            else:
                master.grad.add_(grad)  # accumulates micro-batches in float32
            param.grad = None

        return hook

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def has_half_params(self) -> bool:
        return any(m is not p for m, p in zip(self.masters, self.params))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the masters' float32 gradients to a global L2 norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.masters, max_norm)

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step on the float32 masters, then every 16-bit parameter := its master rounded to nearest."""
        self.optimizer.step()
        self.masters_to_params()

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """Every 16-bit parameter := its float32 master rounded to nearest (after a step or a load)."""
        for p, master in zip(self.params, self.masters):
            if master is not p:
                p.copy_(master)

    def state_dict(self) -> dict:
        """{"optimizer": AdamW's state dict, "masters": {index: float32 master}} (masters of 16-bit params only)."""
        masters = {i: m.detach().clone() for i, (p, m) in enumerate(zip(self.params, self.masters)) if m is not p}
        return {"optimizer": self.optimizer.state_dict(), "masters": masters}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore AdamW's moments and the float32 masters, and round the masters into the 16-bit parameters."""
        if "masters" not in state:
            raise ValueError("optimizer state without float32 masters: it was not written by MasterWeightAdamW")
        self.optimizer.load_state_dict(state["optimizer"])
        # A master the state lacks (a float32 run resumed in bf16) starts from the weight as loaded, never from the
        # weight this optimizer was built with.
        for p, master in zip(self.params, self.masters):
            if master is not p:
                master.copy_(p.detach().float())
        for i, value in state["masters"].items():
            i = int(i)
            if not 0 <= i < len(self.masters) or self.masters[i] is self.params[i]:
                raise ValueError(f"optimizer state holds a float32 master for parameter {i}, which has none here: "
                                 "was the run's config (LoRA, precision) changed?")
            self.masters[i].copy_(value.to(self.masters[i].device))
        self.masters_to_params()
