"""The format registry `FORMATS` and the two entry points `quantize` / `fake_quantize`."""

from __future__ import annotations

import torch

from quarl.formats import fp4, fp8, int8
from quarl.formats.base import FormatSpec, QuantizedTensor, check_finite, check_input

# The one list of number formats: everything else (config choices, weight-only defaults, kernel availability,
# tuning families) is derived from these specs.
FORMATS: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        FormatSpec("int8", 1, False, 8, torch.int8, int8.INT8_MAX, "int8", "float32",
                   "INT8 symmetric, one scale per row (output channel / token)",
                   int8.quantize_int8, int8.dequantize_int8),
        FormatSpec("fp8", 1, False, 8, torch.float8_e4m3fn, fp8.E4M3_MAX, "e4m3", "float32",
                   "FP8 E4M3, one scale per row (output channel / token)",
                   fp8.quantize_fp8_rowwise, fp8.dequantize_fp8),
        FormatSpec("fp8-tensor", 0, False, 8, torch.float8_e4m3fn, fp8.E4M3_MAX, "e4m3", "float32",
                   "FP8 E4M3, one scale per tensor",
                   fp8.quantize_fp8_tensor, fp8.dequantize_fp8),
        FormatSpec("fp8-block", fp8.FP8_BLOCK, False, 8, torch.float8_e4m3fn, fp8.E4M3_MAX, "e4m3", "float32",
                   "FP8 E4M3, 128x128 weight tiles, 1x128 activation groups",
                   fp8.quantize_fp8_block, fp8.dequantize_fp8_block),
        FormatSpec("nvfp4", fp4.NVFP4_BLOCK, True, 4, torch.uint8, 6.0, "e2m1", "e4m3",
                   "NVFP4: E2M1 elements, E4M3 scale per 16, FP32 tensor scale",
                   fp4.quantize_nvfp4, fp4.dequantize_nvfp4),
        FormatSpec("mxfp4", fp4.MXFP4_BLOCK, True, 4, torch.uint8, 6.0, "e2m1", "e8m0",
                   "MXFP4: E2M1 elements, E8M0 power-of-two scale per 32",
                   fp4.quantize_mxfp4, fp4.dequantize_mxfp4),
    )
}


def get_format(fmt: str) -> FormatSpec:
    """The FormatSpec for a name, or a ValueError listing the valid names."""
    spec = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if spec is None:
        raise ValueError(f"unknown number format {fmt!r}; valid formats are {', '.join(FORMATS)}")
    return spec


def _pad_last(x32: torch.Tensor, kp: int) -> torch.Tensor:
    """Zero-pad the last dimension to kp (a no-op when already kp)."""
    k = x32.shape[-1]
    if k == kp:
        return x32
    return torch.nn.functional.pad(x32, (0, kp - k))


def _check_out(out: QuantizedTensor, fmt: str, role: str, x: torch.Tensor, fresh: tuple) -> None:
    """`out=` must describe the same quantization of a same-shaped tensor, with buffers of matching layout."""
    if not isinstance(out, QuantizedTensor):
        raise TypeError(f"out= must be a QuantizedTensor, got {type(out).__name__}")
    if (out.fmt, out.role, tuple(out.shape)) != (fmt, role, tuple(x.shape)):
        raise ValueError(
            f"out= holds fmt={out.fmt!r} role={out.role!r} shape={tuple(out.shape)} but this call quantizes "
            f"fmt={fmt!r} role={role!r} shape={tuple(x.shape)}; allocate it with quantize(x, fmt, role) first"
        )
    for name, new, old in zip(("data", "scale", "global_scale"), fresh, (out.data, out.scale, out.global_scale)):
        if (new is None) != (old is None) or (
            new is not None and (new.shape != old.shape or new.dtype != old.dtype or new.device != old.device)
        ):
            raise ValueError(
                f"out.{name} does not match the layout of a fresh quantization (expected "
                f"{None if new is None else (tuple(new.shape), new.dtype, new.device)}, got "
                f"{None if old is None else (tuple(old.shape), old.dtype, old.device)}); "
                "the buffers must be on x's device with the format's dtypes"
            )


def quantize(
    x: torch.Tensor, fmt: str, role: str = "weight", out: QuantizedTensor | None = None
) -> QuantizedTensor:
    """Quantize x [..., K] (bf16/fp16/fp32/fp64) into `fmt` along its last dimension.

    role="weight": x must be 2-D [N, K] (scales per output row / 128x128 tile); role="activation": any leading
    dims (scales per row / 1x128 group). Scales are computed in float32 from x cast to float32. A K that is not
    a multiple of the format's block is zero-padded (see `QuantizedTensor`). Tensors with zero rows (but K > 0)
    give an empty QuantizedTensor (scales of 1 where a scale has no rows to come from); K = 0 is an error.
    out: an existing QuantizedTensor of the same fmt/role/shape on x's device: its buffers are overwritten in
    place (same storage, no reallocation) and it is returned; this is the per-step re-quantize ("sync").
    Raises ValueError/TypeError for an unknown format, a bad role, a non-floating dtype, NaN/Inf values.
    """
    spec = get_format(fmt)
    check_input(x, fmt, role)
    x32 = x.detach().to(torch.float32)
    check_finite(x32, x, fmt, role)
    shape = x.shape
    data, scale, global_scale = spec.quantize_fn(_pad_last(x32, spec.padded_k(shape[-1])), role)
    if out is None:
        return QuantizedTensor(fmt, role, data, scale, global_scale, shape)
    _check_out(out, fmt, role, x, (data, scale, global_scale))
    out.data.copy_(data)
    out.scale.copy_(scale)
    if global_scale is not None:
        out.global_scale.copy_(global_scale)
    return out


def quantize_unchecked(x: torch.Tensor, fmt: str, role: str = "weight") -> QuantizedTensor:
    """quantize without the input checks, for hot paths (a linear layer's every forward).

    Skips the dtype/shape validation and the NaN/Inf scan, whose `.all()` forces a GPU synchronisation per
    call. NaN/Inf inputs are not reported here: they propagate into the output (a NaN amax makes the scale NaN).
    x: floating [..., K] (2-D for role="weight").
    """
    spec = FORMATS[fmt]
    x32 = x.detach().to(torch.float32)
    data, scale, global_scale = spec.quantize_fn(_pad_last(x32, spec.padded_k(x.shape[-1])), role)
    return QuantizedTensor(fmt, role, data, scale, global_scale, x.shape)


def fake_quantize_unchecked(x: torch.Tensor, fmt: str, role: str = "weight") -> torch.Tensor:
    """fake_quantize without the input checks (see `quantize_unchecked`); returns x's shape and dtype."""
    return quantize_unchecked(x, fmt, role).dequantize(x.dtype)


def fake_quantize(x: torch.Tensor, fmt: str, role: str = "weight") -> torch.Tensor:
    """quantize(x, fmt, role).dequantize(x.dtype): the values the quantized model sees, in x's shape and dtype.

    No gradient flows through it (the codes are discrete); use a straight-through estimator around it.
    """
    return quantize(x, fmt, role).dequantize(x.dtype)
