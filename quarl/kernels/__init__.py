"""GPU fast paths behind the reference formats. `try_quantized_matmul` returns None where no kernel applies.

Importing this package never needs Triton or a GPU: the Triton kernels are imported on the first call that can
use them. Kernel choice per format and M lives in `quarl.kernels.tuning` (plain data, measured on an H200).

The kernels read the canonical `QuantizedTensor` layouts directly (no transposed or re-packed copies), so an
in-place re-quantization (`quantize(w, fmt, out=qt)`, the per-step sync) needs no cache invalidation.
"""

from __future__ import annotations

import functools
import os

import torch

from dataclasses import replace

from quarl.kernels.tuning import Cfg, Plan, choose_plan

__all__ = ["try_quantized_matmul", "quantized_matmul", "try_dequantize", "fake_quantize_activation",
           "fake_quantize_weight", "fake_quantize_columns", "try_quantize_fp8_block_weight", "kernels_available",
           "fp8_kernels_available", "plan_for", "codes_handoff", "matmul_from_codes", "unit_scales_ok",
           "decode_fused_ok"]

_FORMATS = ("int8", "fp8", "fp8-tensor", "fp8-block", "nvfp4", "mxfp4")


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while loading its backend
        return False
    return True


def kernels_available(device: torch.device | None = None) -> bool:
    """True when the Triton kernels can run on `device` (default: the current CUDA device).

    Needs CUDA, compute capability >= 8.0 and an importable Triton; QUARL_DISABLE_KERNELS=1 turns them off.
    """
    if os.environ.get("QUARL_DISABLE_KERNELS", "") not in ("", "0"):
        return False
    if not torch.cuda.is_available() or not _triton_importable():
        return False
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def kernel_passes_check(what: str, check) -> bool:
    """Run check(), True when a kernel agrees with its torch definition on a small probe. An exception (e.g. a
    Triton that cannot compile the kernel) or a disagreement warns "<what> ...; using torch" and gives False, so
    the caller keeps its torch path."""
    from quarl.fallbacks import report_fallback

    try:
        ok = bool(check())
    except Exception as e:  # the torch path still works
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        report_fallback(what, f"failed its check ({reason}); using torch")
        return False
    if not ok:
        report_fallback(what, "disagrees with its torch definition; using torch")
    return ok


def fp8_kernels_available(device: torch.device | None = None) -> bool:
    """`kernels_available` and FP8 E4M3 in Triton, which needs compute capability >= 8.9 (Ada, Hopper): the
    kernels that read or write FP8 values. Older GPUs take the reference paths for FP8 (emulated, exact)."""
    return kernels_available(device) and torch.cuda.get_device_capability(device) >= (8, 9)


