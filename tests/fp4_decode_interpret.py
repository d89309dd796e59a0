"""CPU check of `quarl.kernels.fp4_decode` in Triton's interpreter (no GPU): small shapes, both paths. Run by
tests/test_fp4_decode_interpreter.py, or by hand:

    TRITON_INTERPRET=1 python tests/fp4_decode_interpret.py [--quick] [--candidates]

Compares each result with the float64 reference x.double() @ dequantize(W).double().T (+ bias) as the max over
rows of max_n |y - ref| / max_n |ref|. Tolerances: fp16 output 2^-10 (rounding is 2^-11 relative); bf16 output
2^-7, because the interpreter converts float32 to bfloat16 by truncation (1 ulp = 2^-7), not round-to-nearest
as the GPU does (2^-8, the bound the GPU tests use). Also checks the tensor-core path's MXFP4
scale range (exact for E8M0 exponents 26..152, a larger exponent makes its output column non-finite). Exits
non-zero on any failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (this script checks the kernels in Triton's CPU interpreter)")

import torch  # noqa: E402
import triton.runtime.interpreter as _interp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from quarl.formats import quantize  # noqa: E402
from quarl.kernels.fp4_decode import fp4_decode_matmul  # noqa: E402
from quarl.kernels.tuning import Cfg  # noqa: E402

_orig_patch = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    """Triton 3.6's interpreter turns a scalar (stored as a 1-element array) into a Python int with int(array),
    which NumPy >= 2.4 rejects for 1-D arrays; loop bounds computed from kernel arguments then fail."""
    _orig_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_lang_tensor

TOL = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}

# (M, N, K, fmt, cfg, x dtype, bias): M = 1, M not a power of two, N not a multiple of bn, K not a multiple of
# 16 (padded weight) or of bk, split-K with a partial last split, both paths, both formats.
CASES = [
    (1, 24, 200, "nvfp4", Cfg(1, 8, 64), torch.float16, False),
    (3, 20, 136, "nvfp4", Cfg(1, 16, 64, split_k=2), torch.float16, True),
    (5, 33, 264, "nvfp4", Cfg(1, 8, 128, split_k=3), torch.bfloat16, True),
    (8, 16, 130, "mxfp4", Cfg(1, 8, 64, split_k=2), torch.bfloat16, False),
    (1, 40, 256, "nvfp4", Cfg(16, 64, 128), torch.float16, True),
    (5, 70, 300, "nvfp4", Cfg(16, 64, 256, split_k=2), torch.float16, False),
    (37, 20, 392, "nvfp4", Cfg(16, 64, 128, split_k=3), torch.bfloat16, True),
    (17, 16, 256, "mxfp4", Cfg(16, 64, 128), torch.bfloat16, True),
    (9, 130, 600, "mxfp4", Cfg(16, 128, 256, split_k=2, warps=8), torch.bfloat16, False),
    (64, 16, 128, "nvfp4", Cfg(16, 64, 128), torch.float16, False),
    # K a multiple of every split (the unmasked EVEN_K loads), split-K on both paths.
    (4, 24, 1024, "nvfp4", Cfg(1, 8, 128, split_k=4), torch.float16, True),
    (16, 32, 512, "nvfp4", Cfg(16, 64, 128, split_k=2), torch.float16, True),
    (16, 64, 1024, "nvfp4", Cfg(16, 64, 256, split_k=2), torch.bfloat16, True),
    # x permuted beforehand (cfg.native, K a multiple of 128)
    (16, 70, 512, "nvfp4", Cfg(16, 64, 128, split_k=2, native=True), torch.bfloat16, True),
    (37, 64, 384, "mxfp4", Cfg(16, 128, 256, warps=8, native=True), torch.bfloat16, False),
]
QUICK = [0, 2, 4, 6]


def rel_row_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows of max_n |y - ref| / max_n |ref| (float64)."""
    return float(((y.double() - ref).abs().amax(1) / ref.abs().amax(1).clamp_min(1e-30)).max())


