"""E2M1 (FP4) element codes: rounding onto the code grid and packing two codes per byte.

A code is 4 bits: bit 3 = sign, bits 0..2 = index into the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Rounding is to the nearest magnitude, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
2.5 -> 2, 3.5 -> 4, 5 -> 4). Zero is always code 0 (no negative zero), so equal values give equal bytes.
Packing: element 2i in the low nibble, element 2i+1 in the high nibble.
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# Midpoints between neighbouring magnitudes, and whether a value exactly on the midpoint rounds up:
# it does when the upper code index is even (ties to even on the code grid).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


_LUTS: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    """float32 [16]: the value of each 4-bit code. Cached per device: a host-to-device copy on every call would
    also break CUDA-graph capture of the rollout step."""
    lut = _LUTS.get(device)
    if lut is None:
        mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
        lut = _LUTS[device] = torch.cat([mags, -mags])
    return lut


def encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to E2M1 codes: uint8 in 0..15, same shape.

    Values beyond +-6 saturate to +-6 (code 7 / 15).
    """
    a = v.abs()
    idx = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, tie_up in _MIDPOINTS:
        idx += (a >= mid if tie_up else a > mid).to(torch.uint8)
    sign = ((v < 0) & (idx > 0)).to(torch.uint8) << 3
    return idx | sign


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15, any shape) -> float32 values of the same shape."""
    return _lut(codes.device)[codes.long()]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> uint8 bytes [..., K/2]: element 2i low nibble, 2i+1 high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing two E2M1 codes per byte needs an even last dimension, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes [..., K/2] -> uint8 codes [..., K] (inverse of `pack`)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes [..., K/2] -> float32 code values [..., K]."""
    return decode(unpack(packed))
