"""precision_apply on a small decoder-shaped module tree made of QuantLinear layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from quarl.formats import quantize
from quarl.model.precision_apply import (
    apply_precision,
    refresh_rollout_weights,
    rollout_mode,
    trainable_parameter_count,
    unquantized_linears,
)
from quarl.model.qlinear import QuantLinear
from quarl.precision import LoraConfig, PrecisionConfig

H, I, V = 64, 96, 50
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TinyRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.rollout = False

    def set_rollout(self, on):
        self.rollout = bool(on)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (QuantLinear(H, H) for _ in range(4))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = QuantLinear(H, I), QuantLinear(H, I)
        self.down_proj = QuantLinear(I, H)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = TinyRMSNorm(H), TinyRMSNorm(H)
        self.self_attn, self.mlp = Attn(), Mlp()

    def forward(self, x):
        h = self.input_layernorm(x)
        a = self.self_attn
        x = x + a.o_proj(a.q_proj(h) * torch.sigmoid(a.k_proj(h)) + a.v_proj(h))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(torch.nn.functional.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class TinyModel(nn.Module):
    def __init__(self, n_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Layer() for _ in range(n_layers))
        self.norm = TinyRMSNorm(H)
        self.lm_head = QuantLinear(H, V)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def linear_names(model, cls=QuantLinear):
    return [n for n, m in model.named_modules() if isinstance(m, cls)]


def expected_names(n_layers=2):
    return [f"layers.{i}.{'self_attn' if p in PROJ[:4] else 'mlp'}.{p}" for i in range(n_layers) for p in PROJ]


@pytest.mark.parametrize("fmt", ["int8", "fp8-block", "nvfp4"])
def test_split_configures_every_decoder_linear_and_skips_lm_head(fmt):
    model = TinyModel()
    names = apply_precision(model, PrecisionConfig(flow="split", format=fmt))
    assert names == expected_names()
    mods = dict(model.named_modules())
    for n in names:
        assert mods[n].rollout_format == fmt and mods[n].train_format is None and mods[n].qweight is not None
        assert mods[n].weight_only == (fmt == "nvfp4")
    assert model.lm_head.rollout_format is None and model.lm_head.qweight is None
    assert unquantized_linears(model, PrecisionConfig(flow="split", format=fmt)) == []
    # no LoRA: everything stays trainable
    assert trainable_parameter_count(model) == sum(p.numel() for p in model.parameters())


def test_quantize_lm_head_includes_it():
    model = TinyModel(1)
    cfg = PrecisionConfig(flow="unified", quantize_lm_head=True)
    names = apply_precision(model, cfg)
    assert names == expected_names(1) + ["lm_head"]
    assert model.lm_head.rollout_format == "fp8-block" and model.lm_head.train_format == "fp8-block"


def test_lora_targets_and_freezing():
    model = TinyModel()
    lora = LoraConfig(rank=4, targets=("q_proj", "v_proj", "down_proj"))
    names = apply_precision(model, PrecisionConfig(flow="split", format="int8", lora=lora))
    assert names == expected_names()
    mods = dict(model.named_modules())
    lora_params = 0
    for n in names:
        m = mods[n]
        assert m.rollout_format == "int8"  # every decoder linear is quantized, with or without an adapter
        if n.split(".")[-1] in lora.targets:
            assert m.lora_rank == 4
            lora_params += m.lora_A.numel() + m.lora_B.numel()
        else:
            assert m.lora_rank == 0 and m.lora_A is None
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert trainable_parameter_count(model) == lora_params
    assert model.lm_head.lora_A is None and not model.lm_head.weight.requires_grad
    assert not model.embed_tokens.weight.requires_grad


def test_lora_train_norms_keeps_norm_weights_trainable():
    model = TinyModel()
    apply_precision(model, PrecisionConfig(flow="split", lora=LoraConfig(rank=2, train_norms=True)))
    norms = {n for n, p in model.named_parameters() if p.requires_grad and "norm" in n}
    assert norms == {"layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
                     "layers.1.input_layernorm.weight", "layers.1.post_attention_layernorm.weight", "norm.weight"}
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert trainable_parameter_count(model) == lora + 5 * H


def test_qlora_flow_drops_master_weights_and_trains_only_adapters():
    model = TinyModel()
    cfg = PrecisionConfig(flow="qlora", lora=LoraConfig(rank=4))
    names = apply_precision(model, cfg)
    mods = dict(model.named_modules())
    for n in names:
        assert mods[n].weight is None and mods[n].frozen_base and mods[n].rollout_format == "nvfp4"
    ids = torch.randint(0, V, (2, 5))
    y_train = model(ids)
    with rollout_mode(model), torch.no_grad():
        y_roll = model(ids)
    assert torch.equal(y_train, y_roll)
    y_train.sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)


def test_refresh_rollout_weights_syncs_every_layer():
    model = TinyModel()
    apply_precision(model, PrecisionConfig(flow="split", format="fp8"))
    ptrs = {n: m.qweight_data.data_ptr() for n, m in model.named_modules() if isinstance(m, QuantLinear)
            and m.qweight is not None}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    refresh_rollout_weights(model)
    for n, m in model.named_modules():
        if n in ptrs:
            assert m.qweight_data.data_ptr() == ptrs[n]
            assert torch.equal(m.qweight.dequantize(), quantize(m.weight, "fp8").dequantize())


def test_rollout_mode_sets_and_restores_flags():
    model = TinyModel()
    apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    flagged = [m for m in model.modules() if hasattr(m, "set_rollout")]
    assert len(flagged) == 2 * 7 + 1 + 2 * 2 + 1  # linears, lm_head, norms
    with rollout_mode(model):
        assert all(m.rollout for m in flagged)
    assert not any(m.rollout for m in flagged)
    with pytest.raises(RuntimeError, match="boom"):
        with rollout_mode(model):
            raise RuntimeError("boom")
    assert not any(m.rollout for m in flagged)
    # and it changes the output: rollout uses the quantized copies
    ids = torch.randint(0, V, (1, 4))
    with torch.no_grad(), rollout_mode(model):
        y_roll = model(ids)
    assert not torch.allclose(model(ids), y_roll, atol=1e-6)


def test_unquantized_linears_finds_plain_and_unconfigured_layers():
    model = TinyModel()
    cfg = PrecisionConfig(flow="split", format="int8")
    model.layers[1].self_attn.q_proj = nn.Linear(H, H, bias=False)  # the name-matching bug: a plain linear
    apply_precision(model, cfg)
    model.layers[0].mlp.extra_proj = QuantLinear(H, H)  # added after apply_precision: never configured
    assert unquantized_linears(model, cfg) == ["layers.0.mlp.extra_proj", "layers.1.self_attn.q_proj"]
    assert unquantized_linears(model, PrecisionConfig(flow="bf16")) == []
    # a layer in another format counts too; lm_head counts only when it should be quantized
    assert "lm_head" in unquantized_linears(model, PrecisionConfig(flow="split", format="int8",
                                                                   quantize_lm_head=True))
    assert len(unquantized_linears(model, PrecisionConfig(flow="split", format="fp8"))) == len(expected_names()) + 1


def test_bad_precision_is_rejected_before_touching_the_model():
    model = TinyModel(1)
    with pytest.raises(ValueError, match="lora.rank"):
        apply_precision(model, PrecisionConfig(flow="qlora"))
    assert all(m.rollout_format is None for m in model.modules() if isinstance(m, QuantLinear))


def test_unified_kernel_forward_is_left_to_the_hidden_size_unless_set():
    """precision.kernel_forward null: the unified flow multiplies on the 8-bit kernels from hidden size
    KERNEL_FORWARD_MIN_HIDDEN on and on bf16 GEMMs of the fake-quantized values below (the rollout too); an explicit
    value wins. apply_precision reads the hidden size from the narrowest configured linear (here H, not I)."""
    from quarl.precision import KERNEL_FORWARD_MIN_HIDDEN

    auto = PrecisionConfig(flow="unified", format="int8")
    assert auto.kernel_forward is None
    assert not auto.resolved_kernel_forward(576) and not auto.resolved_kernel_forward(KERNEL_FORWARD_MIN_HIDDEN - 1)
    assert auto.resolved_kernel_forward(KERNEL_FORWARD_MIN_HIDDEN) and auto.resolved_kernel_forward(None)
    assert PrecisionConfig(flow="unified", kernel_forward=True).resolved_kernel_forward(576)
    assert not PrecisionConfig(flow="unified", kernel_forward=False).resolved_kernel_forward(8192)
    # bf16 GEMMs in both forwards: off the kernels; always for a weight-only unified flow (no weight-only training
    # kernel); never with the FP8 training GEMMs, nor in the split flow, whose training is not quantized
    settings = lambda **kw: PrecisionConfig(**kw).linear_settings(4096)["bf16_gemms"]  # noqa: E731
    assert settings(flow="unified", format="int8", weight_only=True, kernel_forward=True)
    assert not settings(flow="unified", format="int8") and settings(flow="unified", format="int8", kernel_forward=False)
    assert not settings(flow="unified", format="fp8-block", quantized_backward=True, kernel_forward=False)
    assert not settings(flow="split", format="int8", kernel_forward=False)
    assert settings(flow="qlora", format="nvfp4", lora=LoraConfig(rank=2), kernel_forward=False)
    for setting, on_kernels in ((None, False), (True, True), (False, False)):
        model = TinyModel()
        apply_precision(model, PrecisionConfig(flow="unified", format="int8", kernel_forward=setting))
        linears = [m for n, m in model.named_modules() if isinstance(m, QuantLinear) and not n.endswith("lm_head")]
        assert all(m.kernel_forward == on_kernels for m in linears)
        assert all(m.rollout_avoids_kernel() == (not on_kernels) for m in linears)
    split = TinyModel()
    apply_precision(split, PrecisionConfig(flow="split", format="int8", smooth_alpha=0))
    assert not any(m.rollout_avoids_kernel() for m in split.modules() if isinstance(m, QuantLinear))


def test_unified_flow_is_weight_only_on_the_bf16_gemms_the_hidden_size_chose():
    """weight_only null: the unified flow quantizes only the weights where kernel_forward null chose bf16 GEMMs
    (hidden size below KERNEL_FORWARD_MIN_HIDDEN), in both forwards alike; W8A8 from the threshold on, or where
    kernel_forward, weight_only or quantized_backward is set; the split flow stays W8A8 at any size."""
    from quarl.precision import KERNEL_FORWARD_MIN_HIDDEN as MIN

    for fmt in ("int8", "fp8-block", "fp8"):
        auto = PrecisionConfig(flow="unified", format=fmt)
        assert auto.resolved_weight_only_at(576) and auto.resolved_weight_only_at(MIN - 1)
        assert not auto.resolved_weight_only_at(MIN) and not auto.resolved_weight_only_at(None)
        assert auto.linear_settings(576)["weight_only"] and not auto.linear_settings(MIN)["weight_only"]
        for pinned in (dict(kernel_forward=True), dict(kernel_forward=False), dict(weight_only=False),
                       dict(unified_weight_only_on_bf16=False)):
            assert not PrecisionConfig(flow="unified", format=fmt, **pinned).resolved_weight_only_at(576), pinned
    assert not PrecisionConfig(flow="unified", quantized_backward=True).resolved_weight_only_at(576)
    assert not PrecisionConfig(flow="split", format="int8").resolved_weight_only_at(576)
    model = TinyModel()  # hidden size H, far below the threshold
    apply_precision(model, PrecisionConfig(flow="unified", format="int8"))
    linears = [m for n, m in model.named_modules() if isinstance(m, QuantLinear) and not n.endswith("lm_head")]
    assert linears and all(m.weight_only and m.bf16_gemms and not m.kernel_forward for m in linears)
    x = torch.randn(3, H)
    layer = linears[0]
    # both forwards multiply x itself (not its 8-bit rounding) by the dequantized weight
    expected = x.double() @ layer.weight_dequant.double().T
    for rollout in (False, True):
        layer.set_rollout(rollout)
        assert torch.allclose(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    layer.set_rollout(False)


def test_a_unified_run_saved_before_the_weight_only_default_resumes_w8a8(tmp_path):
    """A config.yaml written before `precision.unified_weight_only_on_bf16` existed resumes W8A8 on bf16 GEMMs, as
    that run computed; a config saved with the key resumes as saved."""
    import yaml

    from quarl.api import _resumed
    from quarl.config import config_to_dict, load_config

    data = config_to_dict(load_config(None, ["precision.flow=unified"]))
    old = {**data, "precision": {k: v for k, v in data["precision"].items() if k != "unified_weight_only_on_bf16"}}
    for saved, weight_only in ((old, False), (data, True)):
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
        config, overrides = _resumed(None, {"resume": str(tmp_path)})
        resumed = load_config(config, [f"{k}={v}" for k, v in overrides.items()]).precision
        assert resumed.weight_only is None and resumed.resolved_weight_only_at(576) == weight_only


@pytest.mark.parametrize("flow,fmt", [("unified", "int8"), ("unified", "fp8-block"), ("qlora", "nvfp4")])
def test_the_hidden_size_decides_where_both_forwards_multiply(monkeypatch, flow, fmt):
    """Around the threshold: the narrowest input (H = 64 here, not the MLP's I = 96) decides for a module tree
    without a config; a model's config.hidden_size decides for a decoder, so that a mixture of experts' narrow
    expert width (moe_intermediate_size 32 < hidden 96) does not."""
    from quarl import precision as precision_module
    from quarl.model.precision_apply import hidden_size
    from tiny_models import make_model

    lora = LoraConfig(rank=2) if flow == "qlora" else LoraConfig()
    for threshold, on_kernels in ((H + 1, False), (H, True)):
        monkeypatch.setattr(precision_module, "KERNEL_FORWARD_MIN_HIDDEN", threshold)
        model = TinyModel()
        pc = PrecisionConfig(flow=flow, format=fmt, lora=lora)
        assert hidden_size(model, pc) == H
        apply_precision(model, pc)
        linears = [m for n, m in model.named_modules() if isinstance(m, QuantLinear) and not n.endswith("lm_head")]
        assert all(m.bf16_gemms == (not on_kernels) for m in linears), threshold
    moe = make_model("qwen3_moe", hidden_size=96)
    monkeypatch.setattr(precision_module, "KERNEL_FORWARD_MIN_HIDDEN", 90)
    pc = PrecisionConfig(flow=flow, format=fmt, lora=lora)
    assert hidden_size(moe, pc) == 96
    apply_precision(moe, pc)
    assert not any(m.bf16_gemms for m in moe.modules() if isinstance(m, QuantLinear))
