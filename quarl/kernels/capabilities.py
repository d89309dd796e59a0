"""The first-use self-checks of the fast kernels and the one registry of their verdicts.

A kernel that may disagree with its PyTorch definition on some GPU or Triton version runs a small probe on its
first use per device (and dtype) and serves only where it passes (`kernel_passes_check`: a failure warns once
through `quarl.fallbacks.report_fallback` and keeps the torch path). `CAPABILITIES` keeps the process-wide
verdicts, so each of those probes runs once (the fast engine's decode attention and KV-write checks depend on its
cache's shapes and run once per engine or cache, keeping their own result):

    CAPABILITIES.check("decode_fused", ("cuda:0", torch.bfloat16), probe, requires=kernels_on_device,
                       what="the fused decode kernels")   # probe() on the first call only
    CAPABILITIES.results()   # {("decode_fused", ("cuda:0", torch.bfloat16)): True, ...}
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable

import torch

from quarl.kernels import availability


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


class CapabilityRegistry:
    """Verdicts of the kernels' first-use self-checks: one bool per (name, key), where name names a kernel or a
    group of kernels ("decode_fused", "training_kernel", "sampling", ...) and key is what the verdict depends on
    (a device string, usually with a dtype: ("cuda:0", torch.bfloat16))."""

    def __init__(self) -> None:
        self._verdicts: dict[tuple[str, Hashable], bool] = {}

    def check(self, name: str, key: Hashable, probe: Callable[[], bool],
              requires: Callable[[], bool] | None = None, what: str | None = None) -> bool:
        """Whether `name` may serve `key`. On the first call for (name, key): False where requires() is false (a
        cheap precondition, e.g. kernels available on the device; no probe and no warning then), else
        `kernel_passes_check(what or name, probe)` (an exception or a False from probe() warns once and gives
        False). Later calls return that verdict and run nothing."""
        verdict = self._verdicts.get((name, key))
        if verdict is None:
            verdict = (requires is None or bool(requires())) and kernel_passes_check(what or name, probe)
            self._verdicts[(name, key)] = verdict
        return verdict

    def results(self) -> dict[tuple[str, Hashable], bool]:
        """Every verdict so far: {(name, key): passed}."""
        return dict(self._verdicts)

    def clear(self, name: str | None = None) -> None:
        """Forget the verdicts of `name` (all verdicts for None): their next `check` probes again."""
        for checked in [c for c in self._verdicts if name is None or c[0] == name]:
            del self._verdicts[checked]


# The one registry of the process: every first-use kernel check goes through it.
CAPABILITIES = CapabilityRegistry()


def _seeded_randn(device: torch.device, dtype: torch.dtype):
    """randn(*shape) in dtype on device from one seeded generator (the fused kernels' self-check probes)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return lambda *shape: torch.randn(*shape, device=device, generator=gen).to(dtype)


# The training-forward kernels and their modules (each has `self_check(device, dtype) -> bool`).
TRAINING_KERNELS = {"silu_mul": "quarl.kernels.silu_mul_train", "rope": "quarl.kernels.rope_train",
                    "token_logprobs": "quarl.kernels.token_logprobs"}


def training_kernel_ok(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the training kernel `name` (a key of TRAINING_KERNELS) may run on `device` in `dtype`: kernels
    available and, on first use there, its forward and backward agree with the PyTorch definition on a small
    probe (`kernel_passes_check`: a failure, e.g. a Triton that cannot compile it, warns and keeps torch)."""

    def probe() -> bool:
        module = importlib.import_module(TRAINING_KERNELS[name])
        with torch.inference_mode(False), torch.enable_grad():  # the probe runs a backward
            return module.self_check(device, dtype)

    return CAPABILITIES.check("training_kernel", (name, str(device), dtype), probe,
                              requires=lambda: availability.kernels_available(device),
                              what=f"the training kernel {name}")


def _one_rounding_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within one bf16 rounding: |a - b| <= 2^-7 |b| plus a tiny absolute slack."""
    return bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0**-7 + 1e-6).all())


