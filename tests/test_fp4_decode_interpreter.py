"""The W4A16 decode kernels (`quarl.kernels.fp4_decode`) on the CPU, in Triton's interpreter: both paths (CUDA-core
FMA and tensor-core swap-AB), nvfp4 and mxfp4, split-K, ragged M / N / K, and every configuration the sweep tries,
each against the float64 reference x @ dequantize(W)^T (tolerances in tests/fp4_decode_interpret.py)."""

import os
import subprocess
import sys

import pytest


def test_fp4_decode_kernels_match_float64_reference_in_interpreter():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "tests/fp4_decode_interpret.py", "--candidates"], cwd=root,
                         env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "all ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
