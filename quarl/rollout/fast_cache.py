"""The fast engine's slot KV cache: one fixed row ("slot") per running sequence, preallocated once.

Layout per layer: keys / values [num_slots, num_kv_heads, capacity, head_dim]. Slot s holds one sequence's
tokens in columns 0 .. len-1 (no padding: a sequence starts at column 0 of its slot), so attention masks are
plain length masks and a finished slot is reused by writing the next prompt over it. The cache never moves
during decoding; only `move` (compaction of the running set into the lowest slots) copies slots.

FP8 KV cache (kv_dtype=torch.float8_e4m3fn), two scalings:
  * one scale (token_scales=False): values are stored as clamp(x / kv_scale, +-448) in E4M3 and read back as
    stored * kv_scale. kv_scale defaults to 1 (no calibration data in RL; vLLM's default too). Cheapest; values
    beyond +-448 saturate.
  * per-token scales (token_scales=True, `precision.kv_cache=fp8-token`): every token's key (and value) vector of
    every kv head gets its own float32 scale, amax over head_dim / 448, exactly the "fp8" rowwise format of
    `quarl.formats` on rows of head_dim values; read back as float32(code * scale) rounded to the model dtype.
    No calibration, no saturation; 4 more bytes per head_dim values. The scales live in `key_scales` /
    `value_scales` [num_slots, num_kv_heads, capacity] float32 next to the codes. (The Triton attention applies
    the scales in float32 to the scores and probabilities instead of rounding code * scale to the model dtype:
    the same values up to that one rounding.)
"""

from __future__ import annotations

import torch

from quarl import kernels
from quarl.formats.registry import quantize_unchecked
from quarl.rollout.fast_attention import FP8_KV_DTYPE, FP8_KV_MAX


