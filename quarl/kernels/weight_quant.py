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
def _block_quant_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, N, K, stride_wn, stride_q, stride_s, stride_qt,
                        stride_st, KP, NP, WRITE_W: tl.constexpr, WRITE_WT: tl.constexpr):
    """Tile (pid 0 along N, pid 1 along K) of w [N, K] (bf16/fp16/fp32) -> codes (uint8 bytes of e4m3) and one
    float32 scale, written for W (q [N, KP], s [Nt, Kt]) and/or for W^T (qt [K, NP], st [Kt, Nt]). Padding
    columns get zero codes (their values load as 0)."""
    tn = tl.program_id(0)
    tk = tl.program_id(1)
    rn = tn.to(tl.int64) * 128 + tl.arange(0, 128)
    rk = tk.to(tl.int64) * 128 + tl.arange(0, 128)
    v = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                other=0.0).to(tl.float32)
    s = safe_scale(tl.max(tl.max(tl.abs(v), axis=1), axis=0), 448.0)
    q = quantize_tile(v, s, False).to(tl.uint8, bitcast=True)  # [128 (n), 128 (k)]
    if WRITE_W:
        tl.store(q_ptr + rn[:, None] * stride_q + rk[None, :], q, mask=(rn[:, None] < N) & (rk[None, :] < KP))
        tl.store(s_ptr + tn * stride_s + tk, s)
    if WRITE_WT:
        tl.store(qt_ptr + rk[:, None] * stride_qt + rn[None, :], tl.trans(q),
                 mask=(rk[:, None] < K) & (rn[None, :] < NP))
        tl.store(st_ptr + tk * stride_st + tn, s)


def quantize_fp8_block_weight(w: torch.Tensor, transpose: bool = False) -> QuantizedTensor:
    """w [N, K] bf16/fp16/fp32 (rows contiguous) -> the fp8-block weight QuantizedTensor of w, or of w^T [K, N]
    when transpose=True: codes float8_e4m3fn [rows, ceil(cols/128)*128], scales float32 [ceil(rows/128),
    ceil(cols/128)] (rows, cols = N, K, or K, N transposed)."""
    pair = _quantize(w, write_w=not transpose, write_wt=transpose)
    return pair[1] if transpose else pair[0]


def quantize_fp8_block_weight_pair(w: torch.Tensor) -> tuple[QuantizedTensor, QuantizedTensor]:
    """(Q(w), Q(w^T)) as `quantize_fp8_block_weight` returns them, from one pass over a bf16/fp16 w (FP8 training
    needs both: W for the forward, W^T for the input gradient). A float32 w takes two passes: with Triton 3.6 the
    one-pass kernel wrote wrong W^T codes for float32 input (tests/test_kernels_gpu.py)."""
    if w.dtype == torch.float32:
        return _quantize(w, write_w=True, write_wt=False)[0], _quantize(w, write_w=False, write_wt=True)[1]
    return _quantize(w, write_w=True, write_wt=True)


def _quantize(w: torch.Tensor, write_w: bool, write_wt: bool) -> tuple[QuantizedTensor | None, QuantizedTensor | None]:
    n, k = w.shape
    nt, kt = -(-n // TILE), -(-k // TILE)
    dev = w.device
    q = torch.empty((n, kt * TILE) if write_w else (0, 0), dtype=torch.uint8, device=dev)
    s = torch.empty((nt, kt) if write_w else (0, 0), dtype=torch.float32, device=dev)
    qt = torch.empty((k, nt * TILE) if write_wt else (0, 0), dtype=torch.uint8, device=dev)
    st = torch.empty((kt, nt) if write_wt else (0, 0), dtype=torch.float32, device=dev)
    if n and k:
        _block_quant_kernel[(nt, kt)](w, q, s, qt, st, n, k, w.stride(0), q.stride(0), s.stride(0), qt.stride(0),
                                      st.stride(0), kt * TILE, nt * TILE, WRITE_W=write_w, WRITE_WT=write_wt,
                                      num_warps=8)
    fp8 = torch.float8_e4m3fn
    return (QuantizedTensor("fp8-block", "weight", q.view(fp8), s, None, torch.Size((n, k))) if write_w else None,
            QuantizedTensor("fp8-block", "weight", qt.view(fp8), st, None, torch.Size((k, n))) if write_wt else None)
