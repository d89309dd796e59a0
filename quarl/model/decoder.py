"""`QuarlForCausalLM`: one decoder definition for rollout (KV-cached decoding) and training (full forward).

Llama / Qwen2 / Qwen3 / Qwen3-MoE families with grouped-query attention (MoE blocks: quarl/model/moe.py).
Parameter names match Hugging Face checkpoints, so `model.load_state_dict(hf_model.state_dict())` works (for MoE
models, transformers >= 5 stacks each layer's experts in memory; its checkpoints name every expert apart, as we do).
Every linear, lm_head included, is a `QuantLinear`; with tied embeddings `lm_head.weight` IS
`model.embed_tokens.weight` (one Parameter).

Attention masks: `attention_mask` [B, T] (1 = real token) may pad on the left or the right. When positions are
not given they count real tokens only (position of a token = number of real tokens before it), so a left-padded
row gets the same positions as the unpadded sequence.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from quarl.fast_paths import DEFAULT as DEFAULT_FAST_PATHS, FastPaths
from quarl.model.config import ModelConfig
from quarl.model.layers import MLP, Attention, DecoderLayer, RMSNorm, RotaryEmbedding, prepare_training_kernels
from quarl.model.moe import ExpertRouting, SparseMoeBlock, TopKRouter
from quarl.model.qlinear import QuantLinear


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, fast_paths: FastPaths = DEFAULT_FAST_PATHS):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, fast_paths) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


def _positions_and_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """(positions long [B, T], attention mask bool [B, 1, T, T] or None for plain causal attention) of a whole
    sequence batch without a KV cache; attention_mask [B, T] marks the real tokens (None: all are)."""
    B, T = input_ids.shape
    if attention_mask is None:
        return torch.arange(T, device=input_ids.device).expand(B, T), None  # SDPA's is_causal fast path
    key_valid = attention_mask.to(torch.bool)
    positions = (attention_mask.long().cumsum(1) - 1).clamp_min(0)
    return positions, None if bool(key_valid.all()) else _build_attn_mask(key_valid, 0, T)


def _build_attn_mask(key_valid: torch.Tensor, start: int, T: int) -> torch.Tensor:
    """bool [B, 1, T, S] with S = key_valid.shape[1]: query column start+t may see valid key columns <= start+t.

    A query always sees its own column, so padding queries (which have no valid key before them) produce finite
    garbage instead of NaN; their outputs are never used.
    """
    S = key_valid.shape[1]
    q_col = torch.arange(start, start + T, device=key_valid.device)[:, None]
    k_col = torch.arange(S, device=key_valid.device)[None, :]
    causal = k_col <= q_col  # [T, S]
    mask = (key_valid[:, None, :] & causal[None]) | (k_col == q_col)[None]
    return mask[:, None]


class QuarlForCausalLM(nn.Module):
    """Causal language model. See the module docstring for masks and positions."""

    def __init__(self, config: ModelConfig, init_std: float | None = 0.02, fast_paths: FastPaths | None = None):
        """Builds the model; `init_std=None` skips weight initialisation (use when weights are loaded next).
        fast_paths: the optional GPU fast paths of its training forward and answer log-probs (None = the defaults;
        see `set_fast_paths`)."""
        super().__init__()
        self.config = config
        self.fast_paths = DEFAULT_FAST_PATHS if fast_paths is None else fast_paths
        # True: a full-sequence forward under autograd keeps only each decoder layer's input and recomputes the
        # layer in backward (activation memory / num_layers-fold smaller, about one more forward of compute).
        self.gradient_checkpointing = False
        self.batch_invariant = False  # `set_batch_invariant`
        self.model = DecoderModel(config, self.fast_paths)
        self.lm_head = QuantLinear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.set_fast_paths(self.fast_paths)
        if init_std is not None and self.model.embed_tokens.weight.device.type != "meta":
            self.init_weights(init_std)

    # ------------------------------------------------------------------ setup
    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init like HF: N(0, std) for linears and embeddings, zero biases, unit norm weights."""
        for module in self.modules():
            self._init_module(module, std)
        self.reset_buffers()

    @torch.no_grad()
    def materialize(self, device, std: float = 0.02, precision=None) -> None:
        """Allocate a model built on the meta device on `device` and initialise it as `init_weights(std)` does,
        one module at a time (the same random draws in the same order).

        With a qlora `precision` (a PrecisionConfig whose flow quantizes a frozen base) each linear's base is
        quantized, and its full-precision weight freed, as soon as the linear is initialised: the full-precision
        model never exists whole, so peak memory is the quantized model plus one linear in the model dtype
        (how a 72B model is built on one GPU). The adapters are left to `apply_precision(model, precision)`,
        which then adds them exactly as on a model built in full precision.
        """
        from quarl.model.precision_apply import base_settings, hidden_size, wants_quantization

        frozen = precision is not None and precision.linear_settings()["frozen_base"]
        # resolved by the model's hidden size as apply_precision resolves them, which then finds the same base
        settings = base_settings(precision, hidden_size(self, precision)) if frozen else None
        # Only parameters held by several modules (tied embeddings) are remembered: a reference kept to any other
        # allocation would keep the full-precision weight alive after configure() dropped it.
        owners: dict[int, int] = {}
        for module in self.modules():
            for param in module._parameters.values():
                if param is not None:
                    owners[id(param)] = owners.get(id(param), 0) + 1
        shared: dict[int, nn.Parameter] = {}  # meta parameter id -> its one allocation
        for name, module in self.named_modules():
            for pname, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    new = shared.get(id(param))
                    if new is None:
                        new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                        if owners[id(param)] > 1:
                            shared[id(param)] = new
                    module._parameters[pname] = new
                    del new  # else this name keeps the weight alive after configure() drops it below
            for bname, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[bname] = torch.empty_like(buf, device=device)
            self._init_module(module, std)
            if frozen and isinstance(module, QuantLinear) and wants_quantization(name, precision):
                module.configure(**settings)
        self.reset_buffers()

    def _init_module(self, module: nn.Module, std: float) -> None:
        """init_weights for one module (not its children)."""
        if isinstance(module, (QuantLinear, nn.Embedding, TopKRouter)):
            if module.weight is not None and module.weight.numel():
                module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)

    def reset_buffers(self) -> None:
        """Reset derived state (rope frequency cache, zero AQN noise), e.g. after `to_empty`."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.reset_buffers()

    def tie_weights(self) -> None:
        """Re-point lm_head.weight at the embedding (needed after `to_empty`, which replaces parameters)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_fast_paths(self, fast_paths: FastPaths) -> None:
        """Use `fast_paths` (a `quarl.fast_paths.FastPaths`) from now on: the model keeps it (the answer log-probs
        read it there) and hands it to every module whose forward reads one (attention, MLP, linears), so one
        object decides for the whole model. A rollout engine takes its own (its CUDA graphs are keyed by it)."""
        if not isinstance(fast_paths, FastPaths):
            raise TypeError(f"set_fast_paths takes a quarl.fast_paths.FastPaths, got {type(fast_paths).__name__}")
        self.fast_paths = fast_paths
        for module in self.modules():
            if isinstance(module, (Attention, MLP, QuantLinear, SparseMoeBlock)):
                module.fast_paths = fast_paths

    def set_batch_invariant(self, on: bool) -> None:
        """Run every linear, RMSNorm and attention on the batch-invariant kernels (`quarl.kernels.batch_invariant`)
        when on: an output row's bits then never depend on how many rows a call has or how a sequence was fed, so
        the fast engine's decode steps (which follow the model's `batch_invariant`) and the training forward compute
        the same function to the bit (`precision.batch_invariant`, which `apply_precision` applies). Needs a dense
        model in bf16/fp16 on a CUDA device with the Triton kernels (or Triton's interpreter, for tests); an engine
        built on the model refuses to run after the setting changed."""
        on = bool(on)
        if on:
            problem = self._batch_invariance_problem()
            if problem is not None:
                raise ValueError(f"precision.batch_invariant needs a dense bf16/fp16 model on a CUDA GPU whose linears "
                                 f"multiply on bf16 GEMMs, got {problem}; set precision.batch_invariant=false")
        self.batch_invariant = on
        for module in self.modules():
            if isinstance(module, (Attention, QuantLinear, RMSNorm)):
                module.batch_invariant = on

    def _batch_invariance_problem(self) -> str | None:
        """What keeps this model off the batch-invariant kernels as configured now, or None."""
        from quarl.kernels import availability

        if self.is_moe:
            return "a mixture-of-experts model (its grouped expert GEMMs are not covered)"
        if self.dtype not in (torch.bfloat16, torch.float16):
            return f"a {self.dtype} model"
        if not availability.triton_runs_on(self.device):
            return (f"a model on {self.device}, where the Triton kernels do not run (a CPU, Triton missing, compute "
                    "capability < 8.0 or QUARL_DISABLE_KERNELS set)")
        for name, m in self.named_modules():
            if isinstance(m, QuantLinear) and m.rollout_format is not None and (
                    not m.bf16_gemms or m.kernel_forward or m.quantized_backward):
                return f"{name} configured for the quantized kernels or a split rollout"
            if isinstance(m, Attention) and m.kv_quant is not None:
                return f"{name} reading an FP8 KV cache"
        return None

    def set_rollout(self, on: bool) -> None:
        """Rollout forward (quantized linears, AQN noise on norms) when on, training forward when off."""
        for module in self.modules():
            if module is not self and hasattr(module, "set_rollout"):
                module.set_rollout(on)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # ------------------------------------------------------------------ forward
    @property
    def is_moe(self) -> bool:
        """Whether the model has sparse mixture-of-experts layers (qwen3_moe)."""
        return bool(self.config.moe_layers)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, kv_cache=None,
                      decode_start: torch.Tensor | None = None, routing: ExpertRouting | None = None
                      ) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden] in the model dtype. Arguments as in `forward`."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        start = 0
        if kv_cache is not None:
            new_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            start, key_valid, default_pos = kv_cache.append_mask(new_mask)
            attn_mask = _build_attn_mask(key_valid, start, T)
        else:
            default_pos, attn_mask = _positions_and_mask(input_ids, attention_mask)
        if positions is None:
            positions = default_pos
        elif positions.shape != input_ids.shape:
            raise ValueError(f"positions shape {tuple(positions.shape)} != input_ids shape {tuple(input_ids.shape)}")

        h = self._decoder_layers(input_ids, positions, attn_mask, kv_cache, start, decode_start, routing)
        if kv_cache is not None:
            kv_cache.commit(T)
        return h

    def _decoder_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_mask: torch.Tensor | None,
                        kv_cache, start: int, decode_start, routing: ExpertRouting | None) -> torch.Tensor:
        """The forward itself, shared by training, both rollout engines' prefill and the fast engine's decode
        steps: embeddings, every decoder layer, the final norm. input_ids, positions long [B, T]; attn_mask bool
        [B, 1, T, S] or None (causal). Returns [B, T, hidden] in the model dtype."""
        x = self.model.embed_tokens(input_ids)
        prepare_training_kernels(x.device, x.dtype, self.fast_paths)  # outside any checkpointed layer (see there)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        recompute = self.gradient_checkpointing and kv_cache is None and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:  # keep only each layer's input; backward re-runs the layer (same RNG for dropout)
                x = checkpoint(layer, x, cos, sin, attn_mask, None, start, decode_start, routing,
                               use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn_mask, kv_cache, start, decode_start, routing)
        return self.model.norm(x)

    def layer_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple:
        """What the first decoder layer gets for a whole-sequence batch without a KV cache, for running the layers
        one at a time (`layer(x, cos, sin, attn_mask)` in turn, as `hidden_states` runs them): (x [B, T, hidden]
        embeddings in the model dtype, cos and sin [B, 1, T, head_dim] rotary tables in that dtype, attn_mask bool
        [B, 1, T, T] or None). input_ids long, attention_mask: [B, T]."""
        positions, attn_mask = _positions_and_mask(input_ids, attention_mask)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        return x, cos, sin, attn_mask

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, step_cache,
                      routing: ExpertRouting | None = None) -> torch.Tensor:
        """Next-token logits of one decode step: the same forward as `forward`, one token per row, with no host
        synchronisation (so a CUDA graph can capture it).

        Args:
            tokens, positions: long [B], each row's token and its rotary position.
            step_cache: a cache with `attend(layer_idx, q, k, v)` that stores the tokens' keys/values and attends
                over the row's earlier ones (`quarl.rollout.fast_step.SlotDecode`); one carrying a fused decoder
                runs every layer on it (see `DecoderLayer.forward`).
            routing: an `ExpertRouting` for MoE models (record and/or replay), or None.
        Returns:
            logits [B, vocab] in the model dtype.
        """
        h = self._decoder_layers(tokens[:, None], positions[:, None], None, step_cache, 0, None, routing)
        return self.lm_head(h[:, 0])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, kv_cache=None,
                logits_to_keep: int | None = None, decode_start: torch.Tensor | None = None,
                routing: ExpertRouting | None = None) -> torch.Tensor:
        """Logits for every (or the last `logits_to_keep`) position.

        Args:
            input_ids: long [B, T] (the new tokens when decoding with a cache).
            positions: long [B, T] rotary positions; None = counted from the mask (and the cache).
            attention_mask: [B, T] with 1 = real token (left or right padding); None = all real. With a kv_cache
                it covers the new tokens only; the cache remembers earlier columns.
            kv_cache: a `quarl.rollout.kv_cache.KVCache` (or None for a full-sequence forward).
            logits_to_keep: keep only the last k positions (None or 0 = all).
            decode_start: long [B], the first column of each row that the rollout engine decoded (rather than
                prefilled), or a `quarl.model.layers.DecodeStart` carrying its maximum too (saves a device sync
                per layer); used only by attention layers with `kv_quant` set (FP8 KV cache in the unified flow).
            routing: a `quarl.model.moe.ExpertRouting` (MoE models): experts to replay for these tokens and/or a
                record of the routing; None = every MoE layer routes by its own top-k.
        Returns:
            float32 logits [B, T or k, vocab_size] (float64 for a float64 model).
        """
        h = self.hidden_states(input_ids, positions, attention_mask, kv_cache, decode_start, routing)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        return logits if logits.dtype == torch.float64 else logits.float()

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       temperature: float = 1.0, chunk_size: int = 512) -> torch.Tensor:
        """log p(token t+1 | tokens <= t) under softmax(logits / temperature), with autograd.

        Args:
            input_ids: long [B, T]; attention_mask: [B, T] (1 = real token; left or right padding) or None.
            temperature: > 0; the same temperature the samples were drawn with.
            chunk_size: number of (row, position) pairs whose logits are materialised at once. Under autograd
                each chunk is recomputed in backward (activation checkpointing), so memory holds at most one
                chunk of [chunk_size, vocab] logits instead of [B, T, vocab].
        Returns:
            float32 [B, T-1] (float64 for a float64 model); entry t is the log-prob of input_ids[:, t+1].
            Positions where token t or t+1 is padding are 0.
        """
        if temperature <= 0:
            raise ValueError(f"token_logprobs needs temperature > 0, got {temperature}")
        B, T = input_ids.shape
        out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        out = torch.zeros(B, max(T - 1, 0), dtype=out_dtype, device=input_ids.device)
        if T < 2:
            return out
        h = self.hidden_states(input_ids, attention_mask=attention_mask)[:, :-1]  # [B, T-1, hidden]
        targets = input_ids[:, 1:]
        if attention_mask is None:
            keep = torch.ones_like(targets, dtype=torch.bool)
        else:
            am = attention_mask.to(torch.bool)
            keep = am[:, :-1] & am[:, 1:]
        idx = keep.reshape(-1).nonzero().squeeze(1)
        h_flat = h.reshape(-1, h.shape[-1]).index_select(0, idx)
        t_flat = targets.reshape(-1).index_select(0, idx)
        pieces = []
        for s in range(0, h_flat.shape[0], chunk_size):
            hc, tc = h_flat[s:s + chunk_size], t_flat[s:s + chunk_size]
            if torch.is_grad_enabled() and hc.requires_grad:
                pieces.append(checkpoint(self._chunk_logprobs, hc, tc, temperature, use_reentrant=False))
            else:
                pieces.append(self._chunk_logprobs(hc, tc, temperature))
        values = torch.cat(pieces) if pieces else h_flat.new_zeros(0, dtype=out_dtype)
        return out.reshape(-1).index_put((idx,), values).reshape(B, T - 1)

    def _chunk_logprobs(self, h: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """h [N, hidden], targets long [N] -> float32 [N] log-softmax(lm_head(h) / temperature)[target]."""
        logits = self.lm_head(h)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        return -F.cross_entropy(logits, targets, reduction="none")
