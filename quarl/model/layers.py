"""Building blocks of the decoder: RMSNorm (with the rollout-only AQN noise), rotary embeddings, attention, MLP.

Parameter names follow Hugging Face (q_proj, k_proj, ..., input_layernorm) so HF state dicts load directly.
Every linear is a `QuantLinear`: the precision flow decides what it computes (see quarl/precision.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from quarl import kernels
from quarl.fast_paths import DEFAULT as DEFAULT_FAST_PATHS, FastPaths
from quarl.model.config import ModelConfig
from quarl.model.moe import ExpertRouting, SparseMoeBlock
from quarl.model.qlinear import QuantLinear
from quarl.model.shared_input import shared_input_linears


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in float32 (float64 for float64 x) and cast back to x's dtype.

    AQN (BRIEF §5): `rollout_noise` (same shape as `weight`, zero, not saved) is added to the weight in rollout
    mode only, so the rollout model sees w + noise and the training forward never does. The noise is kept in
    float32 and added in float32 inside the norm, y = (x * rsqrt(mean(x^2) + eps)) * (w + noise) with x, w and the
    noise widened to float32, then cast to x's dtype: in a bf16 model w + noise rounded to bf16 (one ulp at 1.0 is
    2^-7) would erase σ <= 1e-3 and turn larger σ into sparse one-ulp jumps. The buffer stays float32 whatever
    the model's dtype (`_apply` undoes nn.Module's cast, keeping the values); write noise into it in place (CUDA
    graphs and the fused decode kernels read it at its address).

    With `batch_invariant` (`QuarlForCausalLM.set_batch_invariant`) every forward takes one Triton program per
    row (`quarl.kernels.batch_invariant.rms_norm`, the same float32 math): a row's output never depends on the batch.
    Otherwise training takes torch's fused `F.rms_norm` on CUDA bf16/fp16 (the same float32 math in one pass), and
    so does the rollout forward until AQN is enabled on the norm (`aqn_enabled`, set by
    `quarl.rl.aqn.set_aqn_noise`, which the trainer calls from the first sync on): rollout and training then take one
    code path. From then on the rollout forward always takes the float32 code with the noise term (a zero noise
    changes nothing), so a CUDA graph captured during AQN's noiseless first stage still adds the noise written
    later.
    """

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.register_buffer("rollout_noise", torch.zeros(dim, device=device, dtype=torch.float32), persistent=False)
        self.rollout = False
        self.aqn_enabled = False
        self.batch_invariant = False  # `QuarlForCausalLM.set_batch_invariant`

    def set_rollout(self, on: bool) -> None:
        self.rollout = bool(on)

    def reset_buffers(self) -> None:
        """Zero the noise (used after building on the meta device)."""
        with torch.no_grad():
            self.rollout_noise.zero_()

    def _apply(self, fn, recurse=True):
        """nn.Module's `_apply` (behind `.to()`, `.cuda()`, `.bfloat16()`), with `rollout_noise` kept float32 and its
        values unrounded."""
        old = self.rollout_noise
        out = super()._apply(fn, recurse)
        new = self.rollout_noise
        if new is not None and new.dtype != torch.float32:
            exact = old is not None and not old.is_meta and not new.is_meta
            self.rollout_noise = old.to(new.device, torch.float32) if exact else new.float()
        return out

    def effective_weight(self) -> torch.Tensor:
        """The weight this forward uses: [dim], w + rollout_noise in float32 (float64 for a float64 weight) in
        rollout mode, w otherwise."""
        if not self.rollout:
            return self.weight
        dtype = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
        return self.weight.to(dtype) + self.rollout_noise.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] (any float dtype; bf16/fp16 with `batch_invariant`) -> [..., dim] in x's dtype."""
        noisy = self.rollout and self.aqn_enabled
        if self.batch_invariant:
            from quarl.kernels import batch_invariant

            return batch_invariant.rms_norm(x, self.weight, self.eps, self.rollout_noise if noisy else None)
        if not noisy and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == x.dtype:
            # torch's fused CUDA kernel (forward and backward): one pass over x instead of six elementwise passes
            # through a float32 copy.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x if x.dtype == torch.float64 else x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.effective_weight() if noisy else self.weight
        return (normed * w.to(xf.dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rope_inv_freq(config: ModelConfig, device=None) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim/2] float32, with linear or llama3 scaling applied.

    Computed exactly as transformers does (float32 powers of rope_theta) so logits match bit-for-bit closely.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    rope_type = config.rope_type
    if rope_type == "linear":
        inv_freq = inv_freq / float(config.rope_scaling["factor"])
    elif rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between is interpolated.
        sc = config.rope_scaling
        factor = float(sc["factor"])
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_len = float(sc["original_max_position_embeddings"])
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions (rotate-half convention, as in HF checkpoints).

    The inverse frequencies are kept in float32 outside the module's buffers, so `model.to(torch.bfloat16)` can
    never round them (bf16 frequencies would shift every angle at long positions).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def reset_buffers(self) -> None:
        self._inv_freq.clear()

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """float32 [head_dim/2] on `device` (computed once per device)."""
        device = torch.device(device)
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.config).to(device)
        return self._inv_freq[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] long -> (cos, sin), each [B, 1, T, head_dim] in `dtype` (broadcast over heads)."""
        freqs = positions.float()[..., None] * self.inv_freq(positions.device)  # [B, T, D/2], float32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], cos/sin [B, 1, T, D] -> rotated x [B, H, T, D]."""
    return x * cos + _rotate_half(x) * sin


