"""GPU fast paths behind the reference formats. `try_quantized_matmul` returns None where no kernel applies.

Importing this package never needs Triton or a GPU: the Triton kernels are imported on the first call that can
use them. Kernel choice per format and M lives in `quarl.kernels.tuning`: a policy in code over per-GPU tables
of data (`quarl/kernels/tuning_tables/`).

The kernels read the canonical `QuantizedTensor` layouts directly (no transposed or re-packed copies), so an
in-place re-quantization (`quantize(w, fmt, out=qt)`, the per-step sync) needs no cache invalidation.

The entry points live in modules of one job each, and are re-exported here:

    availability   whether the kernels can run here (`kernels_available`, `fp8_kernels_available`)
    plans          the kernel plan of one GEMM on this GPU (`plan_for`)
    matmul         the quantized matmul (`try_quantized_matmul`, `quantized_matmul`) and `dequantize`
    fake_quant     fake quantization and one-pass weight quantization
    codes          8-bit activation codes handed from the fused kernels to the next GEMM
    capabilities   the kernels' first-use self-checks and `CAPABILITIES`, the registry of their verdicts

Code inside this package calls its siblings through their modules (`availability.kernels_available(...)`): a
patch of a name in the module that defines it reaches every caller here. Code outside reads the names below.
"""

from quarl.kernels.availability import fp8_kernels_available, kernels_available
from quarl.kernels.capabilities import (TRAINING_KERNELS, decode_fused_group_ok, decode_fused_ok,
                                        decode_fused_scaled_ok, decode_fused_smooth_ok, kernel_passes_check,
                                        training_kernel_ok)
from quarl.kernels.codes import codes_handoff, matmul_from_codes, unit_scales_ok
from quarl.kernels.fake_quant import (fake_quantize_activation, fake_quantize_columns, fake_quantize_weight,
                                      try_quantize_fp8_block_weight, try_quantize_weight)
from quarl.kernels.matmul import dequantize, quantized_matmul, try_dequantize, try_quantized_matmul
from quarl.kernels.plans import PRE_HOPPER_STAGE_BYTES, plan_for

__all__ = ["try_quantized_matmul", "quantized_matmul", "try_dequantize", "dequantize",
           "fake_quantize_activation", "fake_quantize_weight", "fake_quantize_columns", "try_quantize_fp8_block_weight", "kernels_available",
           "fp8_kernels_available", "plan_for", "codes_handoff", "matmul_from_codes", "unit_scales_ok",
           "decode_fused_ok", "try_quantize_weight", "kernel_passes_check", "training_kernel_ok", "TRAINING_KERNELS",
           "decode_fused_group_ok", "decode_fused_scaled_ok", "decode_fused_smooth_ok", "PRE_HOPPER_STAGE_BYTES"]
