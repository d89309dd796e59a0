"""Experiment: the stacked q/k/v GEMM of the FP8 decode step with per-tensor cuBLAS and the scales in the rotary.

    PYTHONPATH=. python3 bench/decode_qkv_epilogue.py [--m 512 256]

At a rollout batch of 512, cuBLAS FP8 with rowwise scales takes 23.0 us for the 7B q/k/v shape [4608 x 3584] and
14.4 us with per-tensor scales (bench/results/gemm.md): 4608 output columns make 144 tiles of 128 x 128 for 132
SMs, and the rowwise kernels choose worse than the per-tensor ones there. Here the GEMM runs with unit per-tensor
scales (y0 = codes_x @ codes_w^T, rounded to bf16), and one kernel then applies the per-token and per-channel
scales and the bias to every head and rotates q and k, writing q, k and v: the work the rotary kernel already
reads and writes, plus v (`quarl.kernels.decode_fused.rope_rows_scaled`).

Both ways are timed as CUDA-graph replays (GEMM + rotary) and compared: q, k and v of the epilogue way must lie
within two bf16 roundings of the rowwise way's (the unscaled product is rounded once before the scales). A second
table times the layer's other FP8 GEMMs (o, gate/up, down) both ways: their consumers (SiLU·mul, the residual add
+ norm) could apply the scales likewise. Nothing in quarl uses this path yet.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from quarl.kernels.decode_fused import rope_rows_scaled  # noqa: E402

HIDDEN, HQ, HKV, D = 3584, 28, 4, 128


def scaled_rope(y0, sx, sw, bias, cos, sin):
    return rope_rows_scaled(y0, sx, sw, bias, cos, sin, HQ, HKV, D)


def main() -> None:
    from quarl.bench.rollout_breakdown import _graph_ms
    from quarl.formats import quantize
    from quarl.kernels import matmul_from_codes
    from quarl.kernels.decode_fused import rms_norm_rows, rope_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[512, 256])
    args = ap.parse_args()
    n = (HQ + 2 * HKV) * D
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, HIDDEN, device="cuda", generator=g).bfloat16() * 0.02
    qw = quantize(w, "fp8", "weight")
    sw = qw.scale.reshape(-1).float().contiguous()
    bias = (torch.randn(n, device="cuda", generator=g) * 0.1).bfloat16()
    one = torch.ones((), device="cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| M | way | GEMM us | GEMM + rotary us | max err / bf16 step |")
    print("|---:|---|---:|---:|---:|")
    for m in args.m:
        x = torch.randn(m, HIDDEN, device="cuda", generator=g).bfloat16()
        _, _, codes, sx = rms_norm_rows(x, None, torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16), None,
                                        1e-6, "fp8", write_h=False)
        angles = torch.rand(m, D // 2, device="cuda", generator=g) * 100
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()

        def rowwise():
            y = matmul_from_codes(codes, sx, qw, bias, torch.bfloat16)
            q, k = rope_rows(y, cos, sin, HQ, HKV, D)
            return q, k, y[:, (HQ + HKV) * D:].view(m, HKV, D)

        def unscaled():
            return torch._scaled_mm(codes, qw.data.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        def epilogue():
            return scaled_rope(unscaled(), sx, sw, bias, cos, sin)

        want, got = rowwise(), epilogue()
        err = max(float(((a.float() - b.float()).abs() / (b.float().abs() * 2.0**-8 + 1e-6)).max())
                  for a, b in zip(got, want))
        t_row = 1e3 * _graph_ms(torch, lambda: matmul_from_codes(codes, sx, qw, bias, torch.bfloat16), 50)
        t_row_all = 1e3 * _graph_ms(torch, rowwise, 50)
        t_ten = 1e3 * _graph_ms(torch, unscaled, 50)
        t_ten_all = 1e3 * _graph_ms(torch, epilogue, 50)
        print(f"| {m} | rowwise scales + bias in cuBLAS, rotary | {t_row:.1f} | {t_row_all:.1f} | - |")
        print(f"| {m} | unit per-tensor cuBLAS, scales + bias + rotary in one kernel | {t_ten:.1f} | "
              f"{t_ten_all:.1f} | {err:.1f} |")
    # The other FP8 GEMMs of a layer, whose consumers (SiLU·mul, the residual add + norm) could apply the scales
    # the same way: cuBLAS rowwise against unit per-tensor scales.
    print("\n| shape | M | rowwise us | unit per-tensor us |")
    print("|---|---:|---:|---:|")
    for name, (n_out, k_in) in {"o": (HIDDEN, HIDDEN), "gate_up": (2 * 18944, HIDDEN),
                                "down": (HIDDEN, 18944)}.items():
        wq = quantize(torch.randn(n_out, k_in, device="cuda", generator=g).bfloat16() * 0.02, "fp8", "weight")
        for m in args.m:
            xq = quantize(torch.randn(m, k_in, device="cuda", generator=g).bfloat16(), "fp8", "activation")
            t_r = 1e3 * _graph_ms(torch, lambda: matmul_from_codes(xq.data, xq.scale, wq, None,
                                                                        torch.bfloat16), 50)
            t_u = 1e3 * _graph_ms(torch, lambda: torch._scaled_mm(xq.data, wq.data.t(), scale_a=one, scale_b=one,
                                                                   out_dtype=torch.bfloat16), 50)
            print(f"| {name} | {m} | {t_r:.1f} | {t_u:.1f} |")


if __name__ == "__main__":
    main()
