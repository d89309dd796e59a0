"""The kernel plan for one GEMM on this GPU: the measured plan of `quarl.kernels.tuning`, narrowed to what the GPU's
compute capability runs (no FP8 before 8.9, no wgmma / TMA / cuBLAS FP8 before 9.0)."""

from __future__ import annotations

from dataclasses import replace

import torch

from quarl.formats.registry import FORMATS
from quarl.kernels import availability
from quarl.kernels.tuning import Cfg, Plan, choose_plan


def _blockwise_cublas_ok(n: int, k: int) -> bool:
    """Shapes the dispatch sends to cuBLAS blockwise FP8: whole 128-row weight tiles and a number of 128-wide K
    groups divisible by 4 (Kp/128 = 6 returned garbage: cuBLAS appears to need 16-byte aligned scale rows). An
    explicit Plan("scaled_mm") pads other K (`quarl.formats.fp8.pad_block_groups`), but that copies the weight
    every call: too slow for a persistent rollout weight, where the Triton kernel runs instead. FP8 training
    pads its freshly quantized weight (`kernels.training_gemm`)."""
    return n % 128 == 0 and (-(-k // 128)) % 4 == 0


# Shared memory a W8A8 tile's pipelined 8-bit operands (stages x (bm + bn) x bk bytes) may fill before Hopper:
# sm_80 gives a block up to 163 KB, sm_86 / sm_89 99 KB; the rest is left to Triton's layout conversions. (Not
# tuned on such GPUs: a bound that keeps tiles tuned on Hopper launchable there.)
PRE_HOPPER_STAGE_BYTES = 64 * 1024


def plan_for(fmt: str, weight_only: bool, m: int, n: int, k: int, device: torch.device | None = None,
             prefer_kernel: bool = False) -> Plan:
    """The kernel plan for x [m, k] and a weight [n, k] in `fmt` (see `quarl.kernels.tuning`).

    Plan("bf16") means no kernel (try_quantized_matmul returns None); prefer_kernel=True keeps the fastest
    quantized kernel where it measured below `tuning.MIN_SPEEDUP` x the caller's bf16 path
    (`tuning.choose_plan`). FP8 needs compute capability >= 8.9,
    and so does nvfp4 (its block scales are E4M3, which Triton decodes only from 8.9 on); the int8/fp8
    tensor-core ("native") tiles, the TMA kernels and cuBLAS FP8 are used on >= 9.0 (Hopper) only; before it a
    W8A8 tile runs on the fp16 tensor cores with its pipeline stages capped (`PRE_HOPPER_STAGE_BYTES`).
    """
    plan = choose_plan(fmt, weight_only, m, n, k, prefer_kernel)
    if plan.kind == "bf16" or not torch.cuda.is_available():
        return plan
    cap = availability.capability(device)
    if FORMATS[fmt].needs_fp8_hardware and cap < (8, 9):
        return Plan("bf16")
    if plan.kind == "scaled_mm" and (cap < (9, 0) or n % 16 or k % 16 or (fmt == "fp8-block" and not
                                                                     _blockwise_cublas_ok(n, k))):
        # cuBLAS FP8 needs Hopper and N, K multiples of 16; blockwise scaling see _blockwise_cublas_ok.
        plan = Plan("w8a8", Cfg(128, 128, 128, warps=8, stages=4, native=True), "prequant")
    if cap < (9, 0) and plan.kind == "w8a8" and plan.cfg is not None:
        # No wgmma / TMA before Hopper: the same tile on the fp16 tensor cores, with no more pipeline stages than
        # fit PRE_HOPPER_STAGE_BYTES (Hopper, where the shipped tables were tuned, gives a block 227 KB).
        c = plan.cfg
        stages = max(1, min(c.stages, PRE_HOPPER_STAGE_BYTES // ((c.bm + c.bn) * c.bk)))
        plan = replace(plan, cfg=replace(c, native=False, tma=False, stages=stages))
    return plan