def _codes_equal(h: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> bool:
    """Whether a fused kernel's codes [M, K] and scales of h [M, K] are bit for bit
    `quarl.formats.quantize(h, fmt, "activation")`'s (fp8-block pads K to whole groups; the kernels write K)."""
    from quarl.formats import quantize

    ref = quantize(h, fmt, "activation")
    return torch.equal(codes.view(torch.uint8), ref.data.view(torch.uint8)[:, :h.shape[1]]) and \
        torch.equal(scales, ref.scale)


def decode_fused_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused decode kernels (`quarl.kernels.decode_fused`) may serve `dtype` activations on `device`:
    bf16 (their roundings are bf16's), kernels available and, on first use there, each kernel within one rounding
    of its PyTorch definition on random rows (`kernel_passes_check`; a failure warns and keeps torch). int8 codes
    are always part of the check; FP8 codes only where FP8 kernels run (compute capability >= 8.9): on an Ampere
    GPU no FP8 GEMM asks the kernels for codes (`codes_handoff` is False there)."""
    return CAPABILITIES.check(
        "decode_fused", (str(device), dtype),
        lambda: _decode_fused_agrees(device, dtype, availability.fp8_kernels_available(device)),
        requires=lambda: dtype == torch.bfloat16 and availability.kernels_available(device),
        what="the fused decode kernels")


def _decode_fused_agrees(device: torch.device, dtype: torch.dtype, fp8: bool = True) -> bool:
    """The three fused decode kernels against their torch definitions (values within one rounding in dtype, and
    the int8 codes of the kernel's own values bit for bit, with fp8 also the FP8 codes)."""
    import torch.nn.functional as F

    from quarl.kernels.decode_fused import rms_norm_rows, rope_rows, silu_mul_rows

    randn = _seeded_randn(device, dtype)

    quants = ("int8", "fp8") if fp8 else ("int8",)

    def codes_match(h, make_codes) -> bool:
        """The kernel's per-token codes of its own values h, bit for bit those of `quarl.formats`."""
        return all(_codes_equal(h, *make_codes(quant), quant) for quant in quants)

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


def decode_fused_group_ok(device: torch.device) -> bool:
    """Whether the fused norm and SiLU·mul kernels may hand fp8-block codes (1x128 groups) to cuBLAS: the FP8
    kernels run, and on first use their group codes equal `quarl.formats.quantize(h, "fp8-block")` of their own
    values. A separate check: a failure turns only this handoff off."""
    return CAPABILITIES.check(
        "decode_fused_group", str(device), lambda: _group_codes_agree(device),
        requires=lambda: availability.fp8_kernels_available(device) and decode_fused_ok(device, torch.bfloat16),
        what="the fused decode kernels' fp8-block codes")


def _group_codes_agree(device: torch.device) -> bool:
    from quarl.kernels.decode_fused import rms_norm_rows, silu_mul_rows

    randn = _seeded_randn(device, torch.bfloat16)
    x, w = randn(5, 300), randn(300)
    _, h, c, s = rms_norm_rows(x, None, w, None, 1e-6, "fp8-block", write_h=True)
    gu = randn(5, 2 * 700)
    a, c2, s2 = silu_mul_rows(gu[:, :700], gu[:, 700:], "fp8-block")
    return _codes_equal(h, c, s, "fp8-block") and _codes_equal(a, c2, s2, "fp8-block")


def decode_fused_smooth_ok(device: torch.device) -> bool:
    """Whether the fused norm and SiLU·mul kernels may hand over the codes of h / s for a smoothed linear
    (SmoothQuant, `QuantLinear.rollout_smoothing`): `decode_fused_ok` for bf16, and on first use their smoothed
    int8 codes (and FP8 / fp8-block codes where the FP8 kernels run) equal `quarl.formats.quantize` of their own
    values divided as `QuantLinear.smooth_input` divides. A separate check: a failure turns only this handoff off
    (a smoothed linear then quantizes its own divided input)."""
    return CAPABILITIES.check(
        "decode_fused_smooth", str(device), lambda: _smoothed_codes_agree(device),
        requires=lambda: decode_fused_ok(device, torch.bfloat16), what="the fused decode kernels' smoothed codes")


def _smoothed_codes_agree(device: torch.device) -> bool:
    from quarl.kernels.decode_fused import rms_norm_rows, silu_mul_rows
    from quarl.model.qlinear import divided

    randn = _seeded_randn(device, torch.bfloat16)
    quants = ("int8",)  # per format that hands codes over at all here: a failing fp8-block check stays its own
    if availability.fp8_kernels_available(device):
        quants += ("fp8", "fp8-block") if decode_fused_group_ok(device) else ("fp8",)
    x, w = randn(5, 300), randn(300)
    gu = randn(5, 2 * 700)
    s_norm, s_mlp = randn(300).float().abs() + 0.05, randn(700).float().abs() + 0.05
    for quant in quants:
        _, h, c, sc = rms_norm_rows(x, None, w, None, 1e-6, quant, write_h=True, smooth=s_norm)
        a, c2, sc2 = silu_mul_rows(gu[:, :700], gu[:, 700:], quant, smooth=s_mlp)
        if not (_codes_equal(divided(h, s_norm), c, sc, quant) and _codes_equal(divided(a, s_mlp), c2, sc2, quant)):
            return False
    return True


def decode_fused_scaled_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused decode kernels may also take unit-scale FP8 products (`FusedDecoder.deferred_scales`):
    `decode_fused_ok`, and on first use their scaled-input variants agreeing with scaling in torch first. A
    separate check, so that a failure here only turns the experimental mode off, not the fused kernels."""
    return CAPABILITIES.check(
        "decode_fused_scaled", (str(device), dtype), lambda: _scaled_decode_fused_agrees(device, dtype),
        requires=lambda: decode_fused_ok(device, dtype), what="the fused decode kernels' scaled inputs")


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
