"""Shared pieces of the number formats: the format description, the quantized-tensor container, input checks.

Conventions (BRIEF §3): a tensor x [..., K] is quantized along its last dimension K (the reduction dimension of
a GEMM). Scales are float32 and computed from x cast to float32; a division by a format constant (amax / 127,
amax / 448, ...) is computed as a multiplication by the float32 reciprocal (`div_const`), identically on CPU and
GPU; divisions by tensors (x / s) are exact IEEE divisions. Rounding is round to nearest, ties to even.
A last dimension that is not a multiple of the format's block is zero-padded to Kp (zeros change neither a
block's amax nor a dot product); `QuantizedTensor.dequantize` trims the padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

ROLES = ("weight", "activation")


@dataclass(frozen=True)
class FormatSpec:
    """Static description of one number format.

    name: registry key ("int8", "fp8", "fp8-tensor", "fp8-block", "nvfp4", "mxfp4").
    block_size: elements per scale along K: 1 = one scale per row (int8, fp8), 0 = one scale per tensor
        (fp8-tensor), otherwise a block of that many consecutive K elements (fp8-block 128, nvfp4 16, mxfp4 32).
    weight_only_default: True where Hopper has no tensor cores for the format (fp4: W4A16, BRIEF §3).
    bits: bits per stored element code.
    code_dtype: dtype of `QuantizedTensor.data` (fp4 codes are packed two per torch.uint8).
    max_code: largest magnitude a code represents (127, 448 or 6).
    packed: True when two codes share one byte (fp4).
    element: what a code is: "int8", "e4m3" (FP8) or "e2m1" (FP4).
    scale_type: what a stored scale is: "float32", "e4m3" (nvfp4 block scales) or "e8m0" (mxfp4, power of two).

    What a format can do follows from these fields (the properties below); code elsewhere asks the spec
    (`get_format(fmt).needs_fp8_hardware`, ...) rather than listing format names.
    """

    name: str
    block_size: int
    weight_only_default: bool
    bits: int
    code_dtype: torch.dtype
    max_code: float
    element: str
    scale_type: str
    description: str
    # (x32 [..., Kp] float32, role) -> (data, scale, global_scale); x32 is finite and padded.
    quantize_fn: Callable = field(repr=False, compare=False)
    # (QuantizedTensor) -> float32 [..., Kp] (still padded).
    dequantize_fn: Callable = field(repr=False, compare=False)

    @property
    def packed(self) -> bool:
        """Two codes share one byte (the 4-bit formats)."""
        return self.bits == 4

    @property
    def pad_multiple(self) -> int:
        """Kp is a multiple of this: the K block, and 2 when two codes are packed in one byte."""
        block = max(self.block_size, 1)
        return math.lcm(block, 2) if self.packed else block

    def padded_k(self, k: int) -> int:
        m = self.pad_multiple
        return -(-k // m) * m

    @property
    def needs_fp8_hardware(self) -> bool:
        """Its GPU kernels decode E4M3 values (codes or block scales), which Triton does from compute capability
        8.9 (Ada, Hopper) on; older GPUs take the exact reference paths."""
        return "e4m3" in (self.element, self.scale_type)

    @property
    def is_8bit(self) -> bool:
        """8-bit codes: W8A8 GEMMs on tensor cores, and a one-pass activation fake-quantization kernel."""
        return self.bits == 8

    @property
    def per_tensor_scale(self) -> bool:
        """One scale for the whole tensor: an activation's rounding then depends on the rest of the batch."""
        return self.block_size == 0

    @property
    def tuning_family(self) -> str:
        """The kernel-tuning table this format's W8A8 / W4A16 GEMMs use (`quarl.kernels.tuning`): fp4 formats share
        "w4a16", a per-tensor FP8 scale follows the rowwise "fp8" table, others have their own."""
        if self.bits == 4:
            return "w4a16"
        return "fp8" if self.element == "e4m3" and self.per_tensor_scale else self.name