def _blockwise_cublas_ok(n: int, k: int) -> bool:
    """Shapes the dispatch sends to cuBLAS blockwise FP8: whole 128-row weight tiles and a number of 128-wide K
    groups divisible by 4 (Kp/128 = 6 returned garbage: cuBLAS appears to need 16-byte aligned scale rows). An
    explicit Plan("scaled_mm") pads other K (`quarl.formats.fp8.pad_block_groups`), but that copies the weight
    every call: too slow for a persistent rollout weight, where the Triton kernel runs instead. FP8 training
    pads its freshly quantized weight (`kernels.training_gemm`)."""
    return n % 128 == 0 and (-(-k // 128)) % 4 == 0


# Shared memory a W8A8 tile's pipelined 8-bit operands (stages x (bm + bn) x bk bytes) may fill before Hopper:
# sm_80 gives a block up to 163 KB, sm_86 / sm_89 99 KB; the rest is left to Triton's layout conversions. (Not
# measured on such GPUs: a bound that keeps the H200-tuned tiles launchable there.)
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
    cap = torch.cuda.get_device_capability(device)
    if (fmt.startswith("fp8") or fmt == "nvfp4") and cap < (8, 9):
        return Plan("bf16")
    if plan.kind == "scaled_mm" and (cap < (9, 0) or n % 16 or k % 16 or (fmt == "fp8-block" and not
                                                                     _blockwise_cublas_ok(n, k))):
        # cuBLAS FP8 needs Hopper and N, K multiples of 16; blockwise scaling see _blockwise_cublas_ok.
        plan = Plan("w8a8", Cfg(128, 128, 128, warps=8, stages=4, native=True), "prequant")
    if cap < (9, 0) and plan.kind == "w8a8" and plan.cfg is not None:
        # No wgmma / TMA before Hopper: the same tile on the fp16 tensor cores, with no more pipeline stages than
        # fit PRE_HOPPER_STAGE_BYTES (the tables were measured on an H200, which gives a block 227 KB).
        c = plan.cfg
        stages = max(1, min(c.stages, PRE_HOPPER_STAGE_BYTES // ((c.bm + c.bn) * c.bk)))
        plan = replace(plan, cfg=replace(c, native=False, tma=False, stages=stages))
    return plan


def try_dequantize(qweight, dtype: torch.dtype) -> torch.Tensor | None:
    """Dense weight [N, K] in dtype (bf16/fp16/fp32) from an nvfp4/mxfp4 weight QuantizedTensor on a GPU, by one
    Triton kernel: the same values as `qweight.dequantize(dtype)` (code * block scale * global scale in fp32,
    rounded once), without the reference's int64 lookup and fp32 temporaries. None where it does not apply
    (other formats, CPU tensors, no Triton): the caller then uses `qweight.dequantize`."""
    if getattr(qweight, "fmt", None) not in ("nvfp4", "mxfp4") or qweight.role != "weight":
        return None
    if dtype not in (torch.bfloat16, torch.float16, torch.float32) or not qweight.data.is_cuda:
        return None
    available = fp8_kernels_available if qweight.fmt == "nvfp4" else kernels_available  # E4M3 block scales
    if not available(qweight.data.device):
        return None
    from quarl.kernels.dequant import dequantize_fp4_weight

    return dequantize_fp4_weight(qweight, dtype)


# Formats whose activation rounding has a one-pass kernel (the 8-bit ones; fp4 activations are W4A4, no kernel).
_ACT_FAKE_QUANT_FORMATS = ("int8", "fp8", "fp8-tensor", "fp8-block")


def fake_quantize_activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """dequantize(quantize(x, fmt, "activation")) in x's shape and dtype, with no input checks (a hot path).

    x: [..., K] floating. On a GPU, for the 8-bit formats and bf16/fp16/fp32 x, one Triton pass
    (`quarl.kernels.act_quant.fake_quantize_activation`, bit for bit the same values); elsewhere the reference
    `quarl.formats.registry.fake_quantize_unchecked` (a dozen elementwise kernels). No gradient flows through
    either: wrap it in a straight-through estimator. NaN inputs, FP8 formats: the NaN element stays NaN in both
    (the reference then scales its whole group by 1, the kernel by the other values' amax); int8 has no NaN code,
    and both lose it.
    """
    available = fp8_kernels_available if fmt.startswith("fp8") else kernels_available
    if (x.is_cuda and fmt in _ACT_FAKE_QUANT_FORMATS and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.dim() >= 1 and x.shape[-1] > 0 and available(x.device)):
        from quarl.kernels.act_quant import fake_quantize_activation as kernel

        x2d = x.detach().reshape(-1, x.shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        return kernel(x2d, fmt).reshape(x.shape)
    from quarl.formats.registry import fake_quantize_unchecked

    return fake_quantize_unchecked(x, fmt, "activation")


def fake_quantize_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """dequantize(quantize(w, fmt, "weight")) [N, K] in w's dtype, with no input checks (the unified flow's
    training forward, every micro-batch). int8 / fp8 / fp8-tensor weights are scaled per row (or per tensor)
    exactly as activations are, so they take `fake_quantize_activation`'s one pass; fp8-block takes the one-pass
    tile quantizer, then the reference dequantization; other formats and CPU tensors the reference."""
    if fmt in ("int8", "fp8", "fp8-tensor"):
        return fake_quantize_activation(w, fmt)
    if fmt == "fp8-block":
        q = try_quantize_fp8_block_weight(w)
        if q is not None:
            return q.dequantize(w.dtype)
    from quarl.formats.registry import fake_quantize_unchecked

    return fake_quantize_unchecked(w, fmt, "weight")


def fake_quantize_columns(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] with every column rounded in 1x128 groups along M (FP8-block), in x's dtype and layout: the
    values of `fake_quantize(x.t(), "fp8-block", "activation").t()`, the weight-gradient operands of FP8
    training (`quarl.model.fp8_training`). One Triton pass and no transposed copy on a GPU; elsewhere the
    reference on the transposed copy."""
    if x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and \
            fp8_kernels_available(x.device):
        from quarl.kernels.act_quant import fake_quantize_columns as kernel

        return kernel(x if x.stride(1) == 1 else x.contiguous())
    from quarl.formats.registry import fake_quantize_unchecked

    return fake_quantize_unchecked(x.t().contiguous(), "fp8-block", "activation").t().contiguous()


def try_quantize_fp8_block_weight(w: torch.Tensor, transpose: bool = False):
    """The fp8-block weight QuantizedTensor of w [N, K] (or of w^T [K, N] with transpose) by one Triton pass on a
    GPU: the codes and scales of `quantize(w, "fp8-block", "weight")` bit for bit (see
    `quarl.kernels.weight_quant`). None off the GPU or for other dtypes/shapes: use the reference then."""
    if not (w.is_cuda and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return None
    if w.stride(1) != 1 or not fp8_kernels_available(w.device):
        return None
    from quarl.kernels.weight_quant import quantize_fp8_block_weight

    return quantize_fp8_block_weight(w, transpose)


def try_quantize_weight(w: torch.Tensor, fmt: str):
    """The weight QuantizedTensor of w [N, K] in one Triton pass on a GPU, bit for bit `quantize(w, fmt, "weight")`:
    "fp8-block" by its tile quantizer, "int8" and "fp8" by the per-row activation quantizer (per-channel weight
    scales are per-row scales). None for other formats, off the GPU, or where the kernels cannot run: use the
    reference then. Used by the per-step sync, which re-quantizes every linear."""
    if fmt == "fp8-block":
        return try_quantize_fp8_block_weight(w)
    if fmt not in ("int8", "fp8") or not (w.is_cuda and w.dim() == 2 and w.stride(1) == 1):
        return None
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.shape[0] == 0:
        return None
    available = fp8_kernels_available if fmt == "fp8" else kernels_available
    if not available(w.device):
        return None
    from quarl.formats import QuantizedTensor
    from quarl.kernels.act_quant import quantize_activation

    codes, scales = quantize_activation(w, fmt, w.shape[1])
    return QuantizedTensor(fmt, "weight", codes, scales, None, w.shape)


def try_quantized_matmul(x: torch.Tensor, qweight, weight_only: bool, bias: torch.Tensor | None = None):
    """See `_quantized_matmul`; None also where the caller's bf16 path (for W8A8: fake-quantized activations times
    the dequantized weight) measured faster than every quantized kernel (`tuning.choose_plan`)."""
    return _quantized_matmul(x, qweight, weight_only, bias, prefer_kernel=False)


def quantized_matmul(x: torch.Tensor, qweight, weight_only: bool, bias: torch.Tensor | None = None):
    """As `try_quantized_matmul`, but runs the fastest quantized kernel even where it measured below
    `tuning.MIN_SPEEDUP` x the caller's bf16 path (for a caller that holds only the quantized weight). None only
    where no kernel applies (CPU, no Triton, W4A4)."""
    return _quantized_matmul(x, qweight, weight_only, bias, prefer_kernel=True)


def _quantized_matmul(x: torch.Tensor, qweight, weight_only: bool, bias: torch.Tensor | None, prefer_kernel: bool):
    """y = Q(x) @ dequant(qweight)^T (+ bias) on a fast kernel, or None when none applies (CPU, unsupported).

    x: [M, K] activations in the compute dtype (bf16 or fp16; other dtypes -> None); qweight: a
    `quarl.formats.QuantizedTensor` with role "weight" and shape [N, K]; weight_only: True = W4A16/W8A16
    (x is not quantized), False = x quantized dynamically like `quantize(x, fmt, "activation")` (per token for
    int8/fp8, 1x128 groups for fp8-block, one scale for fp8-tensor; fp4 formats have no W4A4 kernel -> None).
    bias: [N] or None. Returns [M, N] in x.dtype, or None (CPU tensors, no Triton, a format or shape without a
    kernel, or a shape where the caller's measured bf16 path is faster).
    Raises ValueError when x and qweight do not fit together (K mismatch, different devices, not a weight).
    """
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        return None
    fmt = getattr(qweight, "fmt", None)
    if fmt not in _FORMATS or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2:
        return None
    if qweight.role != "weight" or len(qweight.shape) != 2:
        raise ValueError(
            f"try_quantized_matmul needs a 2-D weight QuantizedTensor [N, K], got role={qweight.role!r} "
            f"shape={tuple(qweight.shape)}; quantize the weight with quantize(w, fmt, role='weight')"
        )
    m, k = x.shape
    n = qweight.shape[0]
    if k != qweight.shape[1]:
        raise ValueError(
            f"x has {k} input features but the weight expects {qweight.shape[1]} (weight shape "
            f"{tuple(qweight.shape)}); x must be [M, in_features]"
        )
    if qweight.data.device != x.device:
        raise ValueError(f"x is on {x.device} but the quantized weight is on {qweight.data.device}; move one of them")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] on {x.device}, got shape {tuple(bias.shape)} on {bias.device}")
    if fmt == "mxfp4" and x.dtype == torch.float16:
        return None  # E8M0 scales can leave fp16's range; the bf16 path is exact
    if not kernels_available(x.device):
        return None
    plan = plan_for(fmt, weight_only, m, n, k, x.device, prefer_kernel)
    if plan.kind == "bf16":
        return None
    if m == 0:
        return torch.zeros((0, n), dtype=x.dtype, device=x.device) + (0 if bias is None else bias.to(x.dtype))
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    from quarl.kernels.dispatch import run_plan

    return run_plan(plan, x, qweight, bias)


def _takes_codes(fmt: str, plan: Plan) -> bool:
    """Whether `plan` starts from activation codes made beforehand, so that a fused norm / SiLU·mul kernel's codes
    can replace its quantization pass: cuBLAS FP8 ("fp8", "fp8-block"), or for "int8" / "fp8" a W8A8 GEMM or
    GEMV in prequant mode. (The Triton fp8-block kernel reads row-major group scales, the fused kernels write
    them column-major for cuBLAS; the plans quantizing inside the GEMM ("fused") have no pass to save.)"""
    if plan.kind == "scaled_mm":
        return fmt in ("fp8", "fp8-block")
    return fmt in ("int8", "fp8") and plan.kind in ("w8a8", "gemv") and plan.x_mode == "prequant"


def _codes_plan(fmt: str, m: int, n: int, k: int, device) -> Plan | None:
    """The 8-bit GEMM plan at m rows when it can take activation codes (`codes_handoff`), else None. The same
    plan the quantizing matmul (`try_quantized_matmul`) would run, so that handing codes over never changes which
    linears run quantized, nor their values: the handed codes only skip the GEMM's own quantization pass."""
    plan = plan_for(fmt, False, m, n, k, device)
    return plan if _takes_codes(fmt, plan) else None


def codes_handoff(qweight, weight_only: bool, m: int) -> bool:
    """Whether a GEMM of m activation rows with this weight takes 8-bit activation codes, so that a fused norm /
    SiLU·mul kernel can hand them over (`matmul_from_codes`) instead of the bf16 activations the GEMM would
    quantize itself (one pass over the activations less per linear): the plan at m rows is cuBLAS FP8
    (`torch._scaled_mm`), rowwise ("fp8") or blockwise ("fp8-block"), or for "int8" / "fp8" a W8A8 Triton GEMM /
    GEMV on prequantized codes. fp8-block also needs K a multiple of 512 (whole groups, and the group count cuBLAS
    takes unpadded), m a multiple of 16 (the rows cuBLAS blockwise was seen correct with; `dispatch._scaled_mm`
    pads others, codes are not padded) and the fused kernels' group codes to have passed their check
    (`decode_fused_group_ok`)."""
    fmt = getattr(qweight, "fmt", None)
    if fmt not in ("int8", "fp8", "fp8-block") or weight_only or not qweight.data.is_cuda:
        return False
    device = qweight.data.device
    if not (kernels_available(device) if fmt == "int8" else fp8_kernels_available(device)):
        return False
    n, k = qweight.shape
    if fmt == "fp8-block" and (k % 512 or m % 16 or not decode_fused_group_ok(device)):
        return False
    return _codes_plan(fmt, m, n, k, device) is not None


def unit_scales_ok(qweight, m: int) -> bool:
    """Whether the fused decoder may run this "fp8" (rowwise) GEMM at m rows as its unit-scale cuBLAS product,
    the next kernel applying the scales (`fused_decode.unit_scale_matmul`): where the plan is cuBLAS FP8 or the
    persistent TMA kernel on codes (rollout batches, where cuBLAS with per-tensor scales measured faster). The
    small-M Triton plans take the handed codes with their own scales, so that small batches compute exactly the
    module path's values (the unit-scale product rounds once more)."""
    if getattr(qweight, "fmt", None) != "fp8" or not qweight.data.is_cuda:
        return False
    n, k = qweight.shape
    plan = _codes_plan("fp8", m, n, k, qweight.data.device)
    if plan is None:
        return False
    return plan.kind == "scaled_mm" or (plan.cfg is not None and plan.cfg.tma and not plan.cfg.swap_ab)


def matmul_from_codes(codes: torch.Tensor, scales: torch.Tensor, qweight, bias: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """Q(x) @ deq(W)^T (+ bias) from 8-bit activation codes [M, K] and float32 scales -> [M, N] in out_dtype:
    int8 codes for an "int8" weight QuantizedTensor [N, K], float8_e4m3fn codes for an "fp8" (rowwise) one, both
    with per-token scales [M, 1], or float8_e4m3fn codes for an "fp8-block" weight with 1x128-group scales
    [M, K/128] laid out column-major (stride 1 along M). Where `codes_handoff` holds, the same values as
    `try_quantized_matmul(x, qweight, False, bias)` when (codes, scales) = quantize(x, fmt, "activation");
    elsewhere FP8 runs on cuBLAS and int8 on the dequantized operands in float32 (a reference, not a fast path)."""
    fmt = qweight.fmt
    if fmt not in ("int8", "fp8", "fp8-block"):
        raise ValueError(f"matmul_from_codes takes 'int8', 'fp8' (rowwise) or 'fp8-block' weights, got {fmt!r}: "
                         "other formats (per-tensor scales, fp4) take no handed activation codes; call "
                         "try_quantized_matmul with the activations instead")
    want = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    if codes.dtype != want or codes.dim() != 2 \
            or codes.shape[1] != qweight.data.shape[1]:
        raise ValueError(f"matmul_from_codes needs int8 codes [M, {qweight.data.shape[1]}] for an 'int8' weight, "
                         "float8_e4m3fn codes for an 'fp8' or 'fp8-block' one; got codes "
                         f"{codes.dtype} {tuple(codes.shape)}, weight {fmt!r}")
    groups = qweight.data.shape[1] // 128 if fmt == "fp8-block" else 1
    if scales.dtype != torch.float32 or tuple(scales.shape) != (codes.shape[0], groups) or \
            (groups > 1 and scales.stride(0) != 1):
        raise ValueError(f"matmul_from_codes needs float32 scales [{codes.shape[0]}, {groups}]"
                         f"{' column-major' if groups > 1 else ''}, got {scales.dtype} {tuple(scales.shape)} "
                         f"strides {scales.stride()}")
    # (torch._scaled_mm also takes CPU tensors; the kernels do not)
    if fmt != "fp8-block" and codes.is_cuda and kernels_available(codes.device):
        n, k = qweight.shape
        plan = _codes_plan(fmt, codes.shape[0], n, k, codes.device)
        if plan is not None:
            from quarl.kernels.dispatch import codes_matmul

            return codes_matmul(plan, codes, scales, qweight, bias, out_dtype)
    if fmt == "int8":  # (no Triton needed)
        y = (codes.float() * scales) @ qweight.dequantize(torch.float32).T
        return (y if bias is None else y + bias.float()).to(out_dtype)
    from quarl.kernels.dispatch import scaled_mm_codes

    return scaled_mm_codes(codes, scales, qweight, bias, out_dtype)


_DECODE_FUSED_OK: dict[tuple[str, torch.dtype], bool] = {}


def _seeded_randn(device: torch.device, dtype: torch.dtype):
    """randn(*shape) in dtype on device from one seeded generator (the fused kernels' self-check probes)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return lambda *shape: torch.randn(*shape, device=device, generator=gen).to(dtype)


_TRAINING_KERNEL_OK: dict[tuple[str, str, torch.dtype], bool] = {}
# The training-forward kernels and their modules (each has `self_check(device, dtype) -> bool`).
TRAINING_KERNELS = {"silu_mul": "quarl.kernels.silu_mul_train", "rope": "quarl.kernels.rope_train",
                    "token_logprobs": "quarl.kernels.token_logprobs"}


def training_kernel_ok(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the training kernel `name` (a key of TRAINING_KERNELS) may run on `device` in `dtype`: kernels
    available and, on first use there, its forward and backward agree with the PyTorch definition on a small
    probe (`kernel_passes_check`: a failure, e.g. a Triton that cannot compile it, warns and keeps torch)."""
    key = (name, str(device), dtype)
    if key not in _TRAINING_KERNEL_OK:
        ok = kernels_available(device)
        if ok:
            import importlib

            module = importlib.import_module(TRAINING_KERNELS[name])

            def check():
                with torch.inference_mode(False), torch.enable_grad():  # the probe runs a backward
                    return module.self_check(device, dtype)

            ok = kernel_passes_check(f"the training kernel {name}", check)
        _TRAINING_KERNEL_OK[key] = ok
    return _TRAINING_KERNEL_OK[key]


def _one_rounding_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within one bf16 rounding: |a - b| <= 2^-7 |b| plus a tiny absolute slack."""
    return bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0**-7 + 1e-6).all())


def decode_fused_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused decode kernels (`quarl.kernels.decode_fused`) may serve `dtype` activations on `device`:
    bf16 (their roundings are bf16's), kernels available and, on first use there, each kernel within one rounding
    of its PyTorch definition on random rows (`kernel_passes_check`; a failure warns and keeps torch). int8 codes
    are always part of the check; FP8 codes only where FP8 kernels run (compute capability >= 8.9): on an Ampere
    GPU no FP8 GEMM asks the kernels for codes (`codes_handoff` is False there)."""
    key = (str(device), dtype)
    if key not in _DECODE_FUSED_OK:
        ok = dtype == torch.bfloat16 and kernels_available(device)
        if ok:
            fp8 = fp8_kernels_available(device)
            ok = kernel_passes_check("the fused decode kernels", lambda: _decode_fused_agrees(device, dtype, fp8))
        _DECODE_FUSED_OK[key] = ok
    return _DECODE_FUSED_OK[key]


def _decode_fused_agrees(device: torch.device, dtype: torch.dtype, fp8: bool = True) -> bool:
    """The three fused decode kernels against their torch definitions (values within one rounding in dtype, and
    the int8 codes of the kernel's own values bit for bit, with fp8 also the FP8 codes)."""
    import torch.nn.functional as F

    from quarl.formats import quantize
    from quarl.kernels.decode_fused import rms_norm_rows, rope_rows, silu_mul_rows

    randn = _seeded_randn(device, dtype)

    quants = ("int8", "fp8") if fp8 else ("int8",)

    def codes_match(h, make_codes) -> bool:
        """The kernel's per-token codes of its own values h, bit for bit those of `quarl.formats`."""
        for quant in quants:
            c, s = make_codes(quant)
            ref = quantize(h, quant, "activation")
            if not (torch.equal(c.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(s, ref.scale)):
                return False
        return True

    x, d, w, noise = randn(6, 200), randn(6, 200), randn(200), randn(200) * 0.01
    r, h, _, _ = rms_norm_rows(x, d, w, noise, 1e-6)
    r_ref = x + d
    rf = r_ref.float()
    h_ref = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.float() + noise.float())).to(dtype)
    ok = torch.equal(r, r_ref) and _one_rounding_close(h, h_ref) and codes_match(
        h, lambda quant: rms_norm_rows(x, d, w, noise, 1e-6, quant, write_h=True)[2:])

    gu = randn(6, 2 * 300)
    a, _, _ = silu_mul_rows(gu[:, :300], gu[:, 300:])
    ok = ok and _one_rounding_close(a, F.silu(gu[:, :300]) * gu[:, 300:]) and codes_match(
        a, lambda quant: silu_mul_rows(gu[:, :300], gu[:, 300:], quant)[1:])

    qkv, cos, sin = randn(5, 6 * 16), randn(5, 16), randn(5, 16)
    q, k = rope_rows(qkv, cos, sin, 3, 1, 16)
    x4 = qkv[:, :4 * 16].reshape(5, 4, 16)
    rot = torch.cat((-x4[..., 8:], x4[..., :8]), dim=-1)
    ref = x4 * cos[:, None] + rot * sin[:, None]
    return ok and torch.equal(torch.cat((q, k), dim=1), ref)


_DECODE_FUSED_GROUP_OK: dict[str, bool] = {}


def decode_fused_group_ok(device: torch.device) -> bool:
    """Whether the fused norm and SiLU·mul kernels may hand fp8-block codes (1x128 groups) to cuBLAS: the FP8
    kernels run, and on first use their group codes equal `quarl.formats.quantize(h, "fp8-block")` of their own
    values. A separate check: a failure turns only this handoff off."""
    key = str(device)
    if key not in _DECODE_FUSED_GROUP_OK:
        ok = fp8_kernels_available(device) and decode_fused_ok(device, torch.bfloat16)
        if ok:
            ok = kernel_passes_check("the fused decode kernels' fp8-block codes",
                                     lambda: _group_codes_agree(device))
        _DECODE_FUSED_GROUP_OK[key] = ok
    return _DECODE_FUSED_GROUP_OK[key]


def _group_codes_agree(device: torch.device) -> bool:
    from quarl.formats import quantize
    from quarl.kernels.decode_fused import rms_norm_rows, silu_mul_rows

    randn = _seeded_randn(device, torch.bfloat16)

    def same(h, c, s) -> bool:
        ref = quantize(h, "fp8-block", "activation")
        return torch.equal(c.view(torch.uint8), ref.data.view(torch.uint8)[:, :h.shape[1]]) and \
            torch.equal(s, ref.scale)

    x, w = randn(5, 300), randn(300)
    _, h, c, s = rms_norm_rows(x, None, w, None, 1e-6, "fp8-block", write_h=True)
    gu = randn(5, 2 * 700)
    a, c2, s2 = silu_mul_rows(gu[:, :700], gu[:, 700:], "fp8-block")
    return same(h, c, s) and same(a, c2, s2)


_DECODE_FUSED_SCALED_OK: dict[tuple[str, torch.dtype], bool] = {}


def decode_fused_scaled_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused decode kernels may also take unit-scale FP8 products (`FusedDecoder.deferred_scales`):
    `decode_fused_ok`, and on first use their scaled-input variants agreeing with scaling in torch first. A
    separate check, so that a failure here only turns the experimental mode off, not the fused kernels."""
    key = (str(device), dtype)
    if key not in _DECODE_FUSED_SCALED_OK:
        ok = decode_fused_ok(device, dtype)
        if ok:
            ok = kernel_passes_check("the fused decode kernels' scaled inputs",
                                     lambda: _scaled_decode_fused_agrees(device, dtype))
        _DECODE_FUSED_SCALED_OK[key] = ok
    return _DECODE_FUSED_SCALED_OK[key]


def _scaled_decode_fused_agrees(device: torch.device, dtype: torch.dtype) -> bool:
    """The fused kernels' unit-scale-product inputs (deferred scales) against scaling in torch first."""
    import torch.nn.functional as F

    from quarl.kernels.decode_fused import rms_norm_rows, rope_rows, rope_rows_scaled, silu_mul_rows

    randn, close = _seeded_randn(device, dtype), _one_rounding_close

    def pos(*shape):
        return randn(*shape).float().abs() * 1e-2 + 1e-3

    def scaled(y, rows, cols):
        return (y.float() * rows * cols).to(dtype)

    x, d, w = randn(6, 200), randn(6, 200) * 100, randn(200)
    rows, cols = pos(6, 1), pos(200)
    r, _, _, _ = rms_norm_rows(x, d, w, None, 1e-6, delta_scales=(rows, cols))
    ok = torch.equal(r, x + scaled(d, rows, cols))
    gu, gcols = randn(6, 600) * 100, pos(600)
    a, _, _ = silu_mul_rows(gu[:, :300], gu[:, 300:], in_scales=(rows, gcols))
    ok = ok and close(a, F.silu(scaled(gu[:, :300], rows, gcols[:300])) * scaled(gu[:, 300:], rows, gcols[300:]))
    y, ycols, bias = randn(5, 5 * 16) * 100, pos(5 * 16), randn(5 * 16)
    cos, sin = randn(5, 16), randn(5, 16)
    q, k, v = rope_rows_scaled(y, rows[:5], ycols, bias, cos, sin, 3, 1, 16)
    xs = (y.float() * rows[:5] * ycols + bias.float()).to(dtype)
    q_ref, k_ref = rope_rows(xs, cos, sin, 3, 1, 16)  # itself checked against torch above
    # close, not equal: the compiler may fuse the scale multiply and the bias add into one float32 FMA
    return ok and close(q, q_ref) and close(k, k_ref) and close(v[:, 0], xs[:, 4 * 16:])
