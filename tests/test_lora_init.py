"""LoRA adapters started as the correction of a quantized base's error (`lora.init=base_error`,
quarl/model/lora_init.py): the closed form against a float64 SVD reference, the split of the product, and the run
that uses it."""

from __future__ import annotations

import pytest
import torch

from quarl.config import load_config
from quarl.model.lora_init import DAMP, base_error_adapters
from quarl.model.precision_apply import apply_precision
from quarl.model.qlinear import QuantLinear
from quarl.precision import LoraConfig, PrecisionConfig
from test_gptq import _calibrated, _logits, _trainer
from tiny_models import rand_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(out_features: int, in_features: int, tokens: int):
    """(residual [out, in], Hessian X^T X [in, in]) float32 from fresh random draws; X has a few loud channels, as a
    layer's inputs do, so the weighting matters."""
    residual = torch.randn(out_features, in_features) * 0.01
    x = torch.randn(tokens, in_features)
    x[:, torch.randperm(in_features)[:3]] *= 10.0
    return residual, x.t() @ x


def _damped_root(hessian: torch.Tensor) -> torch.Tensor:
    """L [in, in] float64 with L L^T = the Hessian damped as base_error_adapters damps it."""
    h = hessian.double()
    return torch.linalg.cholesky(h + torch.eye(h.shape[0], dtype=h.dtype) * DAMP * h.diagonal().mean())


@pytest.mark.parametrize("out_features,in_features,rank", [
    (48, 72, 8),  # out <= in: the eigenvectors of R H R^T
    (96, 40, 8),  # out > in: through the Cholesky factor, from the input side
    (192, 576, 32),  # SmolLM2-135M's k_proj at the B6 rank
    (1536, 576, 32),  # its gate_proj / up_proj
])
def test_the_adapters_reach_the_best_rank_r_output_error(out_features, in_features, rank):
    """||(R - B A) L||_F^2 equals the float64 optimum over rank-r products (the squared singular values of R L past
    the r-th, Eckart-Young) within 1e-4 relative, and is well below the error without adapters."""
    residual, hessian = _problem(out_features, in_features, tokens=2 * in_features)
    a, b = base_error_adapters(residual, hessian, rank)
    assert a.shape == (rank, in_features) and b.shape == (out_features, rank)
    assert a.dtype == b.dtype == torch.float32
    root = _damped_root(hessian)
    m = residual.double() @ root
    singular = torch.linalg.svdvals(m)
    best = singular[rank:].pow(2).sum()
    got = ((residual.double() - b.double() @ a.double()) @ root).pow(2).sum()
    assert torch.isclose(got, best, rtol=1e-4), (got.item(), best.item())
    assert got < 0.9 * singular.pow(2).sum()


def test_each_rank_one_part_has_equal_norms_in_a_and_b():
    """B's column i and A's row i have the same norm (float32 round-off), so neither factor starts tiny."""
    residual, hessian = _problem(64, 80, tokens=200)
    a, b = base_error_adapters(residual, hessian, 6)
    assert torch.allclose(b.norm(dim=0), a.norm(dim=1), rtol=1e-4)
    assert (a.norm(dim=1) > 0).all()


@pytest.mark.parametrize("out_features,in_features,rank", [(8, 24, 12), (30, 12, 16)])
def test_a_rank_past_the_matrix_rank_corrects_the_whole_error(out_features, in_features, rank):
    """rank >= min(out, in), either branch: B A = R itself (every singular direction kept; float32 factors, so
    1e-4 relative), and the factors' parts past min(out, in) are zero."""
    residual, hessian = _problem(out_features, in_features, tokens=60)
    a, b = base_error_adapters(residual, hessian, rank)
    assert torch.allclose(b @ a, residual, atol=1e-7, rtol=1e-4)
    kept = min(out_features, in_features)
    assert not a[kept:].any() and not b[:, kept:].any()


def test_bad_arguments_are_refused_and_non_finite_inputs_give_no_start():
    residual, hessian = _problem(8, 16, tokens=40)
    with pytest.raises(ValueError, match=r"hessian must be \[16, 16\]"):
        base_error_adapters(residual, hessian[:8, :8], 4)
    with pytest.raises(ValueError, match="rank >= 1"):
        base_error_adapters(residual, hessian, 0)
    hessian[3, 3] = float("nan")
    assert base_error_adapters(residual, hessian, 4) is None
    tall, tall_hessian = _problem(16, 8, tokens=40)
    tall_hessian[2, 2] = -1e6  # not positive definite: the Cholesky branch cannot factorise it
    assert base_error_adapters(tall, tall_hessian, 4) is None