def check(m, n, k, fmt, cfg, dtype, with_bias, gen) -> tuple[float, float]:
    w = torch.randn(n, k, generator=gen) * 0.05
    # odd M: x is a column slice of a wider tensor (row stride > K), as a caller's view may be
    x = (torch.randn(m, k + (8 if m % 2 else 0), generator=gen) * 2).to(dtype)[:, :k]
    b = (torch.randn(n, generator=gen) * 0.1).to(dtype) if with_bias else None
    qw = quantize(w, fmt)
    y = fp4_decode_matmul(x, qw, b, cfg)
    assert y.shape == (m, n) and y.dtype == dtype, (y.shape, y.dtype)
    ref = x.double() @ qw.dequantize(torch.float64).T
    if b is not None:
        ref = ref + b.double()
    return rel_row_err(y, ref), TOL[dtype]


def check_mxfp4_scale_range(gen) -> bool:
    """The tensor-core path's MXFP4 folding (module docstring of `quarl.kernels.fp4_decode`): exact for E8M0
    exponents 26..152, and a block above 152 makes its output column non-finite rather than silently wrong."""
    n, k, cfg = 96, 256, Cfg(16, 64, 128)
    w = torch.randn(n, k, generator=gen) * 0.05
    row_scale = torch.ones(n, 1)
    row_scale[0::3], row_scale[1::3] = 2.0**-94, 2.0**29  # exponents about 26 and 151
    qw = quantize(w * row_scale, "mxfp4")
    e = qw.scale.view(torch.uint8).int()
    x = (torch.randn(5, k, generator=gen) * 2).to(torch.bfloat16)
    err = rel_row_err(fp4_decode_matmul(x, qw, None, cfg), x.double() @ qw.dequantize(torch.float64).T)
    in_range = 26 <= int(e.min()) and int(e.max()) <= 152 and err <= TOL[torch.bfloat16]
    w_big = w.clone()
    w_big[7] *= 2.0**32  # exponent about 154: past the exact range
    qb = quantize(w_big, "mxfp4")
    y = fp4_decode_matmul(x, qb, None, cfg)
    loud = int(qb.scale.view(torch.uint8).max()) > 152 and not torch.isfinite(y[:, 7]).any() and \
        bool(torch.isfinite(torch.cat([y[:, :7], y[:, 8:]], 1)).all())
    print(f"mxfp4 exponents {int(e.min())}..{int(e.max())}: err={err:.2e} {'ok' if in_range else 'FAIL'}; "
          f"exponent {int(qb.scale.view(torch.uint8).max())}: output column non-finite {'ok' if loud else 'FAIL'}")
    return in_range and loud


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only a few cases")
    ap.add_argument("--candidates", action="store_true",
                    help="also run every fp4_decode config `quarl bench gemm --sweep` tries, on a small shape "
                         "of its M bucket")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: a fresh one, printed)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed} (rerun with --seed {seed})")
    gen = torch.Generator().manual_seed(seed)
    bad = 0
    cases = [c for i, c in enumerate(CASES) if not args.quick or i in QUICK]
    if args.candidates:
        from quarl.bench.gemm import _fp4_decode_candidates

        for m, cfgs in _fp4_decode_candidates(Cfg).items():
            # N: one full tile and a partial one; K: not a multiple of bk (partial K step, unpadded tail).
            # (x permuted beforehand, cfg.native, needs K a multiple of 128: those get K = 2 bk.)
            cases += [(m, c.bn + 3, 2 * c.bk + (0 if c.native and c.bm == 16 else 24), "nvfp4", c, torch.float16, False)
                      for c in cfgs]
    for m, n, k, fmt, cfg, dtype, bias in cases:
        t0 = time.time()
        err, tol = check(m, n, k, fmt, cfg, dtype, bias, gen)
        ok = err <= tol
        bad += not ok
        print(f"M={m:2d} N={n:3d} K={k:3d} {fmt} {cfg.name():20s} {str(dtype)[6:]:8s} bias={bias!s:5s} "
              f"err={err:.2e} tol={tol:.1e} {'ok' if ok else 'FAIL'} ({time.time() - t0:.1f} s)", flush=True)
    bad += not check_mxfp4_scale_range(gen)
    print(f"all ok (seed {seed})" if not bad else f"{bad} FAILED (seed {seed}: rerun with --seed {seed})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
