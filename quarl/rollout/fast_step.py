"""One decode step of the fast engine for all slots 0..B-1: forward one token each, sample, record.

Everything here has static shapes and never synchronises with the host, so a step can be captured in a CUDA
graph and replayed. The forward is the model's own (`QuarlForCausalLM.decode_logits`), so rollout-mode
quantization, LoRA and AQN noise act exactly as in training and the reference engine; only the KV-cache layout
(slots) and the attention kernel differ (`SlotDecode`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quarl import kernels
from quarl.kernels import capabilities
from quarl.model.moe import ExpertRouting
from quarl.rollout.fast_attention import AttentionFn
from quarl.rollout.fast_cache import SlotKVCache
from quarl.rollout.sampling import SamplingParams, filtered_logprobs


@dataclass
class SlotDecode:
    """The cache one decode step hands the model's forward (`QuarlForCausalLM.decode_logits`): each layer's
    attention stores the step's keys/values in the slot cache and attends with the engine's decode kernel.

    cache: the slot cache; slot b's token goes to column positions[b] (also its rotary position).
    positions: long [B]. attention: a decode attention function (see quarl.rollout.fast_attention).
    kv_len: static number of cache columns the attention may read (>= positions.max() + 1).
    decoder: a `quarl.rollout.fused_decode.FusedDecoder` of the model, or None. With one, every decoder layer's
    forward runs as `FusedDecoder.layer` (stacked projections, fused norm / rotary / SiLU kernels); `carry` holds
    what one layer hands the next (its MLP output, added by the next layer's first norm kernel), `scales` the
    decoder's deferred FP8 scales for the step (`FusedDecoder.step_scales`).
    """

    cache: SlotKVCache
    positions: torch.Tensor
    attention: AttentionFn
    kv_len: int
    decoder: object | None = None

    def __post_init__(self):
        self.lengths = self.positions + 1  # columns each row attends over, its own token included
        self.carry: tuple = (None, None)
        self.scales = self.decoder.step_scales() if self.decoder is not None else None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, 1, D], k, v [B, Hkv, 1, D] (after rotary) -> attention output [B, Hq, 1, D]."""
        return self.attend_rows(layer_idx, q[:, :, 0], k[:, :, 0], v[:, :, 0])[:, :, None]

    def attend_rows(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], k, v [B, Hkv, D] (after rotary) -> attention output [B, Hq, D]."""
        cache = self.cache
        cache.write_tokens(layer_idx, self.positions, k, v)
        return self.attention(q, cache.keys[layer_idx], cache.values[layer_idx], self.lengths, self.kv_len,
                              *cache.scales(layer_idx))

    def fused_layer(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The decoder layer's forward on the fused decoder (`FusedDecoder.layer`); x [B, 1, hidden]."""
        return self.decoder.layer(layer, x, cos, sin, self)


def decode_logits(model, cache: SlotKVCache, tokens: torch.Tensor, positions: torch.Tensor,
                  attention: AttentionFn, kv_len: int, routing: ExpertRouting | None = None,
                  decoder=None) -> torch.Tensor:
    """Next-token logits [B, vocab] (model dtype; the sampler widens them to float32) for slots 0..B-1, each fed
    one token (long [B] tokens at long [B] positions): the model's own forward (`QuarlForCausalLM.decode_logits`)
    over the slot cache (see `SlotDecode` for the arguments), so rollout-mode quantization, LoRA and AQN noise act
    exactly as in training and the reference engine. routing: an `ExpertRouting` that records the MoE layers'
    experts of these tokens (MoE models), or None. decoder: a `FusedDecoder` whose fused projections and kernels
    the layers run on (the same values; dense models without q/k norms, `fused_decode_supported`), or None."""
    step = SlotDecode(cache, positions, attention, kv_len, decoder)
    logits = model.decode_logits(tokens, positions, step, routing)
    if step.carry[0] is not None:  # host-side: a layer's output never reached the next one
        raise RuntimeError("the fused decode step ended with a layer's MLP output still pending; every decoder "
                           "layer must run, in order, on a SlotDecode that carries a fused decoder")
    return logits


def gumbel_max(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One draw per row from q = exp(logprobs): argmax(log q + Gumbel noise), the noise -log(-log u).

    logprobs: [B, V] (-inf outside the support); uniform: [B, V] in [0, 1). Returns long [B]. u = 0 gives -inf
    noise (the token is skipped for that draw: probability 2^-24 per entry in float32).
    """
    return torch.argmax(logprobs - torch.log(-torch.log(uniform)), dim=-1)


def _relative_probs(lp: torch.Tensor) -> torch.Tensor:
    """exp(lp - row max) [B, V] float64: 0 outside the support, and 0 for NaN entries (callers handle NaN rows)."""
    return torch.where(lp > float("-inf"), (lp - lp.amax(-1, keepdim=True)).exp(), 0.0).nan_to_num(0.0)


def inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One draw per row from q = exp(logprobs) by inverse CDF: the first index whose running sum of q (float64)
    passes u times the row's total. logprobs: [B, V] (-inf outside the support); uniform: [B] in [0, 1). Returns
    long [B]; a row holding a NaN gives its first NaN's index (as `gumbel_max`), a row without mass 0."""
    lp = logprobs.double()
    p = _relative_probs(lp)
    run = p.cumsum(-1)
    token = torch.searchsorted(run, (uniform.double() * run[:, -1])[:, None], right=True).squeeze(1)
    cols = torch.arange(lp.shape[1], device=lp.device)
    last = torch.where(p > 0, cols, -1).amax(-1).clamp(min=0)  # float rounding past the last mass: that token
    token = torch.minimum(token, last)
    nan = lp.isnan()
    return torch.where(nan.any(-1), nan.int().argmax(-1), token)


def inverse_cdf_consistent(logprobs: torch.Tensor, uniform: torch.Tensor, tokens: torch.Tensor,
                           tol: float = 1e-5) -> torch.Tensor:
    """bool [B]: whether each token is an inverse-CDF draw of u from exp(logprobs) up to `tol` of the row's mass
    (its interval of the float64 running sum contains u * total, widened by tol * total, and it has mass). The
    check for samplers whose running sums round differently (float32 kernels)."""
    p = _relative_probs(logprobs.double())
    run = p.cumsum(-1)
    total = run[:, -1]
    target = uniform.double() * total
    upto = run.gather(1, tokens[:, None]).squeeze(1)
    below = upto - p.gather(1, tokens[:, None]).squeeze(1)
    return (below <= target + tol * total) & (upto >= target - tol * total) & (p.gather(1, tokens[:, None])[:, 0] > 0)


def sample_next(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of every row and its behaviour log-prob: (long [B], float32 [B]; float64 for float64 logits).

    logits: [B, V] any float dtype; noise: float32 uniform draws, None for greedy params: [B, V] for Gumbel-max,
    [B, 1] (one per row) for inverse-CDF sampling. Greedy = argmax of the logits; otherwise a draw from
    `filtered_logprobs` by Gumbel-max or inverse CDF. Temperature sampling and greedy decoding of 16/32-bit
    logits on a GPU take the kernels `quarl.kernels.sampling` / `sampling_cdf` (the same draw up to float32
    rounding); top-k / top-p, float64 and CPU logits the torch definitions (`gumbel_max`, `inverse_cdf`).
    """
    plain = params.greedy or (params.top_k == 0 and params.top_p == 1.0)
    if not params.greedy and noise is not None and noise.shape[1] == 1 < logits.shape[1]:
        if plain and logits.is_cuda and logits.dtype != torch.float64 and _cdf_kernel_ok(logits.device,
                                                                                         logits.dtype):
            from quarl.kernels.sampling_cdf import sample_rows_cdf

            return sample_rows_cdf(logits, noise, params.temperature)
        logprobs = filtered_logprobs(logits, params)
        new = inverse_cdf(logprobs, noise[:, 0])
        return new, logprobs.gather(1, new[:, None]).squeeze(1)
    if plain and logits.is_cuda and logits.dtype != torch.float64 and _sampling_kernel_ok(logits.device,
                                                                                          logits.dtype):
        from quarl.kernels.sampling import sample_rows

        return sample_rows(logits, None if params.greedy else noise, params.temperature)
    return _sample_next_torch(logits, params, noise)


def _sample_next_torch(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch definition of `sample_next`."""
    logprobs = filtered_logprobs(logits, params)
    new = logits.argmax(dim=-1) if params.greedy else gumbel_max(logprobs, noise)
    return new, logprobs.gather(1, new[:, None]).squeeze(1)


def _sampler_ok(name: str, device: torch.device, dtype: torch.dtype, what: str, check) -> bool:
    """Whether the sampling kernel `name` may serve logits of `dtype` on `device`, decided on first use and kept
    in the capability registry (`quarl.kernels.capabilities.CAPABILITIES`, key (device, dtype)): kernels
    available and check(logits, uniforms) true on seeded random logits [64, 3001] of `dtype` and uniforms
    [64, 3001] (`kernels.kernel_passes_check`: a compile error or a difference warns and keeps the torch sampler
    for the process). The check synchronises once; the first call is an eager step (the engine warms up before it
    captures a graph)."""

    def probe() -> bool:
        gen = torch.Generator(device=device).manual_seed(0)
        logits = (torch.randn(64, 3001, device=device, generator=gen) * 3).to(dtype)
        uniforms = torch.rand(64, 3001, device=device, generator=gen)
        return check(logits, uniforms)

    return capabilities.CAPABILITIES.check(name, (str(device), dtype), probe,
                                           requires=lambda: kernels.kernels_available(device), what=what)


def _sampling_kernel_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the sampling kernel may serve logits of `dtype` on `device`: on its first use there, the same draws
    and log-probs as `_sample_next_torch` (greedy and at temperature 0.7; `_sampler_ok`)."""

    def same_draws(logits: torch.Tensor, noise: torch.Tensor) -> bool:
        from quarl.kernels.sampling import sample_rows

        for params in (SamplingParams(0.0), SamplingParams(0.7)):
            u = None if params.greedy else noise
            tok, lp = sample_rows(logits, u, params.temperature)
            ref_tok, ref_lp = _sample_next_torch(logits, params, u)
            if not (torch.equal(tok, ref_tok) and bool(((lp - ref_lp).abs() < 1e-4).all())):
                return False
        return True

    return _sampler_ok("sampling", device, dtype, "the sampling kernel", same_draws)


def _cdf_kernel_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """As `_sampling_kernel_ok` for the inverse-CDF kernel: its draws at temperature 0.7 must be inverse-CDF draws
    of their uniforms (`inverse_cdf_consistent`) with log-probs within 1e-4."""

    def consistent_draws(logits: torch.Tensor, uniforms: torch.Tensor) -> bool:
        from quarl.kernels.sampling_cdf import sample_rows_cdf

        u = uniforms[:, :1]
        tok, lp = sample_rows_cdf(logits, u, 0.7)
        ref_lp = filtered_logprobs(logits, SamplingParams(0.7))
        return bool(inverse_cdf_consistent(ref_lp, u[:, 0], tok).all()) and bool(
            ((lp - ref_lp.gather(1, tok[:, None])[:, 0]).abs() < 1e-4).all())

    return _sampler_ok("sampling_cdf", device, dtype, "the inverse-CDF sampling kernel", consistent_draws)


@dataclass
class DecodeState:
    """Per-slot decode state on the device (S = number of slots, C = cache capacity).

    last_token long [S]: the token the next step feeds; slot_len long [S]: columns filled = the position of that
    token; num_generated long [S]; done bool [S] (finished or idle: such slots compute but record nothing);
    out_tokens long [S, C], out_logprobs float32 [S, C]: the sampled tokens and behaviour log-probs;
    out_experts int16 [S, C, num_moe_layers, k] or None (engines recording MoE routing): column c holds the experts
    of the token fed at position c (prompt columns written by the prefill);
    max_new long [1]; eos_mask bool [V]: tokens that finish a completion; noise float32 [S, V] (Gumbel-max) or
    [S, 1] (inverse CDF): uniform draws, refilled before every sampling step (outside the graph, from the
    engine's seeded generator).
    """

    last_token: torch.Tensor
    slot_len: torch.Tensor
    num_generated: torch.Tensor
    done: torch.Tensor
    out_tokens: torch.Tensor
    out_logprobs: torch.Tensor
    max_new: torch.Tensor
    eos_mask: torch.Tensor
    noise: torch.Tensor | None
    out_experts: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_slots: int, capacity: int, vocab_size: int, device, logprob_dtype=torch.float32,
                 with_noise: bool = True, noise_width: int | None = None,
                 experts_shape: tuple[int, int] | None = None) -> "DecodeState":
        """noise_width: uniform draws per slot, vocab_size (None, Gumbel-max) or 1 (inverse CDF). experts_shape:
        (num_moe_layers, k) to record MoE routing in out_experts, None not to."""
        long = dict(dtype=torch.long, device=device)
        return cls(
            last_token=torch.zeros(num_slots, **long),
            slot_len=torch.zeros(num_slots, **long),
            num_generated=torch.zeros(num_slots, **long),
            done=torch.ones(num_slots, dtype=torch.bool, device=device),
            out_tokens=torch.zeros(num_slots, capacity, **long),
            out_logprobs=torch.zeros(num_slots, capacity, dtype=logprob_dtype, device=device),
            max_new=torch.ones(1, **long),
            eos_mask=torch.zeros(vocab_size, dtype=torch.bool, device=device),
            noise=torch.empty(num_slots, noise_width or vocab_size, device=device) if with_noise else None,
            out_experts=None if experts_shape is None else torch.full((num_slots, capacity, *experts_shape), -1,
                                                                      dtype=torch.int16, device=device),
        )

    def counters(self) -> list[torch.Tensor]:
        """The small tensors a step advances (saved and restored around a CUDA-graph warm-up)."""
        return [self.last_token, self.slot_len, self.num_generated, self.done]


def decode_step(model, cache: SlotKVCache, state: DecodeState, attention: AttentionFn, batch: int, kv_len: int,
                params: SamplingParams, decoder=None) -> None:
    """Advance slots 0..batch-1 by one token (in place on `state` and `cache`); finished/idle slots only compute.

    Sampling: greedy = argmax of the raw logits; otherwise Gumbel-max over the filtered log-probs
    (argmax(log q - log(-log u)) with u = state.noise, an exact draw from q), or inverse CDF when state.noise has
    one draw per slot (`sample_next`). The recorded behaviour log-prob
    is log q(token) of the distribution the token was drawn from (`filtered_logprobs`).
    decoder: a `fused_decode.FusedDecoder` for `model` (fused projections and kernels), or None for the
    module-by-module forward; both give the same values (`decode_logits`).
    """
    C = cache.capacity
    tokens = state.last_token[:batch]
    positions = state.slot_len[:batch].clamp(max=C - 1)  # finished slots may sit at the last column
    routing = ExpertRouting(record=True) if state.out_experts is not None else None
    logits = decode_logits(model, cache, tokens, positions, attention, kv_len, routing, decoder)
    new, new_lp = sample_next(logits, params, None if params.greedy else state.noise[:batch])
    new_lp = new_lp.to(state.out_logprobs.dtype)

    active = ~state.done[:batch]
    rows = torch.arange(batch, device=tokens.device)
    col = state.num_generated[:batch].clamp(max=state.out_tokens.shape[1] - 1)
    state.out_tokens[rows, col] = torch.where(active, new, state.out_tokens[rows, col])
    state.out_logprobs[rows, col] = torch.where(active, new_lp, state.out_logprobs[rows, col])
    if routing is not None:  # the experts of the tokens just fed, at their positions
        used = routing.stacked()[:, 0].to(state.out_experts.dtype)  # [batch, moe layers, k]
        state.out_experts[rows, positions] = torch.where(active[:, None, None], used,
                                                         state.out_experts[rows, positions])
    step = active.long()
    state.num_generated[:batch] += step
    state.slot_len[:batch] += step
    state.last_token[:batch] = torch.where(active, new, tokens)
    finished = active & (state.eos_mask[new] | (state.num_generated[:batch] >= state.max_new))
    state.done[:batch] |= finished
