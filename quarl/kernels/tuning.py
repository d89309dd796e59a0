"""Which kernel and tile configuration each GEMM uses, by format family, weight shape and number of rows M.

Plain data (no Triton import), so the choice can be inspected and tested on any machine.

A `Plan` names the path:
  "fp4"        fused W4A16 Triton GEMM (`quarl.kernels.fp4_gemm`);
  "deq_mm"     fp4 weight dequantized to bf16/fp16 by a Triton kernel, then the library GEMM;
  "w8a8"       8-bit Triton GEMM (`quarl.kernels.w8a8_gemm`), activation quantized in the GEMM (x_mode
               "fused"), beforehand by `quarl.kernels.act_quant` ("prequant"), or not at all ("raw", W8A16);
  "scaled_mm"  activation quantized by `act_quant`, then torch._scaled_mm (cuBLAS FP8: rowwise, per-tensor or
               blockwise scales);
  "gemv"       one-launch FMA kernels (`quarl.kernels.gemv`: fp4 M <= 4 rows, 8-bit M = 1; cfg.bn/bk/warps/stages,
               bm unused);
  "fp4_decode" M <= 64 rows, nvfp4/mxfp4 weights (`quarl.kernels.fp4_decode`): cfg.bm = 1 selects the CUDA-core
               FMA path (M <= 8), cfg.bm = 16 the tensor-core swap-AB path (wgmma with the decoded weight as
               the register operand, M padded to 16/32/64); cfg.bn/bk (bk: elements; 128 or 256 for bm = 16),
               split_k (one launch: the last program of a tile sums the fp32 partials), warps, stages, native
               (x permuted beforehand, see Cfg); group_m, swap_ab and tma unused (`check_fp4_decode_cfg` says
               what is allowed);
  "bf16"       `try_quantized_matmul` returns None: the caller's bf16 path is faster (see the policy below).
Families: "w4a16" (nvfp4, mxfp4), "int8", "fp8" (rowwise), "fp8-tensor", "fp8-block" (W8A8), and "w8a16"
(8-bit formats with weight_only=True).

`MEASURED` holds, per family, weight shape (N, K) of Qwen2.5-7B and M bucket, the fastest quantized path and its
speed-up over the bf16 GEMM (F.linear), chosen by `quarl bench gemm --sweep` on an H200 (activation
quantization included; bench/results/gemm.md). Policy (`choose_plan`): the plan is "bf16" (no kernel)
where the kernel is not MIN_SPEEDUP (1.05) times as fast as the path a layer runs without it, unless the caller
asks for the kernel anyway (prefer_kernel=True: a layer that holds only the quantized weight has no bf16 path).
Without a kernel, a layer with quantized activations still computes the quantized values: it fake-quantizes the
activations (one more pass over them) and runs the bf16 GEMM on the dequantized weight. `FALLBACK_COST` holds
that path's time over the bare bf16 GEMM's, per family, shape and M bucket as `MEASURED` (`quarl bench gemm`, its
"W8A8 fallback" table); weight-only formats have no extra pass (cost 1). Other shapes use the
measured shape with the closest weight size N*K; M is rounded up to the next bucket. fp8-tensor follows the fp8
table (activation quantized beforehand: a per-tensor scale needs the whole tensor), w8a16 has hand-set plans (not
swept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

M_BUCKETS = (1, 16, 64, 256, 512, 1024, 4096)


@dataclass(frozen=True)
class Cfg:
    """Tile shape and launch parameters of one GEMM launch (Triton-free; the kernels use it as GemmConfig).

    bm/bn/bk: tile rows (tokens), columns (output features), reduction depth; split_k: programs sharing one
    output tile along K (fp32 partials summed by `splitk_reduce`); warps/stages: Triton's num_warps /
    num_stages (software pipelining depth); group_m: output tiles of one column band visited together (L2 reuse
    of the weight in prefill). native: W8A8: multiply the int8/fp8 codes on the int8/fp8 tensor cores (needs
    bm >= 64, or bn >= 64 with swap_ab); otherwise the codes are converted exactly to fp16 and multiplied there.
    fp4_decode's tensor-core path (bm = 16): x is permuted into the kernel's K order by one copy before the
    launch and streams into the MMA's shared-memory operand as it is (K a multiple of 128; measured faster at 64
    rows, slower at 16). swap_ab: W8A8 only, the product runs transposed (weight tile [bn, bk] as the MMA's
    first operand, the few token rows as its narrow second one), so decode's 16-64 rows need not fill a 64-row
    MMA side.
    tma: W8A8 on prequantized rowwise / per-tensor codes, native, operands arriving by TMA (Hopper or newer;
    elsewhere the regular kernel runs the same tile): in prefill the persistent kernel (no split-K); with swap_ab
    the decode kernel (M <= bm, bn >= 64, split-K allowed).
    """

    bm: int
    bn: int
    bk: int
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    group_m: int = 8
    native: bool = False
    swap_ab: bool = False
    tma: bool = False

    def name(self) -> str:
        tag = ("n" if self.native else "") + ("t" if self.swap_ab else "") + ("m" if self.tma else "")
        return f"{self.bm}x{self.bn}x{self.bk}s{self.split_k}w{self.warps}p{self.stages}{tag}"


@dataclass(frozen=True)
class Plan:
    kind: str  # "fp4" | "deq_mm" | "w8a8" | "scaled_mm" | "gemv" | "fp4_decode" | "bf16"
    cfg: Cfg | None = None
    x_mode: str = "fused"  # w8a8 / gemv only: "raw" | "fused" | "prequant"


FP4_DECODE_MAX_M = 64
FP4_DECODE_FMA_MAX_M = 8


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def check_fp4_decode_cfg(cfg: Cfg) -> None:
    """Raise ValueError when `cfg` cannot drive `quarl.kernels.fp4_decode` (Triton-free, so it runs anywhere).

    bm = 1 (CUDA-core FMA path): bn a power of two <= 512; bk a power of two in [64, 4096] (whole int32 code
    words, 8 per thread row at least); warps a power of two <= 16.
    bm = 16 (tensor-core path): warps 4 or 8 (one or two wgmma warp groups); bn 64, 128 or 256 and >= 16 * warps
    (each warp owns 16 weight rows of the wgmma); bk 128 or 256 (one or two 128-element steps per stage).
    Both: split_k in [1, 64], stages >= 1.
    """
    if not isinstance(cfg, Cfg):
        raise ValueError(f"fp4_decode needs a quarl.kernels.tuning.Cfg, got {type(cfg).__name__}")
    if cfg.bm not in (1, 16):
        raise ValueError(
            f"fp4_decode cfg.bm={cfg.bm} selects no path; use bm=1 (CUDA-core FMA, M <= {FP4_DECODE_FMA_MAX_M}) "
            f"or bm=16 (tensor cores, M <= {FP4_DECODE_MAX_M})"
        )
    if cfg.bm == 1:
        if not _pow2(cfg.bn) or cfg.bn > 512:
            raise ValueError(f"fp4_decode cfg.bn={cfg.bn} must be a power of two <= 512 for bm=1")
        if not _pow2(cfg.bk) or cfg.bk < 64 or cfg.bk > 4096:
            raise ValueError(f"fp4_decode cfg.bk={cfg.bk} must be a power of two in [64, 4096] for bm=1 "
                             "(K steps of whole 8-element code words)")
        if not _pow2(cfg.warps) or cfg.warps > 16:
            raise ValueError(f"fp4_decode cfg.warps={cfg.warps} must be a power of two <= 16 for bm=1")
    else:
        if cfg.warps not in (4, 8):
            raise ValueError(f"fp4_decode cfg.warps={cfg.warps} must be 4 or 8 for bm=16 (wgmma warp groups)")
        if cfg.bn not in (64, 128, 256) or cfg.bn < 16 * cfg.warps:
            raise ValueError(f"fp4_decode cfg.bn={cfg.bn} must be 64, 128 or 256 and >= 16 * warps "
                             f"({16 * cfg.warps}) for bm=16")
        if cfg.bk not in (128, 256):
            raise ValueError(f"fp4_decode cfg.bk={cfg.bk} must be 128 or 256 for bm=16 (128-element MMA steps)")
    if cfg.split_k < 1 or cfg.split_k > 64:
        raise ValueError(f"fp4_decode cfg.split_k={cfg.split_k} must be in [1, 64]")
    if cfg.stages < 1:
        raise ValueError(f"fp4_decode cfg.stages={cfg.stages} must be >= 1")


def m_bucket(m: int) -> int:
    """The smallest tuned bucket >= m (the largest bucket for bigger m)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


