"""Experiment: the stacked q/k/v GEMM of the FP8 decode step with per-tensor cuBLAS and the scales in the rotary.

    PYTHONPATH=. python3 bench/decode_qkv_epilogue.py [--m 512 256]

At a rollout batch of 512, cuBLAS FP8 with rowwise scales takes 23.0 us for the 7B q/k/v shape [4608 x 3584] and
14.4 us with per-tensor scales (bench/results/gemm.md): 4608 output columns make 144 tiles of 128 x 128 for 132
SMs, and the rowwise kernels choose worse than the per-tensor ones there. Here the GEMM runs with unit per-tensor
scales (y0 = codes_x @ codes_w^T, rounded to bf16), and one kernel then applies the per-token and per-channel
scales and the bias to every head and rotates q and k, writing q, k and v: the work the rotary kernel already
reads and writes, plus v.

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
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from quarl.kernels.decode_fused import _round_bf16  # noqa: E402

HIDDEN, HQ, HKV, D = 3584, 28, 4, 128


@triton.jit
def _scaled_rope_kernel(y_ptr, sx_ptr, sw_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, HQ, HK, stride_y,
                        stride_c, D: tl.constexpr, HEADS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program (row, group of HEADS heads) over the HQ query, HK key and HK value heads of one row of the unscaled
    product y: x = bf16(y * sx[row] * sw[col] + bias[col]); q and k heads are rotated as `_rope_kernel` does."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    d = tl.arange(0, D)[None, :]  # [1, D]
    half: tl.constexpr = D // 2
    ok = head < HQ + 2 * HK
    sx = tl.load(sx_ptr + row)
    col = head * D + d
    pcol = head * D + (d + half) % D

    x = tl.load(y_ptr + row * stride_y + col, mask=ok, other=0.0).to(tl.float32) * sx * \
        tl.load(sw_ptr + col, mask=ok, other=0.0)
    partner = tl.load(y_ptr + row * stride_y + pcol, mask=ok, other=0.0).to(tl.float32) * sx * \
        tl.load(sw_ptr + pcol, mask=ok, other=0.0)
    if HAS_BIAS:
        x = x + tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
        partner = partner + tl.load(b_ptr + pcol, mask=ok, other=0.0).to(tl.float32)
    x = _round_bf16(x)
    partner = _round_bf16(partner)
    rot = tl.where(d < half, -partner, partner)
    c = tl.load(cos_ptr + row * stride_c + d).to(tl.float32)
    s = tl.load(sin_ptr + row * stride_c + d).to(tl.float32)
    y = _round_bf16(_round_bf16(x * c) + _round_bf16(rot * s)).to(tl.bfloat16)
    tl.store(q_ptr + (row * HQ + head) * D + d, y, mask=head < HQ)
    tl.store(k_ptr + (row * HK + head - HQ) * D + d, y, mask=(head >= HQ) & (head < HQ + HK))
    tl.store(v_ptr + (row * HK + head - HQ - HK) * D + d, x.to(tl.bfloat16), mask=(head >= HQ + HK) & ok)


def scaled_rope(y0, sx, sw, bias, cos, sin, hq=HQ, hkv=HKV, d=D):
    """y0 [M, (hq + 2 hkv) d] bf16 unscaled product, sx [M, 1], sw [N] float32, bias [N] bf16 or None ->
    (q [M, hq, d], k [M, hkv, d], v [M, hkv, d]) bf16."""
    m = y0.shape[0]
    q = torch.empty(m, hq, d, dtype=torch.bfloat16, device=y0.device)
    k = torch.empty(m, hkv, d, dtype=torch.bfloat16, device=y0.device)
    v = torch.empty(m, hkv, d, dtype=torch.bfloat16, device=y0.device)
    heads = 8
    _scaled_rope_kernel[(m, triton.cdiv(hq + 2 * hkv, heads))](
        y0, sx, sw, bias if bias is not None else sw, cos, sin, q, k, v, hq, hkv, y0.stride(0), cos.stride(0),
        D=d, HEADS=heads, HAS_BIAS=bias is not None, num_warps=4)
    return q, k, v


def main() -> None:
    from quarl.bench.rollout_breakdown import _graph_ms
    from quarl.formats import quantize
    from quarl.kernels import fp8_matmul_from_codes
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
            y = fp8_matmul_from_codes(codes, sx, qw, bias, torch.bfloat16)
            q, k = rope_rows(y, cos, sin, HQ, HKV, D)
            return q, k, y[:, (HQ + HKV) * D:].view(m, HKV, D)

        def unscaled():
            return torch._scaled_mm(codes, qw.data.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        def epilogue():
            return scaled_rope(unscaled(), sx, sw, bias, cos, sin)

        want, got = rowwise(), epilogue()
        err = max(float(((a.float() - b.float()).abs() / (b.float().abs() * 2.0**-8 + 1e-6)).max())
                  for a, b in zip(got, want))
        t_row = 1e3 * _graph_ms(torch, lambda: fp8_matmul_from_codes(codes, sx, qw, bias, torch.bfloat16), 50)
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
            t_r = 1e3 * _graph_ms(torch, lambda: fp8_matmul_from_codes(xq.data, xq.scale, wq, None,
                                                                        torch.bfloat16), 50)
            t_u = 1e3 * _graph_ms(torch, lambda: torch._scaled_mm(xq.data, wq.data.t(), scale_a=one, scale_b=one,
                                                                   out_dtype=torch.bfloat16), 50)
            print(f"| {name} | {m} | {t_r:.1f} | {t_u:.1f} |")


if __name__ == "__main__":
    main()
