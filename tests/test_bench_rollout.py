"""`quarl bench rollout` settings: parsing (with the "+head" lm_head option) and switching a model between them."""

import pytest
import torch

from quarl.bench.rollout import configure_precision, parse_settings
from tiny_models import make_model


def test_parse_settings_reads_precision_kv_pairs_and_the_head_option():
    assert parse_settings("bf16, fp8:fp8 ,fp8+head:fp8-token,") == [("bf16", "auto"), ("fp8", "fp8"),
                                                                   ("fp8+head", "fp8-token")]


@pytest.mark.parametrize("text", ["bf16+head:auto", "fp9:fp8", "fp8:fp4", "fp8+tail", ","])
def test_parse_settings_rejects_bad_items_with_the_choices(text):
    with pytest.raises(ValueError, match="precision must be one of|no settings given"):
        parse_settings(text)


def test_settings_switch_lm_head_in_and_out_of_the_quantized_format():
    model = make_model("qwen2", dtype=torch.float32)
    x = torch.randn(3, model.config.hidden_size)
    bf16_logits = model.lm_head(x)
    assert configure_precision(model, "fp8+head") == "fp8"
    assert model.lm_head.rollout_format == "fp8"
    assert model.model.layers[0].mlp.down_proj.rollout_format == "fp8"
    model.lm_head.set_rollout(True)
    head_logits = model.lm_head(x)
    model.lm_head.set_rollout(False)
    assert not torch.equal(head_logits, bf16_logits)  # the quantized head rounds its weights and inputs
    assert configure_precision(model, "fp8") == "fp8"
    assert model.lm_head.rollout_format is None
    assert model.model.layers[0].mlp.down_proj.rollout_format == "fp8"
    model.lm_head.set_rollout(True)
    torch.testing.assert_close(model.lm_head(x), bf16_logits, rtol=0, atol=0)
    configure_precision(model, "bf16")
    assert model.model.layers[0].mlp.down_proj.rollout_format is None