C, P = Cfg, Plan

# family -> (N, K) -> M bucket -> (fastest quantized plan, its measured speed-up over bf16).
MEASURED = {
    "w4a16": {
        (4608, 3584): {  # qkv
            1: (P("fp4_decode", C(16, 64, 128, split_k=7)), 1.25),
            16: (P("fp4_decode", C(16, 64, 128, split_k=8)), 1.17),
            64: (P("fp4_decode", C(16, 64, 128, split_k=4)), 0.59),
            256: (P("deq_mm"), 0.55),
            512: (P("deq_mm"), 0.68),
            1024: (P("deq_mm"), 0.81),
            4096: (P("deq_mm"), 0.94),
        },
        (3584, 3584): {  # o
            1: (P("fp4_decode", C(1, 4, 1024, warps=2)), 1.50),
            16: (P("fp4_decode", C(16, 64, 128, split_k=7)), 1.33),
            64: (P("fp4_decode", C(16, 64, 128, split_k=4)), 0.68),
            256: (P("deq_mm"), 0.57),
            512: (P("deq_mm"), 0.67),
            1024: (P("deq_mm"), 0.79),
            4096: (P("deq_mm"), 0.90),
        },
        (37888, 3584): {  # gate_up
            1: (P("fp4_decode", C(16, 64, 128, stages=4)), 2.02),
            16: (P("fp4_decode", C(16, 64, 128)), 2.03),
            64: (P("fp4_decode", C(16, 64, 128, native=True)), 1.23),
            256: (P("deq_mm"), 0.50),
            512: (P("deq_mm"), 0.66),
            1024: (P("deq_mm"), 0.74),
            4096: (P("deq_mm"), 0.94),
        },
        (3584, 18944): {  # down
            1: (P("fp4_decode", C(16, 64, 128, split_k=7, stages=4)), 1.71),
            16: (P("fp4_decode", C(16, 64, 128, split_k=7, stages=4)), 1.75),
            64: (P("fp4_decode", C(16, 128, 128, split_k=4, warps=8, native=True)), 1.03),
            256: (P("deq_mm"), 0.53),
            512: (P("deq_mm"), 0.68),
            1024: (P("deq_mm"), 0.78),
            4096: (P("deq_mm"), 0.90),
        },
    },
    "int8": {
        (4608, 3584): {  # qkv
            # mean of the sweep and a B1 run: within noise of bf16
            1: (P("w8a8", C(16, 64, 128, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.03),
            # mean of the sweep and a B1 run: within noise of bf16
            16: (P("w8a8", C(16, 64, 128, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.02),
            64: (P("w8a8", C(64, 64, 256, stages=6, native=True, swap_ab=True, tma=True), "prequant"), 1.11),
            256: (P("w8a8", C(64, 128, 128, stages=4, native=True), "prequant"), 0.79),
            512: (P("w8a8", C(128, 128, 128, warps=8, native=True), "prequant"), 0.93),
            1024: (P("w8a8", C(128, 128, 128, stages=4, native=True, tma=True), "prequant"), 0.86),
            4096: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.22),
        },
        (3584, 3584): {  # o
            1: (P("w8a8", C(16, 64, 256, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.13),
            16: (P("w8a8", C(16, 64, 256, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.24),
            64: (P("w8a8", C(64, 64, 256, stages=6, native=True, swap_ab=True, tma=True), "prequant"), 0.96),
            256: (P("w8a8", C(64, 128, 128, stages=4, native=True, tma=True), "prequant"), 0.81),
            512: (P("w8a8", C(64, 128, 128, stages=4, native=True), "prequant"), 0.95),
            # mean of four B1 runs: within run-to-run noise of bf16
            1024: (P("w8a8", C(256, 128, 128, warps=8, native=True, tma=True), "prequant"), 1.03),
            4096: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.22),
        },
        (37888, 3584): {  # gate_up
            1: (P("w8a8", C(16, 64, 128, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.92),
            16: (P("w8a8", C(16, 64, 128, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.93),
            64: (P("w8a8", C(64, 64, 128, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.79),
            256: (P("w8a8", C(128, 128, 128, warps=8, native=True), "prequant"), 1.24),
            512: (P("w8a8", C(128, 128, 128, warps=8, native=True), "prequant"), 1.47),
            1024: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.53),
            4096: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.57),
        },
        (3584, 18944): {  # down
            1: (P("w8a8", C(16, 64, 256, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.54),
            16: (P("w8a8", C(16, 64, 256, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.51),
            64: (P("w8a8", C(64, 64, 256, split_k=2, stages=6, native=True, swap_ab=True, tma=True), "prequant"), 1.50),
            256: (P("w8a8", C(64, 128, 128, split_k=2, stages=4, native=True), "prequant"), 1.08),
            512: (P("w8a8", C(128, 128, 128, stages=4, native=True, tma=True), "prequant"), 1.06),
            1024: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.22),
            4096: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.29),
        },
    },
    "fp8": {
        (4608, 3584): {  # qkv
            1: (P("gemv", C(1, 4, 512)), 1.19),
            # mean of the sweep and a B1 run: within noise of bf16
            16: (P("w8a8", C(16, 64, 256, split_k=2, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.04),
            64: (P("w8a8", C(64, 64, 256, stages=6, native=True, swap_ab=True, tma=True), "prequant"), 1.18),
            256: (P("scaled_mm"), 0.94),
            512: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 0.94),
            1024: (P("w8a8", C(128, 128, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.07),
            4096: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.43),
        },
        (3584, 3584): {  # o
            1: (P("gemv", C(1, 8, 1024)), 1.42),
            16: (P("w8a8", C(16, 64, 128, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.25),
            # mean of the sweep and a B1 run: within noise of bf16
            64: (P("w8a8", C(64, 64, 256, stages=6, native=True, swap_ab=True, tma=True), "prequant"), 1.04),
            256: (P("w8a8", C(64, 128, 128, stages=4, native=True, tma=True), "prequant"), 0.87),
            512: (P("scaled_mm"), 1.14),
            1024: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.22),
            4096: (P("scaled_mm"), 1.48),
        },
        (37888, 3584): {  # gate_up
            1: (P("w8a8", C(16, 64, 128, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.93),
            16: (P("w8a8", C(16, 64, 128, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.93),
            64: (P("w8a8", C(64, 64, 128, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.82),
            256: (P("scaled_mm"), 1.48),
            512: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.67),
            1024: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.77),
            4096: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.82),
        },
        (3584, 18944): {  # down
            1: (P("w8a8", C(16, 64, 256, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.59),
            16: (P("w8a8", C(16, 64, 256, split_k=4, stages=4, native=True, swap_ab=True, tma=True), "prequant"), 1.55),
            64: (P("w8a8", C(64, 64, 256, split_k=2, stages=6, native=True, swap_ab=True, tma=True), "prequant"), 1.55),
            256: (P("scaled_mm"), 0.98),
            512: (P("scaled_mm"), 1.38),
            1024: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.49),
            4096: (P("w8a8", C(128, 256, 128, warps=8, stages=4, native=True, tma=True), "prequant"), 1.56),
        },
    },
    "fp8-block": {
        (4608, 3584): {  # qkv
            1: (P("gemv", C(1, 8, 512)), 1.04),
            16: (P("w8a8", C(16, 128, 128, split_k=4, stages=4, native=True, swap_ab=True), "prequant"), 0.87),
            64: (P("scaled_mm"), 0.74),
            256: (P("scaled_mm"), 0.91),
            512: (P("scaled_mm"), 0.85),
            1024: (P("scaled_mm"), 1.00),
            4096: (P("scaled_mm"), 1.38),
        },
        (3584, 3584): {  # o
            1: (P("gemv", C(1, 16, 512, warps=8)), 1.26),
            16: (P("w8a8", C(16, 128, 128, split_k=4, stages=4, native=True, swap_ab=True), "prequant"), 1.10),
            64: (P("w8a8", C(64, 32, 128, split_k=4, stages=4, native=True), "prequant"), 0.69),
            256: (P("scaled_mm"), 0.79),
            512: (P("scaled_mm"), 1.11),
            1024: (P("scaled_mm"), 1.15),
            4096: (P("scaled_mm"), 1.40),
        },
        (37888, 3584): {  # gate_up
            1: (P("gemv", C(1, 16, 256), "prequant"), 1.63),
            16: (P("w8a8", C(16, 128, 128, split_k=4, stages=4, native=True, swap_ab=True), "prequant"), 1.53),
            64: (P("scaled_mm"), 1.45),
            256: (P("scaled_mm"), 1.48),
            512: (P("scaled_mm"), 1.58),
            1024: (P("scaled_mm"), 1.56),
            4096: (P("scaled_mm"), 1.60),
        },
        (3584, 18944): {  # down
            1: (P("gemv", C(1, 8, 1024), "prequant"), 1.46),
            16: (P("scaled_mm"), 1.28),
            64: (P("w8a8", C(64, 32, 128, split_k=4, stages=4, native=True), "prequant"), 1.01),
            256: (P("scaled_mm"), 0.91),
            512: (P("scaled_mm"), 1.35),
            1024: (P("scaled_mm"), 1.31),
            4096: (P("scaled_mm"), 1.50),
        },
    },
}

# A quantized plan runs only where it measured at least this much faster than bf16: the same kernel's speed-up
# differs by a few percent between two GPUs of one model and between runs (bench/results/gemm.md), and a near-tie
# is not worth the rounding of a quantized GEMM.
MIN_SPEEDUP = 1.05

# family -> (N, K) -> M bucket -> time of the W8A8 fallback (fake-quantized activations, then the bf16 GEMM on the
# dequantized weight) over the bf16 GEMM's, from `quarl bench gemm --m 1,16,64,256,512,1024,4096` (its "W8A8
# fallback" table, on an H200; bench/results/gemm.md), at least 1 (below is noise: the extra pass
# costs time). fp8-tensor uses the fp8 rows.
FALLBACK_COST = {
    "int8": {
        (4608, 3584): {1: 1.17, 16: 1.22, 64: 1.24, 256: 1.21, 512: 1.16, 1024: 1.13, 4096: 1.12},  # qkv
        (3584, 3584): {1: 1.25, 16: 1.16, 64: 1.23, 256: 1.23, 512: 1.18, 1024: 1.20, 4096: 1.13},  # o
        (37888, 3584): {1: 1.03, 16: 1.02, 64: 1.04, 256: 1.03, 512: 1.02, 1024: 1.02, 4096: 1.01},  # gate_up
        (3584, 18944): {1: 1.07, 16: 1.10, 64: 1.17, 256: 1.23, 512: 1.20, 1024: 1.15, 4096: 1.13},  # down
    },
    "fp8": {
        (4608, 3584): {1: 1.24, 16: 1.22, 64: 1.23, 256: 1.21, 512: 1.17, 1024: 1.13, 4096: 1.20},  # qkv
        (3584, 3584): {1: 1.24, 16: 1.17, 64: 1.23, 256: 1.22, 512: 1.21, 1024: 1.19, 4096: 1.21},  # o
        (37888, 3584): {1: 1.02, 16: 1.02, 64: 1.04, 256: 1.03, 512: 1.00, 1024: 1.02, 4096: 1.00},  # gate_up
        (3584, 18944): {1: 1.13, 16: 1.14, 64: 1.20, 256: 1.21, 512: 1.22, 1024: 1.27, 4096: 1.22},  # down
    },
    "fp8-block": {
        (4608, 3584): {1: 1.21, 16: 1.20, 64: 1.20, 256: 1.19, 512: 1.16, 1024: 1.13, 4096: 1.18},  # qkv
        (3584, 3584): {1: 1.21, 16: 1.13, 64: 1.21, 256: 1.22, 512: 1.21, 1024: 1.20, 4096: 1.22},  # o
        (37888, 3584): {1: 1.01, 16: 1.02, 64: 1.03, 256: 1.03, 512: 1.00, 1024: 1.02, 4096: 1.00},  # gate_up
        (3584, 18944): {1: 1.05, 16: 1.06, 64: 1.10, 256: 1.14, 512: 1.12, 1024: 1.12, 4096: 1.19},  # down
    },
}

# Weight-only 8-bit (W8A16): not part of B1, set by hand from the W8A8 results (same weight streams).
W8A16_PLANS = {
    1: P("gemv", C(1, 8, 512), "raw"),
    16: P("w8a8", C(16, 64, 256, split_k=4, stages=4), "raw"),
    64: P("w8a8", C(64, 64, 128, split_k=2), "raw"),
    256: P("w8a8", C(64, 128, 128), "raw"),
    512: P("bf16"),
    1024: P("bf16"),
    4096: P("bf16"),
}


def family(fmt: str, weight_only: bool) -> str | None:
    """The plan family of a format + mode, or None where no kernel exists (fp4 activations: W4A4)."""
    if fmt in ("nvfp4", "mxfp4"):
        return "w4a16" if weight_only else None
    if fmt in ("int8", "fp8", "fp8-tensor", "fp8-block"):
        return "w8a16" if weight_only else fmt
    return None


def _nearest_shape(table: dict, n: int, k: int) -> tuple[int, int]:
    """The key (N, K) of a per-shape table: (n, k) itself, else the measured shape nearest in weight size N*K."""
    if (n, k) in table:
        return (n, k)
    return min(table, key=lambda s: abs(math.log(s[0] * s[1]) - math.log(max(n * k, 1))))


def measured_entry(fam: str, n: int, k: int, m: int) -> tuple[Plan, float] | None:
    """(plan, speed-up) measured for this family at the shape nearest to (n, k) in weight size, M bucket of m."""
    table = MEASURED.get("fp8" if fam == "fp8-tensor" else fam)
    if not table:
        return None
    entry = table[_nearest_shape(table, n, k)].get(m_bucket(m))
    if entry is None:
        return None
    plan, speedup = entry
    if fam == "fp8-tensor" and plan.kind in ("w8a8", "gemv") and plan.x_mode == "fused":
        plan = replace(plan, x_mode="prequant")
    return plan, speedup


def fallback_cost(fam: str, n: int, k: int, m: int) -> float:
    """Time of the path without a kernel over the bf16 GEMM's for this family, shape (nearest measured, as
    `measured_entry`) and M bucket: `FALLBACK_COST` for the families with quantized activations, else 1."""
    table = FALLBACK_COST.get("fp8" if fam == "fp8-tensor" else fam)
    if not table:
        return 1.0
    return table[_nearest_shape(table, n, k)].get(m_bucket(m), 1.0)


def choose_plan(fmt: str, weight_only: bool, m: int, n: int, k: int, prefer_kernel: bool = False) -> Plan:
    """The plan for an [m, k] x [n, k]^T product in `fmt`: Plan("bf16") when no kernel applies or the fastest
    measured is not MIN_SPEEDUP times as fast as the path without a kernel (the bf16 GEMM, after fake quantization
    of the activations for the W8A8 families: `fallback_cost`).

    prefer_kernel: return the fastest quantized plan even where it measured below that.
    """
    fam = family(fmt, weight_only)
    if fam is None:
        return Plan("bf16")
    if fam == "w8a16":
        plan = W8A16_PLANS[m_bucket(m)]
        if plan.kind == "bf16" and prefer_kernel:
            plan = P("w8a8", C(128, 128, 128, warps=8), "raw")
        return plan
    entry = measured_entry(fam, n, k, m)
    if entry is None:
        return Plan("bf16")
    plan, speedup = entry
    # (the fallback costs at least the bf16 GEMM: looked up only for kernels below MIN_SPEEDUP x bf16)
    if not prefer_kernel and speedup < MIN_SPEEDUP and speedup * fallback_cost(fam, n, k, m) < MIN_SPEEDUP:
        return Plan("bf16")
    return plan
