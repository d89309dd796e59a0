"""Where do the prequantized decode W8A8 paths lose time against the GEMM on ready-made codes, and would weights
already in L2 help?

    PYTHONPATH=. python3 bench/decode_prefetch_probe.py

For the down projection of Qwen2.5-7B (3584 x 18944, int8) at M = 16 (swap-AB tensor-core GEMM, split-K 4) and
M = 1 (GEMV), microseconds per call from `quarl.bench.gemm.time_graph` (CUDA-graph replays over weight copies
larger than L2) of:
  quant alone          `act_quant.quantize_activation`;
  gemm alone (codes)   the GEMM on codes made beforehand;
  pair                 both, as `dispatch.run_plan` runs them;
  prefetch C + gemm    a kernel that issues `prefetch.global.L2` for the first C columns of every program's weight
                       rows, then the GEMM (and that kernel alone);
  load C + gemm        the same columns loaded into registers and reduced (so they surely pass through L2),
                       then the GEMM (and that kernel alone).
If the GEMM were bound by DRAM bandwidth, "load C + gemm" would cost less than the two parts alone; it does not
(bench/results/gemm.md, session 15): the decode GEMM is bound by per-SM latency and load issue, so hiding the
quantization needs the GEMM to do real work meanwhile, not to warm L2.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _warm_kernel(w_ptr, out_ptr, N, KP, stride, K_PER, COLS: tl.constexpr, BN: tl.constexpr, LOAD: tl.constexpr):
    """Program (i, s) touches columns [s*K_PER, s*K_PER + COLS) of weight rows [i*BN, +BN) (uint8/int8 [N, KP]):
    LOAD loads and sums them (stored only under an impossible condition, so the loads stay), otherwise one
    prefetch.global.L2 per 128-byte line."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * K_PER
    cols = k0 + tl.arange(0, COLS)
    ok = (rows < N)[:, None] & (cols < KP)[None, :]
    if LOAD:
        v = tl.load(w_ptr + rows[:, None] * stride + cols[None, :], mask=ok, other=0)
        s = tl.sum(tl.sum(v.to(tl.int32), axis=1), axis=0)
        tl.store(out_ptr + tl.program_id(0), s, mask=s == 123456789)
    else:
        lines = tl.minimum(k0 + tl.arange(0, COLS // 128) * 128, KP - 1)
        safe_rows = tl.where(rows < N, rows, 0)
        ptrs = w_ptr + safe_rows.to(tl.int64)[:, None] * stride + lines[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def main() -> int:
    from quarl.bench.gemm import _copies, _n_copies, _weight_bytes, time_graph
    from quarl.formats import quantize
    from quarl.kernels.act_quant import quantize_activation
    from quarl.kernels.dispatch import codes_matmul, run_plan
    from quarl.kernels.tuning import Cfg, Plan

    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    n, k = 3584, 18944
    cases = (("int8", 16, Plan("w8a8", Cfg(16, 64, 256, split_k=4, stages=4, native=True, swap_ab=True), "prequant"),
              4736),
             ("int8", 1, Plan("gemv", Cfg(1, 8, 1024), "prequant"), k))
    for fmt, m, plan, k_per in cases:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        qw = quantize(w, fmt, "weight")
        qws = _copies(qw, _n_copies(_weight_bytes(torch, qw)))
        codes, sx = quantize_activation(x, fmt, qw.data.shape[1])
        sink = torch.zeros(1024, dtype=torch.int32, device="cuda")
        grid = (triton.cdiv(n, 64), triton.cdiv(k, k_per))

        def warm(i, cols, load):
            d = qws[i].data
            _warm_kernel[grid](d, sink, n, k, d.stride(0), k_per, COLS=cols, BN=64, LOAD=load, num_warps=4)

        def timed(fn):
            return time_graph(torch, fn, len(qws), 9) * 1e6

        rows = {
            "quant alone": timed(lambda i: quantize_activation(x, fmt, qw.data.shape[1])),
            "gemm alone (codes)": timed(lambda i: codes_matmul(plan, codes, sx, qws[i], None, x.dtype)),
            "pair (run_plan)": timed(lambda i: run_plan(plan, x, qws[i], None)),
        }
        for cols in (1024, 4096):
            for load in (False, True):
                what = f"{'load' if load else 'prefetch'} {cols}"
                rows[f"{what} + gemm"] = timed(
                    lambda i, c=cols, ld=load: (warm(i, c, ld), codes_matmul(plan, codes, sx, qws[i], None, x.dtype)))
                rows[f"{what} alone"] = timed(lambda i, c=cols, ld=load: warm(i, c, ld))
        print(f"\n| down {fmt} M={m} {plan.kind} {plan.cfg.name()} | us |\n|---|---:|")
        for name, us in rows.items():
            print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
