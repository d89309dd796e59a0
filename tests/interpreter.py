"""Running Triton kernels on the CPU: a script in a subprocess with TRITON_INTERPRET=1 (read at Triton's import)."""

import os
import subprocess
import sys
import textwrap

import pytest

# Prepend to a script. Two fixes to the interpreter:
# - numpy >= 2 refuses int() of 1-element arrays in its range();
# - its float down-conversions truncate (float32 -> bf16) or round without carrying into the exponent (-> fp8:
#   7.81 becomes 4.0), where the GPU rounds to nearest even: conversions between the float types torch has run
#   through torch instead (round to nearest even, as the hardware's cvt.rn). Out of range, torch's float8 gives
#   NaN where the GPU's satfinite conversion saturates to +-448: the kernels clamp before converting.
INTERPRETER_PATCH = textwrap.dedent("""
    import numpy as np
    import torch
    import triton.runtime.interpreter as ti
    _orig = ti._patch_lang_tensor
    def _patched(tensor, scope):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    ti._patch_lang_tensor = _patched

    _TORCH_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                     "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
    _orig_convert = ti._convert_float
    def _convert_rne(input, input_dtype, output_dtype, rounding_mode):
        a, b = _TORCH_FLOATS.get(input_dtype.name), _TORCH_FLOATS.get(output_dtype.name)
        if a is None or b is None or rounding_mode not in (None, ti._ir.ROUNDING_MODE.RTNE):
            return _orig_convert(input, input_dtype, output_dtype, rounding_mode)
        t = torch.from_numpy(np.ascontiguousarray(input).view(f"i{a.itemsize}")).view(a)  # the same bits
        return t.to(b).view({1: torch.int8, 2: torch.int16, 4: torch.int32}[b.itemsize]).numpy().view(
            f"u{b.itemsize}")
    ti._convert_float = _convert_rne
""")

# Prepend after INTERPRETER_PATCH where a test needs a row's result not to depend on where the row sits in its
# tile: the interpreter's tl.dot is numpy's float32 matmul, whose BLAS (on some CPUs) sums a row's products in an
# order that depends on the row's position in the tile, where a GPU kernel of fixed tiles sums every row alike.
# In float64 the products of float16/bfloat16/float32 operands are exact and their sum over one tile is nearly
# so, whatever the order; the result is rounded once to float32, as the GPU's accumulator holds it. Each K-tile
# still adds into the float32 accumulator, so a kernel whose K tiling depended on the batch would still show.
ORDER_FREE_DOT_PATCH = textwrap.dedent("""
    _orig_dot = ti.InterpreterBuilder.create_dot
    def _order_free_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype != np.float32 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return ti.TensorHandle((product + d.data).astype(np.float32), d.dtype.scalar)
    ti.InterpreterBuilder.create_dot = _order_free_dot
""")


def run_in_interpreter(script: str) -> None:
    """Run `script` (which prints "ok" when its checks pass) in Triton's interpreter; fail with its output."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-500:] + res.stderr[-3000:]
