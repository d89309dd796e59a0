"""FP8-block weight quantization in one pass: W [N, K] -> codes and 128x128 tile scales, or those of W^T.

Bit for bit `quarl.formats.quantize(w, "fp8-block", "weight")` (scale = tile amax * float32(1/448), 1 for an
all-zero tile; code = e4m3(clamp(w / scale, +-448)), round to nearest even). The reference runs a dozen
elementwise PyTorch kernels with float32 temporaries of the whole weight; here one program per 128x128 tile reads
its tile once.

`transpose=True` quantizes W^T [K, N] as a weight instead, from W itself: a tile of W^T is the transpose of a tile
of W (the same values, the same amax; partial edge tiles hold the same elements), so its codes are the transposed
codes and its scales the transposed scales. The FP8 training backward needs W^T in 128x128 tiles for the
input-gradient GEMM dx = g @ W (`quarl.model.fp8_training`); this reads W once and writes no bf16 transpose.

Imports Triton: load it only when `quarl.kernels.kernels_available()` says the kernels can run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.formats import QuantizedTensor
from quarl.kernels.quant_utils import quantize_tile, safe_scale

TILE = 128


@triton.jit
def _block_quant_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_qr, stride_sr, ROWS_OUT, COLS_OUT,
                        TRANSPOSE: tl.constexpr):
    """Tile (pid 0 along N, pid 1 along K) of w [N, K] (bf16/fp16/fp32) -> codes (uint8 bytes of e4m3) and one
    float32 scale. Not transposed: q [N, COLS_OUT = Kp] and s [Nt, Kt]; transposed: q [K, COLS_OUT = Np] and
    s [Kt, Nt]. Padding columns of q get zero codes (their values load as 0)."""
    tn = tl.program_id(0)
    tk = tl.program_id(1)
    rn = tn.to(tl.int64) * 128 + tl.arange(0, 128)
    rk = tk.to(tl.int64) * 128 + tl.arange(0, 128)
    v = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                other=0.0).to(tl.float32)
    s = safe_scale(tl.max(tl.max(tl.abs(v), axis=1), axis=0), 448.0)
    q = quantize_tile(v, s, False).to(tl.uint8, bitcast=True)  # [128 (n), 128 (k)]
    if TRANSPOSE:
        tl.store(q_ptr + rk[:, None] * stride_qr + rn[None, :], tl.trans(q),
                 mask=(rk[:, None] < ROWS_OUT) & (rn[None, :] < COLS_OUT))
        tl.store(s_ptr + tk * stride_sr + tn, s)
    else:
        tl.store(q_ptr + rn[:, None] * stride_qr + rk[None, :], q,
                 mask=(rn[:, None] < ROWS_OUT) & (rk[None, :] < COLS_OUT))
        tl.store(s_ptr + tn * stride_sr + tk, s)


def quantize_fp8_block_weight(w: torch.Tensor, transpose: bool = False,
                              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> QuantizedTensor:
    """w [N, K] bf16/fp16/fp32 (rows contiguous) -> the fp8-block weight QuantizedTensor of w, or of w^T [K, N]
    when transpose=True: codes float8_e4m3fn [rows, ceil(cols/128)*128], scales float32 [ceil(rows/128),
    ceil(cols/128)] (rows, cols = N, K, or K, N transposed). out: (codes, scales) of those shapes to write instead
    of new tensors (codes float8_e4m3fn or uint8 bytes, rows contiguous; scales with unit column stride)."""
    n, k = w.shape
    nt, kt = -(-n // TILE), -(-k // TILE)
    rows, cols, st = (k, nt * TILE, (kt, nt)) if transpose else (n, kt * TILE, (nt, kt))
    if out is None:
        codes = torch.empty((rows, cols), dtype=torch.uint8, device=w.device)
        scales = torch.empty(st, dtype=torch.float32, device=w.device)
    else:
        codes, scales = out
        if codes.dtype not in (torch.float8_e4m3fn, torch.uint8) or codes.shape != (rows, cols) or \
                codes.stride(1) != 1 or scales.dtype != torch.float32 or scales.shape != st or \
                scales.stride(1) != 1 or codes.device != w.device or scales.device != w.device:
            raise ValueError(f"fp8-block out must be codes [{rows}, {cols}] (float8_e4m3fn, rows contiguous) and "
                             f"float32 scales {st} on {w.device}, got {tuple(codes.shape)} {codes.dtype} and "
                             f"{tuple(scales.shape)} {scales.dtype}")
        codes = codes.view(torch.uint8)
    if n and k:
        _block_quant_kernel[(nt, kt)](w, codes, scales, n, k, w.stride(0), codes.stride(0), scales.stride(0),
                                      rows, cols, TRANSPOSE=transpose, num_warps=8)
    shape = torch.Size((k, n) if transpose else (n, k))
    return QuantizedTensor("fp8-block", "weight", codes.view(torch.float8_e4m3fn), scales, None, shape)
