"""The unified flow computes one function in rollout and training on real shapes (SmolLM2's hidden size 576 is
not a multiple of 128); the full-precision view of a quantized model; precision settings the unified flow refuses."""

import types
import warnings

import pytest
import torch

from quarl.config import ConfigError, load_config
from quarl.model.precision_apply import apply_precision, full_precision, rollout_mode
from quarl.model.qlinear import QuantLinear
from quarl.precision import PrecisionConfig
from quarl.rl.trainer import Trainer
from tiny_models import make_model

# SmolLM2-135M's layer shapes (9 heads of 64, 3 KV heads, MLP 1536), two layers.
SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64, num_layers=2)


def _logits(model, ids, rollout: bool):
    with torch.no_grad():
        if rollout:
            with rollout_mode(model):
                return model(ids)
        return model(ids)


@pytest.mark.parametrize("weight_only", [False, None])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "nvfp4", "mxfp4"])
def test_unified_rollout_and_training_forward_are_one_function_on_smollm2_shapes(fmt, weight_only):
    """Bit-identical logits from the rollout forward and the training forward of the unified flow over the same
    tokens, W8A8 (weight_only false) and as the default resolves at this hidden size (weight-only); the split
    flow's two forwards differ on the same model (what the test would see if unified were not on-policy)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (3, 11))
    for flow in ("unified", "split"):
        model = make_model("llama", std=0.05, **SMOLLM2_SHAPES)
        wo = weight_only if flow == "unified" and fmt not in ("nvfp4", "mxfp4") else None  # fp4: always W4A16
        apply_precision(model, PrecisionConfig(flow=flow, format=fmt, weight_only=wo))
        assert all(m.rollout_format == fmt for n, m in model.named_modules()
                   if isinstance(m, QuantLinear) and not n.endswith("lm_head"))
        same = torch.equal(_logits(model, ids, rollout=True), _logits(model, ids, rollout=False))
        assert same == (flow == "unified"), (flow, fmt)


def test_full_precision_view_computes_the_master_weights_and_restores_formats():
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 9))
    plain = make_model("llama", std=0.05, **SMOLLM2_SHAPES)
    reference = _logits(plain, ids, rollout=False)
    apply_precision(plain, PrecisionConfig(flow="split", format="int8"))
    quantized = _logits(plain, ids, rollout=True)
    assert not torch.equal(quantized, reference)
    with full_precision(plain):
        assert torch.equal(_logits(plain, ids, rollout=True), reference)
    assert torch.equal(_logits(plain, ids, rollout=True), quantized)  # formats back


def test_unified_refuses_batch_dependent_fp8_tensor_activations():
    with pytest.raises(ConfigError, match="fp8-tensor.*per-token"):
        load_config(None, ["precision.flow=unified", "precision.format=fp8-tensor"])
    load_config(None, ["precision.flow=split", "precision.format=fp8-tensor"])  # rollout only: allowed
    load_config(None, ["precision.flow=unified", "precision.format=fp8-tensor", "precision.weight_only=true"])


@pytest.mark.parametrize("quantized,full,warns", [(0.055, 0.234, True), (0.297, 0.438, False), (0.01, 0.03, False)])
def test_warns_when_the_rollout_format_loses_most_of_the_accuracy(quantized, full, warns):
    cfg = load_config(None, ["precision.flow=split", "precision.format=nvfp4"])
    trainer = types.SimpleNamespace(cfg=cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer.warn_if_rollout_format_too_lossy(trainer, {"eval/accuracy": quantized, "eval_full/accuracy": full})
    assert any("nvfp4 rollout model scores" in str(w.message) for w in caught) == warns
