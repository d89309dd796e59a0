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


def test_breakdown_times_the_fused_step_gemms_on_codes_where_the_step_hands_codes(monkeypatch):
    """`--breakdown` times q/k/v and gate/up stacked, o_proj and lm_head on bf16 inputs, and the GEMMs that the
    step feeds FP8 codes (q/k/v, gate/up, down) on codes of their inputs made before the timing."""
    from quarl import kernels
    from quarl.bench.rollout_breakdown import _fused_linear_runs
    from quarl.formats import quantize
    from quarl.rollout import fused_decode
    from quarl.rollout.fused_decode import FusedDecoder, FusedProjection

    model = make_model("qwen2", dtype=torch.float32)
    configure_precision(model, "fp8")
    decoder = FusedDecoder.for_model(model)
    batch, layers = 3, model.config.num_layers
    inputs = {k: torch.randn(batch, k) for k in {model.config.hidden_size, model.config.intermediate_size}}
    model.set_rollout(True)
    try:
        plain = [run() for run in _fused_linear_runs(decoder, model, inputs, batch)]  # no GPU: nothing handed codes
        assert len(plain) == 4 * layers + 1
        assert [t.shape[1] for t in plain[:4]] == [sum(decoder.qkv[0].sizes), model.config.hidden_size,
                                                    sum(decoder.gate_up[0].sizes), model.config.hidden_size]
        seen = []

        def fake_matmul(codes, scales, qweight, bias, dtype):
            seen.append((codes, scales))
            return torch.zeros(codes.shape[0], qweight.shape[0], dtype=dtype)

        monkeypatch.setattr(FusedProjection, "codes_handoff", lambda self, m: "fp8")
        monkeypatch.setattr(fused_decode, "linear_codes_handoff", lambda linear, m, fast_paths: "fp8")
        monkeypatch.setattr(kernels, "matmul_from_codes", fake_matmul)
        runs = _fused_linear_runs(decoder, model, inputs, batch)
        for run in runs:
            run()
    finally:
        model.set_rollout(False)
    assert len(seen) == 3 * layers  # q/k/v, gate/up and down of every layer; o_proj and lm_head take bf16
    want = quantize(inputs[model.config.hidden_size], "fp8", "activation")
    assert torch.equal(seen[0][0].view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(seen[0][1], want.scale)


def test_deferred_scales_option_reads_all_none_or_names():
    import argparse

    from quarl.bench.rollout import _deferred_choice

    assert _deferred_choice("all") is True and _deferred_choice("none") is False
    assert _deferred_choice("qkv, down") == ("qkv", "down")
    for bad in ("", "qkv,gate", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="qkv,o,gate_up,down"):
            _deferred_choice(bad)


def test_settings_put_acting_lora_adapters_on_every_decoder_linear():
    """--lora-rank: every decoder linear gets an adapter of that rank whose B is nonzero (the adapters act in the
    rollout), lm_head none; the next setting without LoRA removes them."""
    from quarl.model.qlinear import QuantLinear

    model = make_model("qwen2", dtype=torch.float32)
    x = torch.randint(0, model.config.vocab_size, (1, 5))
    assert configure_precision(model, "fp8", lora_rank=4) == "fp8"
    decoder = [m for n, m in model.named_modules() if isinstance(m, QuantLinear) and n.startswith("model.layers")]
    assert len(decoder) == 7 * model.config.num_layers
    assert all(m.lora_rank == 4 and m.lora_B.abs().max() > 0 for m in decoder) and not model.lm_head.lora_rank
    model.set_rollout(True)
    with torch.no_grad():
        with_lora = model(x)
    model.set_rollout(False)
    configure_precision(model, "fp8")
    assert all(m.lora_rank == 0 for m in decoder)
    model.set_rollout(True)
    with torch.no_grad():
        assert not torch.equal(model(x), with_lora)
    model.set_rollout(False)


@pytest.mark.parametrize("arch,fmt", [("qwen2", "int8"), ("qwen3_moe", "fp8")])
def test_codes_only_copy_drops_the_weights_and_computes_the_split_rollout(arch, fmt):
    """--rollout-copy codes-only: each quantized linear keeps only its codes and scales (no bf16 weight), lm_head
    stays full precision, and the rollout forward is the split flow's on the same weights, exactly."""
    from quarl.bench.rollout import keep_codes_only
    from quarl.model.precision_apply import rollout_mode
    from quarl.model.qlinear import QuantLinear

    split, codes = make_model(arch, dtype=torch.float32), make_model(arch, dtype=torch.float32)
    codes.load_state_dict(split.state_dict())
    ids = torch.randint(0, split.config.vocab_size, (2, 7))
    configure_precision(split, fmt)
    assert keep_codes_only(codes, fmt) == fmt
    linears = [(n, m) for n, m in codes.named_modules() if isinstance(m, QuantLinear)]
    assert len(linears) > 8
    for name, m in linears:
        if name.endswith("lm_head"):
            assert m.weight is not None and m.rollout_format is None
        else:
            assert m.weight is None and m.qweight_data is not None and m.rollout_format == fmt, name
    with torch.no_grad(), rollout_mode(split), rollout_mode(codes):
        torch.testing.assert_close(codes(ids), split(ids), rtol=0, atol=0)
    assert keep_codes_only(make_model(arch, dtype=torch.float32), "bf16") == "bf16"
