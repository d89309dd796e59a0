"""A static key/value cache for a left-padded batch of sequences.

Layout (one pair of tensors per layer): keys/values [B, num_kv_heads, capacity, head_dim]. All rows advance
together one *column* per decoded token; `valid` [B, capacity] marks the columns that hold a real token (left
padding and prompts of different lengths leave invalid columns at the start of shorter rows). Because padding only
ever sits before a row's first real token, "causal in column order" equals "causal in token order", so a single
column index serves every row. Each row keeps its own rotary position counter (`next_position`).

Rows can be dropped (finished sequences stop costing compute) with `select`, and a prefilled prompt is shared by
its n samples with `repeat_interleave` (prefill once, copy the cache n times).
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer key/value buffers plus the column bookkeeping the decoder needs.

    Attributes:
        keys, values: lists (one per layer) of [B, num_kv_heads, capacity, head_dim] tensors (model dtype).
        valid: bool [B, capacity]; True where the column holds a real token.
        next_position: long [B]; the rotary position of the next real token of each row.
        length: int; the number of columns filled so far (same for every row).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        if batch_size < 1 or capacity < 1:
            raise ValueError(f"KVCache needs batch_size >= 1 and capacity >= 1, got {batch_size}, {capacity}")
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        # Uninitialised on purpose: a column is always written (by the forward that fills it, padding included)
        # before any attention reads it, so no column is ever read while it holds garbage.
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int) -> "KVCache":
        """A cache sized for `model` (a QuarlForCausalLM): its layers, kv heads, head_dim, dtype and device."""
        c = model.config
        emb = model.model.embed_tokens.weight
        return cls(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, capacity, emb.dtype, emb.device)

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def append_mask(self, attention_mask: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Reserve T new columns for a forward over `attention_mask` [B, T] (1 = real token).

        Returns (start column, key_valid bool [B, start + T], default positions long [B, T]). `length` is
        advanced by `commit` once every layer has written its keys/values.
        """
        B, T = attention_mask.shape
        if B != self.batch_size:
            raise ValueError(f"the batch has {B} rows but the KV cache holds {self.batch_size}")
        start = self.length
        if start + T > self.capacity:
            raise ValueError(
                f"KV cache overflow: {start} columns used + {T} new > capacity {self.capacity}; "
                "allocate the cache with room for prompt + max_new_tokens"
            )
        mask = attention_mask.to(device=self.valid.device, dtype=torch.bool)
        self.valid[:, start:start + T] = mask
        positions = (self.next_position[:, None] + mask.long().cumsum(1) - 1).clamp_min(0)
        self.next_position += mask.long().sum(1)
        return start, self.valid[:, :start + T], positions

    def write(self, layer_idx: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] at columns [start, start + T); return all keys/values up to start + T."""
        end = start + k.shape[2]
        self.keys[layer_idx][:, :, start:end] = k
        self.values[layer_idx][:, :, start:end] = v
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def commit(self, num_columns: int) -> None:
        self.length += num_columns

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (long [B'], indices into the current batch), in that order. In place."""
        rows = rows.to(self.valid.device)
        self.keys = [self._take(k, rows) for k in self.keys]
        self.values = [self._take(v, rows) for v in self.values]
        self.valid = self.valid.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)

    def _take(self, buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows of `buf` in a new buffer of the same capacity; only the filled columns are copied."""
        out = buf.new_empty((rows.numel(),) + tuple(buf.shape[1:]))
        out[:, :, :self.length] = buf[:, :, :self.length].index_select(0, rows)
        return out

    def repeat_interleave(self, n: int) -> None:
        """Row i becomes rows i*n .. i*n+n-1 (a prompt's prefill shared by its n samples). In place."""
        if n == 1:
            return
        self.select(torch.arange(self.batch_size, device=self.valid.device).repeat_interleave(n))
