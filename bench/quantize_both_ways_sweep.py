"""Time the FP8 training operand quantizers on the GPU: both ways in one pass vs the two one-way passes.

    PYTHONPATH=. python3 bench/quantize_both_ways_sweep.py [--tokens 16384] [--cols 3584,4608] [--warps 8,16]

For x [tokens, cols] bf16: `act_quant.quantize_rows_and_columns` (rows in 1x128 groups + columns in 128-row
groups, one read of x) at each warp count, against `quantize_activation` + `quantize_columns_transposed` (two
reads), and an experimental variant here whose programs loop over several row tiles of one column strip with
Triton's software pipelining (`tl.range(..., num_stages=...)`), checked bit for bit against the production
pass. Microseconds per call (CUDA-graph replays, `quarl.bench.gemm.time_graph`) and the copy-bandwidth floor
(bytes read + written).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))


def _loop_kernel():
    import triton
    import triton.language as tl

    from quarl.kernels.quant_utils import quantize_tile, safe_scale

    @triton.jit
    def kernel(x_ptr, qr_ptr, sr_ptr, qt_ptr, st_ptr, M, C, stride_xm, stride_qr, stride_qt, TILES: tl.constexpr,
               STAGES: tl.constexpr):
        pid_c = tl.program_id(0)
        rc = pid_c * 128 + tl.arange(0, 128)
        c_ok = rc < C
        for t in tl.range(0, TILES, num_stages=STAGES):
            pid_m = tl.program_id(1) * TILES + t
            rm = pid_m.to(tl.int64) * 128 + tl.arange(0, 128)
            m_ok = rm < M
            v = tl.load(x_ptr + rm[:, None] * stride_xm + rc[None, :], mask=m_ok[:, None] & c_ok[None, :],
                        other=0.0).to(tl.float32)
            sr = safe_scale(tl.max(tl.abs(v), axis=1), 448.0)
            qr = quantize_tile(v, sr[:, None], False).to(tl.uint8, bitcast=True)
            tl.store(qr_ptr + rm[:, None] * stride_qr + rc[None, :], qr, mask=m_ok[:, None])
            tl.store(sr_ptr + pid_c * M + rm, sr, mask=m_ok)
            st = safe_scale(tl.max(tl.abs(v), axis=0), 448.0)
            qt = quantize_tile(v, st[None, :], False).to(tl.uint8, bitcast=True)
            tl.store(qt_ptr + rc[:, None].to(tl.int64) * stride_qt + rm[None, :], tl.trans(qt), mask=c_ok[:, None])
            tl.store(st_ptr + pid_m * C + rc, st, mask=c_ok)

    return kernel


def _loop_variant(torch, kernel, x, tiles: int, stages: int, warps: int):
    m, c = x.shape
    cp, mp = -(-c // 128) * 128, -(-m // 128) * 128
    assert (mp // 128) % tiles == 0
    rows = torch.empty((m, cp), dtype=torch.uint8, device=x.device)
    row_scales = torch.empty((cp // 128, m), dtype=torch.float32, device=x.device)
    cols = torch.empty((c, mp), dtype=torch.uint8, device=x.device)
    col_scales = torch.empty((mp // 128, c), dtype=torch.float32, device=x.device)
    kernel[(cp // 128, mp // 128 // tiles)](x, rows, row_scales, cols, col_scales, m, c, x.stride(0),
                                            rows.stride(0), cols.stride(0), TILES=tiles, STAGES=stages,
                                            num_warps=warps)
    return rows, row_scales.t(), cols, col_scales


def main(argv=None) -> int:
    import torch

    from quarl.bench.gemm import measure_ceilings, time_graph
    from quarl.kernels.act_quant import quantize_activation, quantize_columns_transposed, quantize_rows_and_columns

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--cols", default="3584,4608,1536")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--loops", default="4:2:4,4:3:4,8:3:4,8:3:8",
                        help="experimental looped variants TILES:STAGES:WARPS, comma-separated")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    bw, _ = measure_ceilings(torch)
    print(f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; M = {args.tokens}")
    print("| C | variant | us | floor us | % floor |\n|---:|---|---:|---:|---:|")
    for c in (int(v) for v in args.cols.split(",")):
        xs = [torch.randn(args.tokens, c, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        floor = 1e6 * (2 + 1 + 1) * args.tokens * c / bw  # read bf16, write two code copies
        kp = -(-c // 128) * 128
        variants = {f"both ways, {w} warps": (lambda i, w=w: quantize_rows_and_columns(xs[i], num_warps=w))
                    for w in (int(v) for v in args.warps.split(","))}
        variants["rows + columns, two passes"] = lambda i: (
            quantize_activation(xs[i], "fp8-block", kp, scales_column_major=True), quantize_columns_transposed(xs[i]))
        kernel = _loop_kernel()
        ref = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in quantize_rows_and_columns(xs[0])]
        for spec in (v for v in args.loops.split(",") if v):
            tiles, stages, warps = (int(v) for v in spec.split(":"))
            got = _loop_variant(torch, kernel, xs[0], tiles, stages, warps)
            same = all(torch.equal(a, b) for a, b in zip(got, ref))
            variants[f"looped {tiles} tiles, {stages} stages, {warps} warps{'' if same else ' (WRONG)'}"] = (
                lambda i, t=tiles, s=stages, w=warps: _loop_variant(torch, kernel, xs[i], t, s, w))
        for name, fn in variants.items():
            t = 1e6 * time_graph(torch, fn, len(xs), 5)
            print(f"| {c} | {name} | {t:.1f} | {floor:.1f} | {100 * floor / t:.0f}% |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