class SlotKVCache:
    """Per-layer key/value slot buffers (see the module docstring).

    Attributes:
        keys, values: lists (one per layer) of [num_slots, num_kv_heads, capacity, head_dim] tensors in kv_dtype.
        kv_scale: float; dequantisation scale of a single-scale FP8 cache (1.0 otherwise).
        key_scales, value_scales: lists (one per layer) of [num_slots, num_kv_heads, capacity] float32 per-token
            scales of a token-scaled FP8 cache, else None.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, capacity: int,
                 kv_dtype: torch.dtype, device: torch.device | str, kv_scale: float = 1.0,
                 token_scales: bool = False):
        if num_slots < 1 or capacity < 1:
            raise ValueError(f"SlotKVCache needs num_slots >= 1 and capacity >= 1, got {num_slots}, {capacity}")
        if token_scales and (kv_dtype != FP8_KV_DTYPE or kv_scale != 1.0):
            raise ValueError("token_scales=True is an FP8 cache scaling (kv_dtype=torch.float8_e4m3fn) and replaces "
                             f"the single kv_scale; got kv_dtype={kv_dtype}, kv_scale={kv_scale}")
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        # Zeroed once: a length mask hides unwritten columns from the softmax, but the torch attention path still
        # multiplies them by probability 0, and 0 * NaN (uninitialised memory) would be NaN.
        self.keys = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(num_layers)]
        self.key_scales = self.value_scales = None
        if token_scales:
            self.key_scales = [torch.ones(shape[:3], device=device) for _ in range(num_layers)]
            self.value_scales = [torch.ones(shape[:3], device=device) for _ in range(num_layers)]
        self.kv_scale = float(kv_scale)
        self._fused_write: bool | None = None  # decided on the first decode write (kernels available there?)

    @staticmethod
    def nbytes_for(num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, capacity: int,
                   kv_dtype: torch.dtype, token_scales: bool = False) -> int:
        """Bytes the cache will take (keys + values, all layers; per-token scales included)."""
        item = torch.empty(0, dtype=kv_dtype).element_size()
        per_column = head_dim * item + (4 if token_scales else 0)
        return 2 * num_layers * num_slots * num_kv_heads * capacity * per_column

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def token_scales(self) -> bool:
        return self.key_scales is not None

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(key scales, value scales) [num_slots, num_kv_heads, capacity] of a layer, or (None, None)."""
        if self.key_scales is None:
            return None, None
        return self.key_scales[layer], self.value_scales[layer]

    def quantize_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-scaled FP8: x [..., head_dim] -> (E4M3 codes [..., head_dim], float32 scales [...]), the "fp8"
        rowwise format of `quarl.formats` on the head_dim rows, except that an all-zero vector stores scale 0
        instead of 1 (its codes are 0, so it reads back the same): a zero vector must not set the attention
        kernel's value-scale normaliser (`quarl.kernels.decode_attention`)."""
        qt = quantize_unchecked(x, "fp8", "activation")
        scale = qt.scale[..., 0]
        return qt.data, torch.where(x.abs().amax(-1) > 0, scale, torch.zeros_like(scale))

    def to_storage(self, x: torch.Tensor) -> torch.Tensor:
        """Model-dtype keys/values -> the cache dtype (scaled, saturated to +-448 for a single-scale FP8 cache; a
        cast that does not saturate would turn large values into NaN). Not for a token-scaled cache
        (`quantize_tokens`)."""
        if self.dtype != FP8_KV_DTYPE:
            return x.to(self.dtype)
        x = x.float() if self.kv_scale == 1.0 else x.float() / self.kv_scale
        return x.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)

    def write_tokens(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Decode write: k, v [B, Hkv, D] of slots 0..B-1 at columns positions [B] (long). CUDA-graph safe.

        On a GPU one Triton launch for both (`quarl.kernels.kv_write`, the same stored values), once a first call
        has checked it against the torch write (see `_kernel_write_ok`)."""
        if self._fused_write is None:
            self._fused_write = self._kernel_write_ok(k)
        if self._fused_write and k.stride(-1) == 1 and v.stride(-1) == 1 and k.dtype != torch.float64:
            from quarl.kernels.kv_write import write_kv

            write_kv(k, v, self.keys[layer], self.values[layer], positions, self.kv_scale, *self.scales(layer))
            return
        self._write_tokens_torch(layer, positions, k, v)

    def _kernel_write_ok(self, k: torch.Tensor) -> bool:
        """Whether the one-launch write may serve this cache: kernels available for its dtype, and on a small
        probe cache (random keys/values of k's dtype, some beyond +-448) it stores exactly what the torch write
        stores. A compile error or a difference warns and keeps the torch write. Runs once per cache, on the
        first decode write (the engine's eager warm-up, never inside a graph capture)."""
        available = kernels.fp8_kernels_available if self.dtype == FP8_KV_DTYPE else kernels.kernels_available
        if not (k.is_cuda and k.dtype != torch.float64 and available(k.device)):
            return False
        from quarl.kernels.kv_write import write_kv

        H, D = k.shape[1], k.shape[2]
        probes = [SlotKVCache(1, 3, H, D, 4, self.dtype, k.device, self.kv_scale, self.token_scales) for _ in "ab"]
        gen = torch.Generator(device=k.device).manual_seed(0)  # leaves the user's CUDA random stream alone
        x = torch.randn(2, 2, H, D, device=k.device, generator=gen)
        x = (x * torch.tensor([1.0, 300.0], device=k.device)[:, None, None, None]).to(k.dtype)
        x[0, 0, 0] = 0  # an all-zero vector
        positions = torch.tensor([3, 1], device=k.device)

        def same_values() -> bool:
            write_kv(x[0], x[1], probes[0].keys[0], probes[0].values[0], positions, self.kv_scale, *probes[0].scales(0))
            probes[1]._write_tokens_torch(0, positions, x[0], x[1])
            stored = [[t.view(torch.uint8) for t in p.keys + p.values + (p.key_scales or []) + (p.value_scales or [])]
                      for p in probes]
            return all(torch.equal(a, b) for a, b in zip(*stored))

        return kernels.kernel_passes_check("the one-launch KV write", same_values)

    def _write_tokens_torch(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The definition of `write_tokens` in torch ops (index_put of the converted keys/values)."""
        rows = torch.arange(k.shape[0], device=k.device)
        if self.token_scales:
            for codes, scales, x in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
                q, s = self.quantize_tokens(x)
                codes[layer][rows, :, positions] = q
                scales[layer][rows, :, positions] = s
            return
        self.keys[layer][rows, :, positions] = self.to_storage(k)
        self.values[layer][rows, :, positions] = self.to_storage(v)

    def write_prompts(self, layer: int, slots: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """Prefill write: k, v [P, Hkv, T, D] (right-padded prompts); slot slots[i] gets prompt rows[i] at
        columns 0..T-1 (padding columns are written too and masked by the slot's length later)."""
        # Converted once per prompt, then copied to its slots (a group's n samples share one prompt): the
        # conversion is elementwise (per head_dim vector with token scales), so the values are the same.
        T = k.shape[2]
        if self.token_scales:
            for codes, scales, x in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
                q, s = self.quantize_tokens(x)
                codes[layer][slots, :, :T] = q.index_select(0, rows)
                scales[layer][slots, :, :T] = s.index_select(0, rows)
            return
        self.keys[layer][slots, :, :T] = self.to_storage(k).index_select(0, rows)
        self.values[layer][slots, :, :T] = self.to_storage(v).index_select(0, rows)

    def move(self, src: torch.Tensor, dst: torch.Tensor, num_columns: int) -> None:
        """Copy columns [0, num_columns) of slots src [M] into slots dst [M] (disjoint sets), every layer."""
        for buf in self.keys + self.values + (self.key_scales or []) + (self.value_scales or []):
            buf[dst, :, :num_columns] = buf[src, :, :num_columns]


class PrefillCacheWriter:
    """A KV-cache stand-in for the decoder's prefill forward that writes the prompts straight into their slots.

    It speaks the interface `QuarlForCausalLM.hidden_states` uses for a cache (`append_mask`, `write`,
    `commit`) for one forward that starts at column 0: each layer's keys/values of the right-padded batch are
    stored in the n slots of every prompt (prefill once per group, copy to its samples) and handed back for the
    forward's own attention in the model dtype.
    """

    def __init__(self, cache: SlotKVCache, slots: torch.Tensor, rows: torch.Tensor):
        """slots: long [M] target slots; rows: long [M] the prompt row of the batch each slot copies."""
        self.cache, self.slots, self.rows = cache, slots, rows
        self.length = 0

    def append_mask(self, attention_mask: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """attention_mask [P, T] (1 = real token, right padding) -> (0, key_valid bool [P, T], positions [P, T])."""
        if self.length:
            raise RuntimeError("PrefillCacheWriter serves a single forward from column 0")
        mask = attention_mask.to(torch.bool)
        positions = (mask.long().cumsum(1) - 1).clamp_min(0)
        return 0, mask, positions

    def write(self, layer_idx: int, start: int, k: torch.Tensor, v: torch.Tensor):
        self.cache.write_prompts(layer_idx, self.slots, self.rows, k, v)
        return k, v

    def commit(self, num_columns: int) -> None:
        self.length += num_columns
