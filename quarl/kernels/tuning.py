"""Which kernel and tile configuration each GEMM uses, by format family and number of rows M.

No Triton import here (plain data), so the choice can be inspected and tested on any machine.

A `Plan` names the path:
  "fp4"        fused W4A16 Triton GEMM (`quarl.kernels.fp4_gemm`);
  "deq_mm"     fp4 weight dequantized to bf16/fp16 by a Triton kernel, then the library GEMM;
  "w8a8"       8-bit Triton GEMM (`quarl.kernels.w8a8_gemm`), activation quantized in the GEMM (x_mode
               "fused"), beforehand by `quarl.kernels.act_quant` ("prequant"), or not at all ("raw", W8A16);
  "scaled_mm"  activation quantized by `act_quant`, then torch._scaled_mm (cuBLAS FP8: rowwise, per-tensor or
               blockwise scales);
  "gemv"       M <= 4 rows: one-launch FMA kernels (`quarl.kernels.gemv`; cfg.bn/bk/warps/stages, bm unused);
  "bf16"       no kernel wins: `try_quantized_matmul` returns None and the caller's reference path runs.
Families: "w4a16" (nvfp4, mxfp4), "int8", "fp8" (rowwise), "fp8-tensor", "fp8-block" (W8A8), and
"w8a16" (8-bit formats with weight_only=True).

The tables were tuned on one H200 (torch 2.11, Triton 3.6) with `quarl bench gemm --sweep` over the Qwen2.5-7B
linear shapes; see bench/results/gemm.md. M is rounded up to the next tuned bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

M_BUCKETS = (1, 16, 64, 256, 1024, 4096)


@dataclass(frozen=True)
class Cfg:
    """Tile configuration (mirrors `quarl.kernels.common.GemmConfig`, kept Triton-free)."""

    bm: int
    bn: int
    bk: int
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    group_m: int = 8
    native: bool = False


@dataclass(frozen=True)
class Plan:
    kind: str  # "fp4" | "deq_mm" | "w8a8" | "scaled_mm" | "gemv" | "bf16"
    cfg: Cfg | None = None
    x_mode: str = "fused"  # w8a8 only: "raw" | "fused" | "prequant"


def m_bucket(m: int) -> int:
    """The smallest tuned bucket >= m (the largest bucket for bigger m)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


# Default plans per (family, M bucket).
_W4A16 = {
    1: Plan("fp4", Cfg(16, 64, 256, warps=4, stages=4)),
    16: Plan("fp4", Cfg(16, 64, 256, warps=4, stages=4)),
    64: Plan("fp4", Cfg(64, 64, 128, warps=4, stages=3)),
    256: Plan("fp4", Cfg(64, 128, 128, warps=4, stages=3)),
    1024: Plan("deq_mm"),
    4096: Plan("deq_mm"),
}
_W8A8_DECODE = {
    1: Plan("w8a8", Cfg(16, 64, 256, warps=4, stages=4), "fused"),
    16: Plan("w8a8", Cfg(16, 64, 256, warps=4, stages=4), "fused"),
    64: Plan("w8a8", Cfg(64, 64, 128, warps=4, stages=4, native=True), "prequant"),
    256: Plan("w8a8", Cfg(64, 128, 128, warps=4, stages=4, native=True), "prequant"),
    1024: Plan("w8a8", Cfg(128, 256, 128, warps=8, stages=3, native=True), "prequant"),
    4096: Plan("w8a8", Cfg(128, 256, 128, warps=8, stages=3, native=True), "prequant"),
}
_W8A16 = {
    1: Plan("w8a8", Cfg(16, 64, 256, warps=4, stages=4), "raw"),
    16: Plan("w8a8", Cfg(16, 64, 256, warps=4, stages=4), "raw"),
    64: Plan("w8a8", Cfg(64, 64, 128, warps=4, stages=3), "raw"),
    256: Plan("w8a8", Cfg(64, 128, 128, warps=4, stages=3), "raw"),
    1024: Plan("bf16"),
    4096: Plan("bf16"),
}
_FP8_BLOCK = {
    1: Plan("w8a8", Cfg(16, 64, 128, warps=4, stages=4), "fused"),
    16: Plan("w8a8", Cfg(16, 64, 128, warps=4, stages=4), "fused"),
    64: Plan("w8a8", Cfg(64, 64, 128, warps=4, stages=4, native=True), "prequant"),
    256: Plan("w8a8", Cfg(64, 128, 128, warps=4, stages=4, native=True), "prequant"),
    1024: Plan("w8a8", Cfg(128, 128, 128, warps=8, stages=3, native=True), "prequant"),
    4096: Plan("w8a8", Cfg(128, 128, 128, warps=8, stages=3, native=True), "prequant"),
}
_FP8_TENSOR = {b: Plan("scaled_mm") for b in M_BUCKETS}

DEFAULT_PLANS: dict[str, dict[int, Plan]] = {
    "w4a16": _W4A16,
    "int8": _W8A8_DECODE,
    "fp8": _W8A8_DECODE,
    "fp8-tensor": _FP8_TENSOR,
    "fp8-block": _FP8_BLOCK,
    "w8a16": _W8A16,
}

# Measured exceptions per (family, N, K, M bucket): a better plan for that shape, or Plan("bf16") where the
# bf16 GEMM beat every quantized path.
SHAPE_PLANS: dict[tuple[str, int, int, int], Plan] = {}


def family(fmt: str, weight_only: bool) -> str | None:
    """The plan family of a format + mode, or None where no kernel exists (fp4 activations: W4A4)."""
    if fmt in ("nvfp4", "mxfp4"):
        return "w4a16" if weight_only else None
    if fmt in ("int8", "fp8", "fp8-tensor", "fp8-block"):
        return "w8a16" if weight_only else fmt
    return None


def choose_plan(fmt: str, weight_only: bool, m: int, n: int, k: int) -> Plan:
    """The plan for an [m, k] x [n, k]^T product in `fmt` (Plan("bf16") when no kernel applies or wins)."""
    fam = family(fmt, weight_only)
    if fam is None:
        return Plan("bf16")
    b = m_bucket(m)
    return SHAPE_PLANS.get((fam, n, k, b), DEFAULT_PLANS[fam][b])