@pytest.mark.parametrize("alpha", [4.0, 8.0])
def test_a_started_adapter_adds_exactly_b_times_a(alpha):
    """`QuantLinear.start_lora_at(a, b)` makes the LoRA term x (b a)^T whatever alpha / rank is (float64 reference,
    1e-5)."""
    torch.manual_seed(0)
    lin = QuantLinear(72, 40, bias=True)
    lin.configure(lora_rank=4, lora_alpha=alpha)
    a, b = torch.randn(4, 72), torch.randn(40, 4)
    lin.start_lora_at(a, b)
    x = torch.randn(5, 72)
    want = x.double() @ lin.weight.double().t() + lin.bias.double() + x.double() @ (b.double() @ a.double()).t()
    assert torch.allclose(lin(x).double(), want, atol=1e-5)
    with pytest.raises(ValueError, match="must be"):
        lin.start_lora_at(a[:, :8], b)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_base_error_adapters_bring_the_qlora_model_much_closer_to_full_precision(arch):
    """Model level: on a GPTQ base, the adapters from `gptq_base(adapters=...)` make the logits' squared error to the
    full-precision model at most half of the base's alone (seed 0: about a third), on the calibration prompts and on
    held-out ones; every linear with codes gets adapters."""
    adapters: dict = {}
    model, codes, batches = _calibrated(arch, adapters=adapters, adapter_rank=4)
    assert set(adapters) == set(codes)
    held_out = torch.tensor(rand_prompts([16] * 32))
    want, want_held = _logits(model, batches, held_out)
    apply_precision(model, PrecisionConfig(flow="qlora", format="nvfp4", lora=LoraConfig(rank=4)))
    for linear, qt in codes.items():
        linear.load_frozen_base_codes(qt)
    base, base_held = _logits(model, batches, held_out)
    for linear, (a, b) in adapters.items():
        linear.start_lora_at(a, b)
    got, got_held = _logits(model, batches, held_out)
    assert (got - want).pow(2).sum() < 0.5 * (base - want).pow(2).sum()
    assert (got_held - want_held).pow(2).sum() < 0.5 * (base_held - want_held).pow(2).sum()


def test_a_qlora_run_starts_its_adapters_at_the_base_error_correction(tmp_path):
    """A fresh qlora run on a GPTQ base starts its adapters at a nonzero B by default (lora.init=zeros: at 0), its
    first step trains, and a resume restores the trained adapters rather than starting them again."""
    plain = _trainer(tmp_path / "zeros", 1, "lora.init=zeros")
    started = _trainer(tmp_path, 1)
    lin = started.model.model.layers[0].self_attn.q_proj
    assert lin.lora_B.abs().sum() > 0
    assert plain.model.model.layers[0].self_attn.q_proj.lora_B.abs().sum() == 0
    assert started.train()["step"] == 1
    trained = lin.lora_B.detach().clone()
    started.close()
    plain.close()
    resumed = _trainer(tmp_path, 2, f"resume={tmp_path / 'run'}")
    resumed.prepare_run_dir()
    assert torch.equal(resumed.model.model.layers[0].self_attn.q_proj.lora_B.detach(), trained)
    resumed.close()


def test_a_resumed_run_keeps_its_kl_reference_at_the_start(tmp_path):
    """With a KL penalty, the reference is the policy the run started from (base + started adapters), also after a
    resume, which restores the start from the run directory (the checkpoint holds the trained adapters only)."""
    kl = ("lora.init=base_error", "loss.kl_coef=0.01")
    first = _trainer(tmp_path, 1, *kl)
    start = first.reference.model.layers[0].self_attn.q_proj.lora_B.detach().clone()
    assert start.abs().sum() > 0
    assert first.train()["step"] == 1
    first.close()
    resumed = _trainer(tmp_path, 2, f"resume={tmp_path / 'run'}", *kl)
    resumed.prepare_run_dir()
    assert torch.equal(resumed.reference.model.layers[0].self_attn.q_proj.lora_B.detach(), start)
    resumed.close()


def test_linears_without_adapters_are_left_alone(tmp_path):
    """lora.targets=[q_proj]: q_proj's adapters start at the correction, the other linears have none and train."""
    trainer = _trainer(tmp_path, 1, "lora.init=base_error", "lora.targets=[q_proj]")
    attn = trainer.model.model.layers[0].self_attn
    assert attn.q_proj.lora_B.abs().sum() > 0 and attn.k_proj.lora_rank == 0
    assert trainer.train()["step"] == 1
    trainer.close()


@pytest.mark.parametrize("overrides,want", [
    (["precision.flow=qlora", "lora.rank=8"], "base_error"),  # GPTQ nvfp4: the measured case
    (["precision.flow=qlora", "precision.format=int8", "lora.rank=8"], "zeros"),
    (["precision.flow=qlora", "lora.rank=8", "precision.base_quantizer=rtn"], "zeros"),
    (["precision.flow=qlora", "lora.rank=8", "lora.init=zeros"], "zeros"),
    (["precision.flow=qlora", "precision.format=int8", "lora.rank=8", "lora.init=base_error"], "base_error"),
    (["precision.flow=bf16", "lora.rank=8"], "zeros"),
    (["precision.flow=split", "lora.rank=8"], "zeros"),
])
def test_the_default_start_is_the_base_error_correction_only_on_a_gptq_nvfp4_base(overrides, want):
    from quarl.config import effective_config_dict

    cfg = load_config(None, overrides)
    assert cfg.precision.resolved_lora_init == want
    assert effective_config_dict(cfg)["lora"]["init"] == want


@pytest.mark.parametrize("overrides,match", [
    (["precision.flow=split", "lora.rank=8", "lora.init=base_error"], "lora.init=base_error starts the adapters"),
    (["precision.flow=qlora", "lora.rank=8", "precision.base_quantizer=rtn", "lora.init=base_error"],
     "base_quantizer=rtn"),
    (["precision.flow=qlora", "lora.rank=8", "lora.init=loftq"], "choose one of"),
])
def test_base_error_init_is_refused_where_it_does_not_apply(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)
