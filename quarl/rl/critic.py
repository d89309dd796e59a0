"""PPO with a critic: the `critic.*` settings, a value head, PPO's clipped value loss, and the critic the trainer
runs when `loss.advantage_estimator=gae` (GAE itself: quarl.rl.advantages).

The critic maps each answer position to V(s_t), read off final hidden states by a zero-initialised linear head.
Where those hidden states come from is `critic.placement`:

* separate — a model of its own: `critic.model`, or (null) a copy of the actor's initial weights taken before the
  precision flow quantizes anything. It always trains in full precision (bf16 compute on a GPU, float32 masters and
  AdamW moments), whatever the actor's rollout format.
* shared — the head sits on the actor's own decoder trunk and reads the final hidden states of the actor's
  training forward (one forward feeds both losses); the value loss × vf_coef joins the policy loss in one
  backward, so the trunk learns from both. The head's own weights are float32.

Per RL step the trainer calls `prepare` once, before the update and without grad (like π_prox): V_old over the
answer tokens, each answer's reward on its last counted token, GAE advantages whitened over the batch's counted
tokens, and returns G = A + V_old (before whitening). In every micro-batch `loss` gives the clipped value loss

    V_clip = V_old + clamp(V − V_old, −ε, ε),   L_V = ½ · max((V − G)², (V_clip − G)²)

(PPO's form, as in verl and OpenAI baselines), averaged over the minibatch's counted tokens and scaled by vf_coef,
so one update cannot move a value prediction far from where it was. The critic steps its own AdamW (critic.lr,
train's schedule, betas, weight decay and gradient clipping).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from quarl.rl.advantages import gae_advantages, token_rewards
from quarl.rl.master_weights import MasterWeightAdamW

PLACEMENTS = ("separate", "shared")


@dataclass
class CriticConfig:
    """`critic.*` keys: the value function of PPO with GAE (read only when loss.advantage_estimator=gae)."""

    # separate: a model of its own (critic.model) | shared: a value head on the actor's decoder trunk
    placement: str = "separate"
    # separate: the critic's model (HF dir, hub id, tiny-random-*); null = a copy of the actor's initial weights
    model: str | None = None
    lr: float = 1e-5  # AdamW learning rate of the critic (head, and a separate model), on train.lr_schedule
    # ε of the clipped value loss: V stays within V_old ± ε (verl's cliprange_value); null = unclipped
    value_clip: float | None = 0.5
    vf_coef: float = 0.5  # weight of the value loss in the backward (shared: against the policy loss on the trunk)
    gamma: float = 1.0  # GAE discount γ (1.0: an answer's reward is not discounted over its tokens)
    lam: float = 0.95  # GAE λ: 1 = Monte Carlo returns, 0 = one-step TD
    warmup_steps: int = 0  # first RL steps that train only the critic (the actor's weights stay put)

    def validate(self) -> "CriticConfig":
        """ValueError naming the key, the bad value and what to use."""
        if self.placement not in PLACEMENTS:
            raise ValueError(f"critic.placement={self.placement!r} is unknown; choose one of {PLACEMENTS}")
        if self.model is not None and self.placement == "shared":
            raise ValueError(f"critic.model={self.model!r} is for critic.placement=separate; a shared critic is a "
                             "value head on the actor itself: drop critic.model or set critic.placement=separate")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"critic.lr={self.lr} must be a finite number > 0 (e.g. 1e-5)")
        if self.value_clip is not None and not (self.value_clip > 0 and math.isfinite(self.value_clip)):
            raise ValueError(f"critic.value_clip={self.value_clip} must be a finite number > 0 (verl: 0.5), or null "
                             "for an unclipped value loss")
        if not (self.vf_coef > 0 and math.isfinite(self.vf_coef)):
            raise ValueError(f"critic.vf_coef={self.vf_coef} must be a finite number > 0 (the critic learns from "
                             "the value loss alone; e.g. 0.5)")
        for key in ("gamma", "lam"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"critic.{key}={value} must lie in [0, 1] (LLM RL: gamma 1.0, lam 0.95)")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"critic.warmup_steps={self.warmup_steps!r} must be an int >= 0 (0 = the actor trains "
                             "from the first step)")
        return self


class ValueHead(nn.Module):
    """Linear(hidden_size → 1) on hidden states [B, T, H] → values [B, T] (float32 compute for low-precision
    inputs). Initialised at zero so a fresh critic predicts 0 and its first advantages are the returns."""

    def __init__(self, hidden_size: int):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size!r} must be a positive int (the backbone's hidden size)")
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        if hidden.dim() != 3 or hidden.shape[-1] != self.proj.in_features:
            raise ValueError(f"hidden must be [B, T, {self.proj.in_features}]; got {tuple(hidden.shape)}")
        x = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        w, b = self.proj.weight.to(x.dtype), self.proj.bias.to(x.dtype)  # cast a copy, the module keeps its dtype
        return nn.functional.linear(x, w, b).squeeze(-1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float | None = 0.2, num_tokens: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss.

    Args:
        values: [B, T] float, V of the current critic, with grad.
        old_values: [B, T] float, V when the batch was collected (no grad).
        returns: [B, T] float, targets G (e.g. from `gae_advantages`).
        mask: [B, T] bool or 0/1 float, 1 = a counted token.
        clip_range: ε > 0, or None for the unclipped ½(V − G)².
        num_tokens: the whole minibatch's counted tokens when the caller splits it into micro-batches (then the
            micro-batch losses sum to the minibatch's token mean); default this call's mask.sum().
    Returns:
        (loss: 0-dim, the sum over counted tokens / num_tokens (0 when none count); metrics over this call's
        counted tokens: "critic/vf_loss" (their mean of L_V) and "critic/vf_clipfrac" (share of tokens where the
        clipped error is the larger)).
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError("values, old_values, returns and mask must share one [B, T] shape")
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range={clip_range} must be > 0, or None for no value clipping")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1):
        raise ValueError(f"num_tokens={num_tokens!r} must be a positive int (the whole minibatch's count) or None")
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    dtype = torch.promote_types(values.dtype, torch.float32)
    v, old, g = values.to(dtype), old_values.detach().to(dtype), returns.detach().to(dtype)
    err = (v - g) ** 2
    clipped = torch.zeros_like(m)
    if clip_range is not None:
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        err_clip = (v_clip - g) ** 2
        clipped = err_clip > err
        err = torch.maximum(err, err_clip)
    zero = torch.zeros((), dtype=dtype, device=v.device)
    total = 0.5 * torch.where(m, err, zero).sum()
    n = m.sum().clamp(min=1)
    loss = total / (num_tokens if num_tokens is not None else n)
    metrics = {"critic/vf_loss": float(total.detach() / n), "critic/vf_clipfrac": float((clipped & m).sum() / n)}
    return loss, metrics


def explained_variance(returns: Tensor, values: Tensor, mask: Tensor) -> float:
    """1 − Var(G − V) / Var(G) over the counted tokens (population variances; [B, T] inputs, mask bool or 0/1):
    1 = the values predict the returns, 0 = no better than their mean. NaN when the returns do not vary."""
    m = mask.bool() if mask.dtype == torch.bool else mask != 0
    g, v = returns[m].double(), values[m].double()
    if g.numel() == 0:
        return float("nan")
    var_g = g.var(unbiased=False)
    return float(1.0 - (g - v).var(unbiased=False) / var_g) if var_g > 0 else float("nan")


class Critic:
    """The critic of one run: a `ValueHead` on the actor's trunk (shared) or on a model of its own (separate), and
    its float32-master AdamW. The trainer calls `prepare` once per step, `reading` around the actor's training
    forward and `loss` per micro-batch, and steps `optimizer` next to the actor's."""

    def __init__(self, cfg: CriticConfig, trunk: nn.Module, shared: bool, *, betas=(0.9, 0.999),
                 weight_decay: float = 0.0):
        """cfg: validated settings; trunk: the QuarlForCausalLM whose final hidden states the head reads (the actor
        itself when shared); the optimizer takes the head, plus the trunk's decoder when separate."""
        self.cfg = cfg
        self.shared = shared
        self.trunk = trunk
        norm = getattr(getattr(trunk, "model", None), "norm", None)
        if not hasattr(trunk, "hidden_states") or norm is None:
            raise ValueError(f"a critic needs a quarl decoder (QuarlForCausalLM) to read hidden states from; got "
                             f"{type(trunk).__name__}")
        # float32 on a 16-bit trunk (its own master), float64 on a float64 one (reference runs)
        self.head = ValueHead(int(trunk.config.hidden_size)).to(trunk.device, torch.promote_types(trunk.dtype,
                                                                                                  torch.float32))
        # what the optimizer updates and a checkpoint holds: the head, and a separate critic's decoder
        self.parts = nn.ModuleDict({"head": self.head} if shared else {"head": self.head, "trunk": trunk.model})
        self.optimizer = MasterWeightAdamW(list(self.parts.parameters()), lr=cfg.lr, betas=betas,
                                           weight_decay=weight_decay)
        self._hidden: Tensor | None = None  # shared: the final hidden states of the last forward `reading` watched

    @classmethod
    def build(cls, run_cfg, actor: nn.Module, device: torch.device, dtype: torch.dtype) -> "Critic":
        """The critic of a run config (`critic.*`, train's betas / weight decay / gradient checkpointing). Call it
        before the precision flow touches the actor: a separate critic without critic.model copies its weights."""
        cfg = run_cfg.critic
        if cfg.placement == "shared":
            return cls(cfg, actor, True, betas=run_cfg.train.betas, weight_decay=run_cfg.train.weight_decay)
        if cfg.model is None:
            model = copy.deepcopy(actor)
        else:
            from quarl.model.loading import load_model

            model, _ = load_model(cfg.model, device=str(device), dtype=dtype)
            if model.config.vocab_size < actor.config.vocab_size:
                raise ValueError(f"critic.model={cfg.model!r} has a vocabulary of {model.config.vocab_size} tokens, "
                                 f"fewer than the actor's {actor.config.vocab_size}: the critic reads the actor's "
                                 "token ids, so it needs the actor's tokenizer (a model of the same family)")
        model = model.to(device=device, dtype=dtype).requires_grad_(True)
        model.set_fast_paths(run_cfg.fast_paths)
        model.lm_head = nn.Identity()  # the critic reads hidden states only: the LM head would be dead weight
        model.gradient_checkpointing = run_cfg.train.gradient_checkpointing
        return cls(cfg, model, False, betas=run_cfg.train.betas, weight_decay=run_cfg.train.weight_decay)

    # ------------------------------------------------------------------------------------------------ per step

    def actor_trains(self, step: int) -> bool:
        """Whether the actor learns at RL step `step` (0-based): not during critic.warmup_steps."""
        return step >= self.cfg.warmup_steps

    def set_lr(self, factor: float) -> None:
        """critic.lr × the schedule's factor at this step (the actor's warm-up and decay)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * factor

    def _values(self, hidden: Tensor, width: int) -> Tensor:
        """V for the last `width` columns of the [B, T-1] layout: column t scores token t+1, so its state is the
        hidden state at position t. hidden [B, T, H] -> [B, width] in the head's dtype (float32, or float64)."""
        return self.head(hidden[:, -(width + 1):-1])

    def _trunk_hidden(self, sub, device: torch.device, routing=None) -> Tensor:
        """The trunk's final hidden states [B, T, H] of a micro-batch (with grad when grad is enabled). routing: the
        `ExpertRouting` the actor's forward over the same rows uses (a shared MoE trunk replays the rollout's
        experts, so V_old must see the experts V will see), else None."""
        from quarl.model.layers import DecodeStart

        input_ids = sub.input_ids.to(device)
        # where decoding began, for attention layers that mimic an FP8 KV cache (the shared trunk in the unified flow)
        start = DecodeStart.of(input_ids.shape[1] - 1 - sub.answer_lengths, input_ids.device)
        return self.trunk.hidden_states(input_ids, attention_mask=sub.attention_mask.to(device), decode_start=start,
                                        routing=routing)

    @torch.no_grad()
    def prepare(self, batch, micro_batch_size: int, device: torch.device, routing_of=None):
        """V_old, GAE advantages and returns of a RolloutBatch, before the update.

        Returns (batch with advantages [B, T-1] (whitened over the counted tokens), returns [B, T-1] and values
        [B, T-1] = V_old (each 0 outside answer_mask), on the CPU in the head's dtype (float32, float64 for a
        float64 trunk); metrics "critic/value_mean", "critic/returns_mean", "critic/explained_variance" over the
        counted tokens). routing_of: sub-batch -> the `ExpertRouting` of the actor's training forward over it
        (`Trainer.expert_routing`), used by a shared trunk; None for dense models or a separate critic.
        """
        mask = batch.answer_mask.bool()
        values = torch.zeros(mask.shape, dtype=self.head.proj.weight.dtype)  # float32 (float64 for a float64 trunk)
        was_training = self.trunk.training
        self.trunk.eval()  # V_old is the critic itself: no (LoRA) dropout
        for start in range(0, len(batch), micro_batch_size):
            rows = list(range(start, min(start + micro_batch_size, len(batch))))
            sub = batch.select(rows)
            width = min(sub.answer_width, sub.input_ids.shape[1] - 1)  # rows end in the last column
            routing = routing_of(sub) if routing_of is not None and self.shared else None
            values[rows, -width:] = self._values(self._trunk_hidden(sub, device, routing), width).cpu()
        self.trunk.train(was_training)
        values = torch.where(mask, values, torch.zeros_like(values))
        # GAE over the answer columns only: the prompt columns to their left hold no counted token
        w = min(batch.answer_width, mask.shape[1])
        advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
        advantages[:, -w:], returns[:, -w:] = gae_advantages(
            token_rewards(batch.rewards.float(), mask[:, -w:]), values[:, -w:], mask[:, -w:], self.cfg.gamma,
            self.cfg.lam, whiten=True)
        n = max(int(mask.sum()), 1)
        metrics = {"critic/value_mean": float(values.sum() / n), "critic/returns_mean": float(returns.sum() / n),
                   "critic/explained_variance": explained_variance(returns, values, mask)}
        return dataclasses.replace(batch, advantages=advantages, returns=returns, values=values), metrics

    @contextmanager
    def reading(self, actor: nn.Module):
        """Around the actor's training forward: a shared critic keeps that forward's final hidden states (a hook on
        the final norm, which both log-prob paths run) so the value head reads the same forward. No-op when
        separate."""
        if not self.shared:
            yield
            return
        handle = actor.model.norm.register_forward_hook(lambda module, args, out: setattr(self, "_hidden", out))
        try:
            yield
        finally:
            handle.remove()

    def loss(self, sub, width: int, num_tokens: int, device: torch.device,
             actor_trains: bool = True) -> tuple[Tensor, dict[str, float]]:
        """vf_coef × the clipped value loss of one micro-batch (a RolloutBatch row selection carrying returns and
        values), with grad. width: the log-prob columns the actor's forward scored; num_tokens: the minibatch's
        counted tokens. A shared critic reads the hidden states `reading` kept, detached while the actor does not
        train (critic warm-up: the trunk stays put)."""
        if self.shared:
            hidden, self._hidden = self._hidden, None
            if hidden is None:
                raise RuntimeError("a shared critic's loss needs the actor's forward run inside Critic.reading")
            if not actor_trains:
                hidden = hidden.detach()
        else:
            hidden = self._trunk_hidden(sub, device)
        values = self._values(hidden, width)
        cols = lambda t: t[:, -width:].to(device)  # noqa: E731
        loss, metrics = value_loss(values, cols(sub.values), cols(sub.returns), cols(sub.answer_mask),
                                   self.cfg.value_clip, num_tokens=num_tokens)
        return self.cfg.vf_coef * loss, metrics

    # ------------------------------------------------------------------------------------------------ state

    def nonfinite_weights(self) -> list[str]:
        """Names of the critic's weights (or float32 masters) holding NaN/Inf (one host sync)."""
        named = [(f"critic.{n}", p.detach()) for n, p in self.parts.named_parameters()]
        named += [(f"critic.{n} (float32 master)", m.detach()) for (n, p), m in
                  zip(self.parts.named_parameters(), self.optimizer.masters) if m is not p]
        ok = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu().tolist()
        return [name for (name, _), fine in zip(named, ok) if not fine]

    def state_dict(self) -> dict:
        """{"weights": {name: tensor (CPU)}, "optimizer": MasterWeightAdamW state}: plain types, for a checkpoint
        (whose writer refuses NaN/Inf in them)."""
        weights = {n: p.detach().cpu().clone() for n, p in self.parts.named_parameters()}
        return {"weights": weights, "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict | None, path="checkpoint") -> None:
        """Restore what `state_dict` saved; ValueError (one line) when it is missing or does not fit this critic."""
        if not isinstance(state, dict) or "weights" not in state or "optimizer" not in state:
            raise ValueError(f"checkpoint {path} holds no critic: the run was saved without one "
                             "(loss.advantage_estimator=group); resume it with its own config")
        params = dict(self.parts.named_parameters())
        saved = state["weights"]
        if set(saved) != set(params) or any(saved[n].shape != p.shape for n, p in params.items()):
            raise ValueError(f"checkpoint {path}: the critic's weights do not fit this critic (critic.placement or "
                             "critic.model changed?); resume with the run's own config")
        for name, value in saved.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
            raise ValueError(f"checkpoint {path}: the critic's optimizer state does not fit ({type(e).__name__}: "
                             f"{e}); resume with the run's own config") from None
