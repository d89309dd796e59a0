"""UAQ keeps the network's function; AQN perturbs exactly the rollout model's targeted norms with the scheduled σ."""

import textwrap

import pytest
import torch

from quarl.model.decoder import QuarlForCausalLM
from quarl.model.tiny import tiny_config
from quarl.rl.aqn import aqn_sigma, noised_norms, set_aqn_noise
from quarl.rl.uaq import apply_uaq


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_uaq_preserves_function_in_float64(arch):
    model = QuarlForCausalLM(tiny_config(arch)).double()
    with torch.no_grad():  # random norm weights so the test would catch a missing fold
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 256, (2, 12))
    ref = model(ids)
    q_before = model.model.layers[0].self_attn.q_proj.weight.clone()
    o_before = model.model.layers[0].self_attn.o_proj.weight.clone()
    assert apply_uaq(model, 1.5) == 5 * len(model.model.layers)
    torch.testing.assert_close(model(ids), ref, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj.weight, q_before / 1.5)
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, o_before)  # never folded into o/down


def test_uaq_rejects_bad_scale():
    with pytest.raises(ValueError, match="> 0"):
        apply_uaq(QuarlForCausalLM(tiny_config("llama")), 0.0)


def test_aqn_schedule():
    s0, s1, K = 1e-2, 1e-4, 10
    total = 100
    assert aqn_sigma(0, total, s0, s1, K) == 0.0 and aqn_sigma(9, total, s0, s1, K) == 0.0  # stage 0
    assert aqn_sigma(10, total, s0, s1, K) == pytest.approx(s0)  # first noisy stage
    assert aqn_sigma(99, total, s0, s1, K) == pytest.approx(s1)  # last stage
    mid = [aqn_sigma(10 * k, total, s0, s1, K) for k in range(1, K)]
    ratios = [b / a for a, b in zip(mid, mid[1:])]
    assert ratios == pytest.approx([ratios[0]] * len(ratios))  # exponential decay
    assert aqn_sigma(50, total, 0.0, 0.0, K) == 0.0


def test_aqn_changes_only_rollout_norms():
    torch.manual_seed(0)
    model = QuarlForCausalLM(tiny_config("llama"))
    ids = torch.randint(0, 256, (2, 8))
    train_ref = model(ids)
    norms = noised_norms(model)
    assert len(norms) == 2 * len(model.model.layers)
    sigma = 0.05
    set_aqn_noise(model, sigma, torch.Generator().manual_seed(1))
    noise = torch.cat([n.rollout_noise.flatten() for n in norms])
    assert noise.std().item() == pytest.approx(sigma, rel=0.25)
    assert torch.equal(model.model.norm.rollout_noise, torch.zeros_like(model.model.norm.rollout_noise))
    torch.testing.assert_close(model(ids), train_ref)  # the training forward never sees the noise
    model.set_rollout(True)
    try:
        noisy = model(ids)
        eff = norms[0].effective_weight()
        torch.testing.assert_close(eff, norms[0].weight + norms[0].rollout_noise)
    finally:
        model.set_rollout(False)
    assert not torch.allclose(noisy, train_ref, atol=1e-4)
    set_aqn_noise(model, 0.0)
    assert all(n.rollout_noise.abs().sum() == 0 for n in norms)


# ----------------------------------------------------------------------------------- AQN noise kept in float32
# A bf16 model's norm weights are near 1, where one bf16 ulp is 2^-7 = 0.0078: noise of σ <= 1e-3 added in bf16
# rounds away (or becomes sparse one-ulp jumps). The noise is kept in float32 and added to the weight in float32
# inside the norm, y = bf16((x * rsqrt(mean(x^2) + eps)) * (w + noise)).
#
# Tolerance of the outputs against the float64 reference bf16((x64 * rsqrt(mean(x64^2) + eps)) * (w64 + n64)):
# the float32 computation is within a few float32 ulps of it, so a bf16 output can differ from the reference only
# where the exact value lies within ~1e-7 (relative) of a bf16 rounding boundary: every element within one bf16
# rounding (2^-7 relative) and at most 0.1 % of elements not identical. Adding the noise in bf16 instead leaves
# far more elements different from that reference, and at σ = 1e-4 an output almost equal to the noiseless one.

BF16 = torch.bfloat16