@dataclass
class QuantizedTensor:
    """A quantized tensor: element codes + scales, dequant = code * scale (* global_scale).

    fmt: format name (a key of `quarl.formats.FORMATS`); role: "weight" | "activation".
    data: codes, last dim padded to Kp:
        int8 -> torch.int8 [..., Kp]; fp8 / fp8-tensor / fp8-block -> torch.float8_e4m3fn [..., Kp];
        nvfp4 / mxfp4 -> torch.uint8 [..., Kp/2], two E2M1 codes per byte, element 2i in the low nibble,
        sign in bit 3 of each nibble, codes 0..7 = magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (zero is always
        stored as code 0, never as negative zero).
    scale:
        int8 / fp8: float32, weight [N, 1], activation [..., 1] (one per row / token);
        fp8-tensor: float32 0-dim;
        fp8-block: float32, weight [ceil(N/128), Kp/128] (128x128 tiles, a partial edge tile uses the rows
            present), activation [..., Kp/128] (1x128 groups);
        nvfp4: torch.float8_e4m3fn [..., Kp/16] (the rounded block scales);
        mxfp4: torch.uint8 [..., Kp/32], E8M0 biased exponents e: scale = 2**(e - 127).
    global_scale: nvfp4 only, float32 0-dim multiplier amax/(448*6) (1 when amax = 0); None otherwise.
    shape: the original, unpadded shape [..., K].
    """

    fmt: str
    role: str
    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    shape: torch.Size

    @property
    def spec(self) -> FormatSpec:
        from quarl.formats.registry import FORMATS  # lazy: the registry imports this module

        return FORMATS[self.fmt]

    @property
    def padded_k(self) -> int:
        """Kp, the padded length of the last dimension."""
        return self.spec.padded_k(self.shape[-1])

    @property
    def device(self) -> torch.device:
        return self.data.device

    def codes(self) -> torch.Tensor:
        """The element codes as the values they stand for, before scaling: float32 [..., Kp] (padded)."""
        from quarl.formats.e2m1 import decode_packed

        if self.spec.packed:
            return decode_packed(self.data)
        return self.data.to(torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized values [*shape] (padding trimmed), computed in float32 then cast to `dtype`."""
        if not dtype.is_floating_point:
            raise ValueError(f"dequantize(dtype={dtype}) needs a floating dtype such as torch.float32 or "
                             "torch.bfloat16")
        full = self.spec.dequantize_fn(self)
        return full[..., : self.shape[-1]].to(dtype)

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        """A copy on another device (dtypes unchanged)."""
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return QuantizedTensor(self.fmt, self.role, self.data.to(device), self.scale.to(device), gs, self.shape)

    def nbytes(self) -> int:
        """Bytes held by codes and scales (what a rollout copy costs in memory)."""
        n = self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
        if self.global_scale is not None:
            n += self.global_scale.numel() * self.global_scale.element_size()
        return n


def div_const(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c for a constant c, computed as t * float32(1 / c) on every device (within 1 ulp of the quotient).

    Why: PyTorch's CUDA kernels divide a tensor by a Python scalar as a multiplication by the float32
    reciprocal while its CPU kernels divide exactly, so `amax / 127` gave different last bits on the two
    devices. Spelling out the multiplication makes the CPU reference, the CUDA reference and the Triton kernels
    (quarl.kernels.quant_utils) agree bit for bit.
    """
    return t * (1.0 / c)


def safe_scale(scale: torch.Tensor) -> torch.Tensor:
    """Replace zero scales (an all-zero row/block, or a float32 underflow of amax/qmax) by 1.

    Why: dividing by a zero scale gives NaN; with scale 1 the codes of an all-zero block are 0, so the block
    dequantizes to exact zeros (BRIEF §3: "amax = 0 gives scale 1").
    """
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def check_input(x: torch.Tensor, fmt: str, role: str) -> None:
    """Raise a clear error for inputs no format can quantize (wrong type/dtype/shape, non-finite values)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize(fmt={fmt!r}) expects a torch.Tensor, got {type(x).__name__}")
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not a quantization role; choose one of {ROLES}")
    if not x.dtype.is_floating_point:
        raise TypeError(
            f"quantize(fmt={fmt!r}) needs a floating tensor (bfloat16, float16, float32 or float64), got {x.dtype}; "
            "cast it first, e.g. x.float()"
        )
    if x.dim() == 0:
        raise ValueError(f"quantize(fmt={fmt!r}) needs a tensor [..., K] with at least one dimension, got a scalar")
    if role == "weight" and x.dim() != 2:
        raise ValueError(
            f"role='weight' expects a 2-D weight [out_features, in_features], got shape {tuple(x.shape)}; "
            "use role='activation' for tensors [..., K]"
        )
    if x.shape[-1] == 0:
        raise ValueError(
            f"quantize(fmt={fmt!r}) got shape {tuple(x.shape)} with an empty last dimension K; "
            "there is nothing to quantize along K"
        )


def check_finite(x32: torch.Tensor, original: torch.Tensor, fmt: str, role: str) -> None:
    """Raise if x (already cast to float32) has NaN/Inf: its scales would be NaN and poison every code."""
    if x32.numel() == 0 or bool(torch.isfinite(x32).all()):
        return
    n_nan = int(torch.isnan(original).sum())
    n_inf = int(torch.isinf(original).sum())
    n_bad = int((~torch.isfinite(x32)).sum())
    first = tuple(int(i) for i in torch.nonzero(~torch.isfinite(x32))[0])
    what = "weights" if role == "weight" else "activations"
    detail = f"{n_nan} NaN and {n_inf} Inf values"
    if n_nan + n_inf < n_bad:
        detail += f" ({n_bad - n_nan - n_inf} more finite {original.dtype} values overflow float32)"
    raise ValueError(
        f"cannot quantize {what} of shape {tuple(original.shape)} to {fmt}: {detail}, first at index {first}; "
        f"check the {what} (a diverged training step, a bad checkpoint or a bad learning rate)"
    )