FP8_KV_MAX = 448.0


def fp8_kv_roundtrip(x: torch.Tensor, token_scales: bool = False) -> torch.Tensor:
    """The values an FP8 KV cache hands back for keys/values x [..., head_dim], in x's shape and dtype, without
    gradient (callers add a straight-through term). Scale 1 (`precision.kv_cache=fp8`): clamp to +-448, round to
    E4M3. token_scales (`fp8-token`): each head_dim vector rounded with its own scale, the "fp8" rowwise format
    (`quarl.kernels.fake_quantize_activation`, one pass on a GPU)."""
    if token_scales:
        return kernels.fake_quantize_activation(x.detach(), "fp8")
    return x.detach().float().clamp(-FP8_KV_MAX, FP8_KV_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def prepare_training_kernels(device: torch.device, dtype: torch.dtype,
                             fast_paths: FastPaths = DEFAULT_FAST_PATHS) -> None:
    """Run the first-use checks of the training kernels the layers may take (`kernels.training_kernel_ok`) now,
    before any layer runs: a check inside a checkpointed layer would run again in its recompute and change what
    the layer saves for backward. fast_paths: the model's (`fused_rope` decides whether RoPE's kernel may run)."""
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        kernels.training_kernel_ok("silu_mul", device, dtype)
        if fast_paths.fused_rope:
            kernels.training_kernel_ok("rope", device, dtype)


def _fused_rope_ok(x: torch.Tensor, enabled: bool) -> bool:
    """Whether `quarl.kernels.rope_train` serves x [B, T, H, D]: `enabled` (`FastPaths.fused_rope`; one Triton
    pass forward and one backward with PyTorch's roundings instead of five PyTorch kernels), CUDA bf16/fp16, a
    power-of-two head size and the kernel's first-use check passed."""
    d = x.shape[-1]
    return enabled and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and d % 2 == 0 and \
        d & (d - 1) == 0 and kernels.training_kernel_ok("rope", x.device, x.dtype)


@dataclass(frozen=True)
class DecodeStart:
    """Where each row's decoding began, for attention layers that mimic an FP8 KV cache: columns long [B] on the
    model's device, and prefill = max(columns) as a Python int (read once per forward, so no layer needs a device
    sync to slice by it)."""

    columns: torch.Tensor
    prefill: int

    @classmethod
    def of(cls, columns: torch.Tensor, device) -> "DecodeStart":
        """From columns long [B] on the CPU (one small host-to-device copy)."""
        columns = columns.cpu()
        return cls(columns.to(device), int(columns.max()) if columns.numel() else 0)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings and an optional KV cache.

    `kv_quant = "fp8"` or `"fp8-token"` makes a full-sequence forward see the keys/values the way the fast
    engine's FP8 KV cache of that kind serves them to decoding queries (unified flow: rollout and training then
    compute the same thing). Given
    `decode_start` [B] (the first column each row decoded rather than prefilled), queries from that column on
    attend to FP8-rounded keys/values (straight-through gradients); earlier (prefill) queries see them unrounded,
    as the engine's prefill does.

    `fast_paths` (the model's, see `QuarlForCausalLM.set_fast_paths`): `fused_rope`, and for q/k/v
    `share_input_codes` (`shared_input_linears`). `batch_invariant` (`QuarlForCausalLM.set_batch_invariant`): every
    full-sequence attention on `quarl.kernels.batch_invariant.attention`, which the fast engine's decode steps take
    too, so a query's output never depends on the batch or on how its sequence was fed.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, fast_paths: FastPaths = DEFAULT_FAST_PATHS):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.fast_paths = fast_paths
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = QuantLinear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = QuantLinear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = QuantLinear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = QuantLinear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_out_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kv_quant: str | None = None
        self.batch_invariant = False  # `QuarlForCausalLM.set_batch_invariant`

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                kv_cache=None, cache_start: int = 0, decode_start: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden]; attn_mask bool [B, 1, T, S] (True = may attend) or None = plain causal.

        With a kv_cache, the new keys/values are written at columns [cache_start, cache_start + T) and attention
        runs over all S = cache_start + T columns. A cache with an `attend(layer_idx, q, k, v)` method (one
        decode step of the fast engine, `quarl.rollout.fast_step.SlotDecode`) stores the keys/values and runs the
        attention itself: q [B, Hq, T, D] and k, v [B, Hkv, T, D] after rotary, returning [B, Hq, T, D].
        Returns [B, T, hidden].
        """
        B, T, _ = x.shape
        q, k, v = shared_input_linears((self.q_proj, self.k_proj, self.v_proj), x, self.fast_paths)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        fused_rope = _fused_rope_ok(q, self.fast_paths.fused_rope)
        if fused_rope:
            from quarl.kernels.rope_train import rope

            q, k = rope(q.contiguous(), cos, sin), rope(k.contiguous(), cos, sin)  # in [B, T, H, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if not fused_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None and hasattr(kv_cache, "attend"):
            out = kv_cache.attend(self.layer_idx, q, k, v)  # a decode step: the engine's cache and kernel
        elif self.kv_quant is not None and decode_start is not None and kv_cache is None:
            out = self._fp8_kv_attention(q, k, v, attn_mask, decode_start)
        else:
            if kv_cache is not None:
                k, v = kv_cache.write(self.layer_idx, cache_start, k, v)
            out = self._invariant_attention(q, k, v, attn_mask, cache_start) if self.batch_invariant else \
                self._sdpa(q, k, v, attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def _fp8_kv_attention(self, q, k, v, attn_mask, decode_start) -> torch.Tensor:
        """Attention [B, H, T, D] as the engine computes it with an FP8 KV cache: queries from a row's
        decode start (a `DecodeStart`, or long [B]: then its maximum costs a device sync here) on read FP8-rounded
        keys/values (straight-through gradients), earlier (prefill) queries the unrounded ones. Causal attention
        lets the prefill part stop at p = max(decode start) queries and keys, so the second attention costs
        (p / T)^2 of the first (less when every answer is long)."""
        token = self.kv_quant == "fp8-token"
        k_q = k + (fp8_kv_roundtrip(k, token) - k).detach()
        v_q = v + (fp8_kv_roundtrip(v, token) - v).detach()
        out = self._sdpa(q, k_q, v_q, attn_mask)
        if not isinstance(decode_start, DecodeStart):
            decode_start = DecodeStart(decode_start, int(decode_start.max()) if decode_start.numel() else 0)
        p = min(decode_start.prefill, q.shape[2])
        if p <= 0:
            return out
        mask = None if attn_mask is None else attn_mask[:, :, :p, :p]
        prefill = self._sdpa(q[:, :, :p], k[:, :, :p], v[:, :, :p], mask)
        columns = decode_start.columns.to(q.device)  # a no-op when built by DecodeStart.of for this device
        decoding = torch.arange(p, device=q.device)[None, :] >= columns[:, None]
        head = torch.where(decoding[:, None, :, None], out[:, :, :p], prefill)  # [B, H, p, D]
        # Joined in [B, T, H, D] memory (returned as its [B, H, T, D] view): the layout SDPA's output has and
        # o_proj's input needs, so the join is one coalesced copy and the caller's reshape copies nothing.
        return torch.cat([head.transpose(1, 2), out[:, :, p:].transpose(1, 2)], dim=1).transpose(1, 2)

    def _invariant_attention(self, q, k, v, attn_mask, cache_start: int) -> torch.Tensor:
        """Attention [B, H, T, D] on the batch-invariant kernel, the one the engine's decode steps take: query t sits
        at column cache_start + t and sees the keys from its row's first real one (the first key its last query
        may see: a left-padded row's first token, column 0 for right padding) up to its own column. So a row's real
        tokens must be contiguous (left or right padding, as quarl's batches and engines lay them out)."""
        from quarl.kernels import batch_invariant

        B, S = q.shape[0], k.shape[2]
        first = torch.zeros(B, dtype=torch.long, device=q.device) if attn_mask is None else \
            attn_mask[:, 0, -1].to(torch.int8).argmax(-1)
        return batch_invariant.attention(q, k, v, first, torch.full_like(first, cache_start), torch.full_like(first, S))

    def _sdpa(self, q, k, v, attn_mask):
        gqa = self.num_heads != self.num_kv_heads
        if attn_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)


class MLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x)); `fast_paths` as in `Attention` (gate/up's shared input)."""

    def __init__(self, config: ModelConfig, fast_paths: FastPaths = DEFAULT_FAST_PATHS):
        super().__init__()
        c = config
        self.fast_paths = fast_paths
        self.gate_proj = QuantLinear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = QuantLinear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = QuantLinear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]."""
        gate, up = shared_input_linears((self.gate_proj, self.up_proj), x, self.fast_paths)
        if gate.is_cuda and gate.dtype in (torch.bfloat16, torch.float16) and \
                kernels.training_kernel_ok("silu_mul", gate.device, gate.dtype):
            # One Triton pass forward and one backward, PyTorch's roundings (`kernels.silu_mul_train`).
            from quarl.kernels.silu_mul_train import silu_mul

            return self.down_proj(silu_mul(gate.contiguous(), up.contiguous()))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is a `SparseMoeBlock` in the
    MoE layers of a qwen3_moe model (`ModelConfig.is_moe_layer`), a dense `MLP` otherwise."""

    def __init__(self, config: ModelConfig, layer_idx: int, fast_paths: FastPaths = DEFAULT_FAST_PATHS):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, fast_paths)
        if config.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(config, config.moe_layers.index(layer_idx), fast_paths)
        else:
            self.mlp = MLP(config, fast_paths)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attn_mask, kv_cache=None, cache_start: int = 0,
                decode_start: torch.Tensor | None = None, routing: ExpertRouting | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; arguments as in `Attention.forward`.

        A fast-engine decode step whose cache carries a fused decoder (`SlotDecode.decoder`) runs this layer on its
        stacked projections and fused kernels (`quarl.rollout.fused_decode.FusedDecoder.layer`): the same math in
        fewer launches, with one difference in what passes between layers: each layer's MLP output waits in the
        step cache (`SlotDecode.carry`) for the next layer's first norm kernel, so every layer but the last returns
        the residual stream without it. Such a step must run every layer, in order (the model's decode forward).
        """
        if getattr(kv_cache, "decoder", None) is not None:
            return kv_cache.fused_layer(self, x, cos, sin)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv_cache, cache_start, decode_start)
        return x + self.feed_forward(self.post_attention_layernorm(x), routing)

    def feed_forward(self, h: torch.Tensor, routing: ExpertRouting | None = None) -> torch.Tensor:
        """The MLP (dense or sparse) of normed hidden states h [..., hidden]; `routing` reaches a MoE block only."""
        return self.mlp(h, routing) if isinstance(self.mlp, SparseMoeBlock) else self.mlp(h)