def _bf16_norm(dim, sigma, seed=0):
    """A bf16 RMSNorm with weights 1 + 0.3 N(0, 1) and float32 N(0, σ²) noise written in place, plus bf16 rows."""
    from quarl.model.layers import RMSNorm

    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(dim, dtype=BF16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=g))
        norm.rollout_noise.copy_(torch.randn(dim, generator=g) * sigma)
    norm.aqn_enabled = True  # as set_aqn_noise does
    x = (torch.randn(64, dim, generator=g) * 2).to(BF16)
    return norm, x


def _reference(x, weight, noise, eps=1e-6):
    """float64 RMSNorm of x with weight w + noise (both widened exactly to float64), rounded once to x's dtype."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (weight.double() + noise.double())).to(x.dtype)


def _one_rounding_of(got, want, max_fraction=1e-3):
    g, w = got.float(), want.float()
    assert bool(((g - w).abs() <= w.abs() * 2.0**-7 + 1e-30).all()), (g - w).abs().max()
    frac = (g != w).float().mean().item()
    assert frac <= max_fraction, f"{frac:.2%} of the elements differ from the float64 reference"


@pytest.mark.parametrize("dim", [576, 4096])  # SmolLM2-135M's hidden size; a 7B's
@pytest.mark.parametrize("sigma", [1e-3, 1e-4])
def test_aqn_small_noise_reaches_a_bf16_norm(dim, sigma):
    norm, x = _bf16_norm(dim, sigma)
    assert norm.rollout_noise.dtype == torch.float32
    clean = norm(x)  # training mode: no noise
    norm.set_rollout(True)
    noisy = norm(x)
    assert noisy.dtype == BF16
    # The noise shows: bf16 rounding alone leaves ~1.7 % (σ = 1e-4) / ~16 % (σ = 1e-3) of the outputs changed.
    changed = (noisy != clean).float().mean().item()
    assert changed >= (0.005 if sigma == 1e-4 else 0.05), changed
    _one_rounding_of(noisy, _reference(x, norm.weight, norm.rollout_noise))
    # The weight the rollout forward uses is w + noise in float32: its deviation from w has std σ (±10 %).
    eff = norm.effective_weight()
    assert eff.dtype == torch.float32
    assert abs((eff - norm.weight.float()).std().item() / sigma - 1) < 0.1


@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("sigma", [1e-3, 1e-4])
def test_aqn_set_noise_on_a_bf16_model_is_float32_with_std_sigma(hidden, sigma):
    model = QuarlForCausalLM(tiny_config("llama", hidden_size=hidden)).to(BF16)
    assert set_aqn_noise(model, sigma, torch.Generator().manual_seed(2)) == 2 * len(model.model.layers)
    for norm in noised_norms(model):
        assert norm.weight.dtype == BF16 and norm.rollout_noise.dtype == torch.float32
        norm.set_rollout(True)
        dev = norm.effective_weight() - norm.weight.float()
        norm.set_rollout(False)
        assert abs(dev.std().item() / sigma - 1) < 0.1, dev.std().item()  # bf16 noise: 0 (1e-4) or sparse ulps
        torch.testing.assert_close(dev, norm.rollout_noise, atol=2.0**-22, rtol=0)  # float32 rounding of w + noise


def test_aqn_noise_buffer_stays_float32_through_casts():
    from quarl.model.layers import RMSNorm

    assert RMSNorm(8, dtype=BF16).rollout_noise.dtype == torch.float32
    model = QuarlForCausalLM(tiny_config("qwen3"))  # q_norm / k_norm too
    set_aqn_noise(model, 1e-3, torch.Generator().manual_seed(3))
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    before = [n.rollout_noise.clone() for n in norms]
    assert any(not torch.equal(b, b.to(BF16).float()) for b in before)  # a round trip through bf16 would show
    for cast in (lambda m: m.to(BF16), lambda m: m.half(), lambda m: m.double(), lambda m: m.to(torch.float32),
                 lambda m: m.bfloat16()):
        cast(model)
        for n, b in zip(norms, before):
            assert n.rollout_noise.dtype == torch.float32
            assert torch.equal(n.rollout_noise, b)  # the values of before the cast, not rounded through it
    assert model.model.layers[0].input_layernorm.weight.dtype == BF16
    # A norm whose buffer is not float32 is refused rather than fed rounded noise.
    norm = noised_norms(model)[0]
    norm._buffers["rollout_noise"] = norm.rollout_noise.to(BF16)
    with pytest.raises(TypeError, match="float32"):
        set_aqn_noise(model, 1e-3)


def test_aqn_training_forward_of_a_bf16_model_is_unaffected():
    torch.manual_seed(0)
    model = QuarlForCausalLM(tiny_config("llama")).to(BF16)
    ids = torch.randint(0, 256, (2, 8))
    train_ref = model(ids)
    model.set_rollout(True)
    rollout_clean = model(ids)
    model.set_rollout(False)
    assert torch.equal(rollout_clean, train_ref)  # rollout without noise is the training forward, bit for bit
    set_aqn_noise(model, 1e-3, torch.Generator().manual_seed(4))
    assert torch.equal(model(ids), train_ref)  # the training forward never sees the noise
    model.set_rollout(True)
    noisy = model(ids)
    model.set_rollout(False)
    assert not torch.equal(noisy, train_ref)
    set_aqn_noise(model, 0.0)
    model.set_rollout(True)
    assert torch.equal(model(ids), train_ref)  # cleared noise: back to the training forward
    model.set_rollout(False)


_FUSED_NORM_NOISE_CHECK = textwrap.dedent("""
    import torch
    from quarl.kernels.decode_fused import rms_norm_rows

    def reference(r, w, noise, eps=1e-6):
        r64 = r.double()
        normed = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (w.double() + noise.double())).to(r.dtype)

    g = torch.Generator().manual_seed(5)
    for h in (576, 4096):
        for sigma in (1e-3, 1e-4):
            x = (torch.randn(16, h, generator=g) * 2).bfloat16()
            d = torch.randn(16, h, generator=g).bfloat16()
            w = (1 + 0.3 * torch.randn(h, generator=g)).bfloat16()
            noise = torch.randn(h, generator=g) * sigma  # float32, as RMSNorm keeps it
            r, hh, _, _ = rms_norm_rows(x, d, w, noise, 1e-6)
            assert torch.equal(r, x + d)
            _, clean, _, _ = rms_norm_rows(x, d, w, None, 1e-6)
            changed = (hh != clean).float().mean().item()
            assert changed >= (0.005 if sigma == 1e-4 else 0.05), (h, sigma, changed)
            want = reference(r, w, noise)
            got, ref = hh.float(), want.float()
            assert bool(((got - ref).abs() <= ref.abs() * 2.0**-7 + 1e-30).all()), (h, sigma)
            frac = (got != ref).float().mean().item()
            assert frac <= 1e-3, (h, sigma, frac)
            _, zero, _, _ = rms_norm_rows(x, d, w, torch.zeros(h), 1e-6)
            assert torch.equal(zero, clean)  # zero noise: the noiseless kernel's values, bit for bit
    print("ok")
