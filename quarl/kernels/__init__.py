"""GPU fast paths behind the reference formats. `try_quantized_matmul` returns None where no kernel applies."""

from __future__ import annotations

import torch


def try_quantized_matmul(x: torch.Tensor, qweight, weight_only: bool, bias: torch.Tensor | None = None):
    """y = Q(x) @ dequant(qweight)^T (+ bias) on a fast kernel, or None when none applies (CPU, unsupported).

    x: [M, K] activations in the compute dtype; qweight: a `quarl.formats.QuantizedTensor` with role "weight"
    and shape [N, K]; weight_only: True = W4A16/W8A16 (x is not quantized). Returns [M, N] in x.dtype or None.
    """
    return None
