"""GPU: AQN noise reaches a bf16 norm on CUDA in float32 — in the module forward (which takes torch's fused
F.rms_norm, as training does, until AQN is enabled on the norm), in the fused decode norm kernel, and in a CUDA
graph captured while the noise was still zero (AQN's stage 0 has σ = 0; the graph must pick up the noise written
at later syncs).

Tolerance, as in tests/test_uaq_aqn.py: every element within one bf16 rounding (2^-7 relative) of the float64
reference bf16((x64 * rsqrt(mean(x64^2) + eps)) * (w64 + n64)) and at most 0.1 % of the elements not identical;
adding the noise in bf16 instead leaves far more of them different.
"""

import pytest
import torch

from quarl.model.layers import RMSNorm
from test_uaq_aqn import _one_rounding_of, _reference

pytestmark = pytest.mark.gpu
DEV, BF16 = "cuda", torch.bfloat16


def _norm_and_rows(dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(dim, dtype=BF16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=g))
    x = (torch.randn(64, dim, generator=g) * 2).to(BF16)
    return norm.to(DEV), x.to(DEV), g


def _write_noise(norm, sigma, g):
    norm.aqn_enabled = True  # as quarl.rl.aqn.set_aqn_noise does
    with torch.no_grad():
        norm.rollout_noise.copy_((torch.randn(norm.weight.shape, generator=g) * sigma).to(DEV))


def _changed_enough(noisy, clean, sigma):
    changed = (noisy != clean).float().mean().item()
    assert changed >= (0.005 if sigma == 1e-4 else 0.05), changed


@pytest.mark.parametrize("dim", [576, 4096])
@pytest.mark.parametrize("sigma", [1e-3, 1e-4])
def test_module_norm_adds_float32_noise_on_cuda(dim, sigma):
    norm, x, g = _norm_and_rows(dim)
    assert norm.rollout_noise.dtype == torch.float32 and norm.weight.dtype == BF16
    clean = norm(x)  # training: torch's fused kernel
    norm.set_rollout(True)
    assert torch.equal(norm(x), clean)  # zero noise in rollout: the same fused kernel, bit for bit
    _write_noise(norm, sigma, g)
    noisy = norm(x)
    _changed_enough(noisy, clean, sigma)
    _one_rounding_of(noisy, _reference(x, norm.weight, norm.rollout_noise))
    norm.set_rollout(False)
    assert torch.equal(norm(x), clean)  # the training forward never sees the noise


@pytest.mark.parametrize("dim", [576, 4096])
@pytest.mark.parametrize("sigma", [1e-3, 1e-4])
def test_fused_decode_norm_adds_float32_noise_on_cuda(dim, sigma):
    from quarl.kernels.decode_fused import rms_norm_rows

    norm, x, g = _norm_and_rows(dim)
    _write_noise(norm, sigma, g)
    r, h, _, _ = rms_norm_rows(x, None, norm.weight, norm.rollout_noise, norm.eps)
    _, clean, _, _ = rms_norm_rows(x, None, norm.weight, None, norm.eps)
    _changed_enough(h, clean, sigma)
    _one_rounding_of(h, _reference(x, norm.weight, norm.rollout_noise))
    _, zero, _, _ = rms_norm_rows(x, None, norm.weight, torch.zeros_like(norm.rollout_noise), norm.eps)
    assert torch.equal(zero, clean)


def test_graph_captured_with_zero_noise_sees_noise_written_later():
    norm, x, g = _norm_and_rows(4096)
    norm.aqn_enabled = True  # the trainer's first sync enables AQN (σ = 0 in stage 0) before any rollout
    norm.set_rollout(True)
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as the fast engine does before capturing
        out.copy_(norm(x))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(norm(x))
    graph.replay()
    torch.cuda.synchronize()
    _one_rounding_of(out, _reference(x, norm.weight, norm.rollout_noise))  # zero noise
    clean = out.clone()
    _write_noise(norm, 1e-4, g)  # in place, at the address the graph reads
    graph.replay()
    torch.cuda.synchronize()
    _changed_enough(out, clean, 1e-4)
    _one_rounding_of(out, _reference(x, norm.weight, norm.rollout_noise))
