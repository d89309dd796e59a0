"""Number formats (BRIEF §3): plain PyTorch references that define the semantics the GPU kernels must match.

    FORMATS        dict name -> FormatSpec for "int8", "fp8", "fp8-tensor", "fp8-block", "nvfp4", "mxfp4"
    quantize       x [..., K] -> QuantizedTensor (codes + float32/E4M3/E8M0 scales), optionally in place (out=)
    fake_quantize  x -> dequantize(quantize(x)) in x's dtype
    QuantizedTensor  the container shared by the formats, the linear layer and the kernels
"""

from quarl.formats.base import ROLES, FormatSpec, QuantizedTensor
from quarl.formats.registry import FORMATS, fake_quantize, get_format, quantize

__all__ = ["FORMATS", "ROLES", "FormatSpec", "QuantizedTensor", "fake_quantize", "get_format", "quantize"]