""")


def test_fused_norm_kernel_adds_float32_noise_in_the_interpreter():
    """The fused decode norm (`rms_norm_rows`, Triton's CPU interpreter) adds float32 noise to the bf16 weight in
    float32: the same tolerance against the float64 reference as the module (one bf16 rounding, <= 0.1 % of the
    elements not identical), visible at σ = 1e-4, and bit for bit the noiseless kernel with zero noise."""
    from interpreter import INTERPRETER_PATCH, run_in_interpreter

    run_in_interpreter(INTERPRETER_PATCH + _FUSED_NORM_NOISE_CHECK)


def test_aqn_noise_is_one_draw_split_over_the_norms_in_order():
    """The norms' buffers, concatenated in `noised_norms` order, are one float32 draw of N(0, σ²) from the
    generator: each norm gets its own slice (no two share values, none is left unwritten). A hidden size that is
    not a multiple of 16 makes one draw differ from a draw per norm (torch's CPU normal sampler fills 16 at a
    time)."""
    model = QuarlForCausalLM(tiny_config("llama", hidden_size=72)).to(BF16)
    sigma = 3e-3
    set_aqn_noise(model, sigma, torch.Generator().manual_seed(5))
    got = torch.cat([norm.rollout_noise.reshape(-1) for norm in noised_norms(model)])
    want = torch.randn(got.numel(), generator=torch.Generator().manual_seed(5), dtype=torch.float32) * sigma
    assert torch.equal(got, want)
    set_aqn_noise(model, 0.0)
    assert all(not norm.rollout_noise.any() for norm in noised_norms(model))
