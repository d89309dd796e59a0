"""GPTQ for the qlora base (quarl/model/gptq.py, `precision.base_quantizer`): the codes against RTN and against the
output error they minimise, batching, the model-level calibration, the trainer, resume and export.

Exactness: with an identity Hessian no error moves, so GPTQ must give RTN's codes and scales bit for bit
(`quarl.formats.quantize`). The output error ||X W^T - X Q^T||^2 / ||X W^T||^2 is computed in float64."""

from __future__ import annotations

import pytest
import torch

from quarl.config import load_config
from quarl.formats import quantize
from quarl.model.gptq import (BASE_CODES_FILE, gptq_base, gptq_quantize, gptq_quantize_many, load_base_codes,
                              save_base_codes)
from quarl.model.precision_apply import apply_precision
from quarl.model.qlinear import QuantLinear
from quarl.model.smoothing import calibration_batches
from quarl.precision import LoraConfig, PrecisionConfig
from tiny_models import make_model, rand_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
FORMATS = ["nvfp4", "mxfp4", "int8"]


def same_codes(a, b) -> bool:
    def raw(t):
        return None if t is None else t.reshape(-1).view(torch.uint8) if t.dtype.itemsize == 1 else t.reshape(-1)

    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in ((raw(a.data), raw(b.data)), (raw(a.scale), raw(b.scale)),
                            (raw(a.global_scale), raw(b.global_scale)))) and tuple(a.shape) == tuple(b.shape)


def output_error(w: torch.Tensor, qt, x: torch.Tensor) -> float:
    """||x w^T - x deq(qt)^T||^2 / ||x w^T||^2 in float64 for w [out, in], its quantized qt and inputs x
    [tokens, in]: the relative output error GPTQ minimises."""
    w64, q64, x64 = w.double(), qt.dequantize(torch.float64), x.double()
    ref = x64 @ w64.t()
    return float(((ref - x64 @ q64.t()) ** 2).sum() / (ref ** 2).sum())


def correlated_inputs(tokens: int, k: int, mix: torch.Tensor | None = None) -> torch.Tensor:
    """Inputs [tokens, k] with channels correlated through `mix` [k, k] (default: a fresh one) and a few outlier
    channels, as a decoder's linears see."""
    mix = torch.randn(k, k) * 0.1 + torch.eye(k) if mix is None else mix
    x = torch.randn(tokens, k) @ mix
    x[:, :3] *= 20.0
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(576, 576), (192, 1536), (70, 40)])  # SmolLM2's; K not a multiple of a block
def test_with_an_identity_hessian_gptq_gives_rtn_codes(fmt, shape):
    w = torch.randn(*shape) * torch.exp(torch.randn(shape[0], 1))
    got = gptq_quantize(w, torch.eye(shape[1]), fmt)
    assert same_codes(got, quantize(w, fmt, "weight"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gptq_lowers_the_output_error_it_minimises(fmt):
    w = torch.randn(192, 576) * 0.05
    mix = torch.randn(576, 576) * 0.1 + torch.eye(576)
    x = correlated_inputs(2000, 576, mix)
    gptq, rtn = gptq_quantize(w, x.t() @ x, fmt), quantize(w, fmt, "weight")
    # on other inputs from the same distribution too: not an overfit to the calibration tokens
    held_out = correlated_inputs(2000, 576, mix)
    assert output_error(w, gptq, x) < 0.5 * output_error(w, rtn, x)
    assert output_error(w, gptq, held_out) < 0.7 * output_error(w, rtn, held_out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_weights_at_once_equal_one_at_a_time(fmt):
    """Linears that share an input are stacked along rows, and inputs of like shape are batched: every weight gets
    exactly the codes it gets alone with its own Hessian."""
    x1, x2 = correlated_inputs(500, 200), torch.randn(300, 200)
    weights = [[torch.randn(64, 200), torch.randn(32, 200) * 0.01], [torch.randn(64, 200) * 3, torch.randn(32, 200)]]
    many = gptq_quantize_many(weights, torch.stack([x1.t() @ x1, x2.t() @ x2]), fmt)
    for ws, h, results in zip(weights, (x1.t() @ x1, x2.t() @ x2), many):
        for w, got in zip(ws, results):
            assert same_codes(got, gptq_quantize(w, h, fmt))


def test_a_hessian_that_cannot_be_factorised_falls_back_to_rtn_and_says_so(monkeypatch):
    """One input's Hessian is not positive definite (here negative): damping it more cannot help, so its linears
    keep round-to-nearest codes and the fallback is reported; the other input in the same batch still gets GPTQ."""
    from quarl import fallbacks

    monkeypatch.setattr(fallbacks, "_reported", {})
    w1, w2 = torch.randn(32, 64), torch.randn(32, 64)
    x = correlated_inputs(300, 64)
    bad, good = gptq_quantize_many([[w1], [w2]], torch.stack([-torch.eye(64), x.t() @ x]), "nvfp4")
    assert same_codes(bad[0], quantize(w1, "nvfp4", "weight"))
    assert same_codes(good[0], gptq_quantize(w2, x.t() @ x, "nvfp4"))
    assert not same_codes(good[0], quantize(w2, "nvfp4", "weight"))
    assert "1 input Hessian(s) could not be factorised" in fallbacks.reported_fallbacks()["GPTQ"]


def test_unseen_input_channels_and_bad_arguments():
    w = torch.randn(32, 64)
    x = torch.randn(100, 64)
    x[:, 7] = 0.0  # a channel the calibration never saw: rounded alone, no NaN from the zero diagonal
    got = gptq_quantize(w, x.t() @ x, "nvfp4")
    assert torch.isfinite(got.dequantize()).all()
    with pytest.raises(ValueError, match="GPTQ quantizes nvfp4, mxfp4, int8, not 'fp8'"):
        gptq_quantize(w, x.t() @ x, "fp8")
    with pytest.raises(ValueError, match=r"must be \[1, 64, 64\]"):
        gptq_quantize(w, torch.eye(32), "int8")


def _calibrated(arch: str = "llama", fmt: str = "nvfp4", adapters: dict | None = None, adapter_rank: int = 0):
    """(model in full precision, its GPTQ codes, the calibration batches) of a tiny model whose norms give its
    linears a few outlier input channels, as trained models have; adapters / adapter_rank as for `gptq_base`."""
    torch.manual_seed(0)
    model = make_model(arch)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[1, 5]] *= 20.0
    # ~1000 tokens: well over the widest input (128), as a real calibration is over a model's
    batches = list(calibration_batches(rand_prompts([24, 20, 28, 16] * 12), "cpu"))
    return model, gptq_base(model, fmt, batches, adapters=adapters, adapter_rank=adapter_rank), batches


def _logits(model, batches, held_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits of the calibration batches' real tokens [n, V], the held-out prompts' logits [B, T, V])."""
    with torch.no_grad():
        return torch.cat([model(ids, attention_mask=mask)[mask.bool()] for ids, mask in batches]), model(held_out)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_gptq_base_brings_the_qlora_model_closer_to_full_precision(arch):
    """Model level: the qlora model on a GPTQ base gives logits closer to the full-precision model's than on an RTN
    base (summed squared error, at most 0.9 of RTN's; seed 0 gives 0.56-0.81 over the three architectures), on the
    calibration prompts and on others from the same distribution; every dense linear got codes."""
    model, codes, batches = _calibrated(arch)
    held_out = torch.tensor(rand_prompts([16] * 32))
    want, want_held = _logits(model, batches, held_out)
    apply_precision(model, PrecisionConfig(flow="qlora", format="nvfp4", lora=LoraConfig(rank=4)))
    rtn, rtn_held = _logits(model, batches, held_out)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear) and m.frozen_base]
    assert set(codes) == {m for m in linears if m is not model.lm_head}
    for linear, qt in codes.items():
        linear.load_frozen_base_codes(qt)
    got, got_held = _logits(model, batches, held_out)
    assert (got - want).pow(2).sum() < 0.9 * (rtn - want).pow(2).sum()
    assert (got_held - want_held).pow(2).sum() < 0.9 * (rtn_held - want_held).pow(2).sum()


def test_the_base_codes_survive_a_save_and_load_bit_for_bit(tmp_path):
    model, codes, _ = _calibrated()
    apply_precision(model, PrecisionConfig(flow="qlora", format="nvfp4", lora=LoraConfig(rank=4)))
    for linear, qt in codes.items():
        linear.load_frozen_base_codes(qt)
    save_base_codes(model, codes, tmp_path / BASE_CODES_FILE)
    torch.manual_seed(1)
    other = make_model("llama")
    apply_precision(other, PrecisionConfig(flow="qlora", format="nvfp4", lora=LoraConfig(rank=4)))
    names = dict(model.named_modules())
    assert load_base_codes(other, tmp_path / BASE_CODES_FILE) == len(codes)
    for name, linear in other.named_modules():
        if isinstance(linear, QuantLinear) and names[name] in codes:
            assert same_codes(linear.qweight, codes[names[name]])
    int8 = make_model("llama")
    apply_precision(int8, PrecisionConfig(flow="qlora", format="int8", lora=LoraConfig(rank=4)))
    with pytest.raises(ValueError, match=r"holds a nvfp4 base for model\.layers\.0\.mlp\.down_proj, which"):
        load_base_codes(int8, tmp_path / BASE_CODES_FILE)
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="is not a readable GPTQ base"):
        load_base_codes(other, tmp_path / "broken.safetensors")


def test_loading_codes_of_another_layout_is_refused():
    model, codes, _ = _calibrated()
    apply_precision(model, PrecisionConfig(flow="qlora", format="nvfp4", lora=LoraConfig(rank=4)))
    q, down = model.model.layers[0].self_attn.q_proj, model.model.layers[0].mlp.down_proj
    assert (q.out_features, q.in_features) != (down.out_features, down.in_features)
    with pytest.raises(ValueError, match="must be a nvfp4 weight"):
        q.load_frozen_base_codes(codes[down])
    with pytest.raises(RuntimeError, match="needs a frozen base"):
        make_model("llama").model.layers[0].mlp.down_proj.load_frozen_base_codes(codes[down])


@pytest.mark.parametrize("overrides,want", [
    (["precision.flow=qlora", "lora.rank=8"], "gptq"),  # nvfp4, the qlora default format
    (["precision.flow=qlora", "precision.format=int8", "lora.rank=8"], "gptq"),
    (["precision.flow=qlora", "precision.format=fp8", "lora.rank=8"], "rtn"),
    (["precision.flow=qlora", "lora.rank=8", "precision.base_quantizer=rtn"], "rtn"),
    (["precision.flow=split", "precision.format=int8"], "rtn"),
    (["precision.flow=bf16"], "rtn"),
])
def test_qlora_bases_take_gptq_by_default_where_it_applies(overrides, want):
    from quarl.config import effective_config_dict

    cfg = load_config(None, overrides)
    assert cfg.precision.resolved_base_quantizer == want
    assert effective_config_dict(cfg)["precision"]["base_quantizer"] == want


@pytest.mark.parametrize("overrides,match", [
    (["precision.flow=split", "precision.base_quantizer=gptq"], "quantizes the frozen base of precision.flow=qlora"),
    (["precision.flow=qlora", "precision.format=fp8", "lora.rank=8", "precision.base_quantizer=gptq"],
     "format='fp8'"),
    (["precision.flow=qlora", "lora.rank=8", "precision.base_quantizer=awq"], "choose rtn or gptq"),
])
def test_gptq_is_refused_where_it_does_not_apply(overrides, match):
    with pytest.raises(Exception, match=match):
        load_config(None, overrides)


def _trainer(tmp_path, steps, *extra):
    from quarl.rl.trainer import Trainer

    return Trainer(load_config(None, [
        "model.name=tiny-random-llama", "model.device=cpu", "precision.flow=qlora", "lora.rank=4",
        "data.train=arithmetic", "data.num_train=16", "data.num_eval=2",
        "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=4",
        f"train.steps={steps}", "eval.before=false", "eval.after=false", "output.tensorboard=false",
        "output.progress=false", f"output.dir={tmp_path / 'run'}", *extra]))


def _bases(trainer) -> dict:
    return {n: m.qweight for n, m in trainer.model.named_modules() if isinstance(m, QuantLinear) and m.frozen_base}


def test_a_qlora_run_trains_on_its_gptq_base_and_resume_and_export_load_it(tmp_path, monkeypatch):
    """A qlora run quantizes its base with GPTQ, saves it in the run directory, and trains; resuming loads that base
    (no second calibration) and so does `quarl export`, whose dequantized base is the trained one."""
    from quarl.export import export_from_run
    from quarl.model import gptq

    first = _trainer(tmp_path, 1)
    rtn = _trainer(tmp_path / "rtn", 1, "precision.base_quantizer=rtn")
    bases, rtn_bases = _bases(first), _bases(rtn)
    assert any(not same_codes(bases[n], rtn_bases[n]) for n in bases if "layers" in n)
    assert first.train()["step"] == 1
    assert (tmp_path / "run" / BASE_CODES_FILE).is_file()
    monkeypatch.setattr(gptq, "gptq_base", lambda *a, **k: pytest.fail("a resumed run calibrated again"))
    resumed = _trainer(tmp_path, 2, f"resume={tmp_path / 'run'}")
    assert all(same_codes(resumed_qt, bases[n]) for n, resumed_qt in _bases(resumed).items())
    assert resumed.train()["step"] == 2
    # whatever a resume's config now says, the run keeps the base it trained on
    as_rtn = _trainer(tmp_path, 2, f"resume={tmp_path / 'run'}", "precision.base_quantizer=rtn")
    assert all(same_codes(qt, bases[n]) for n, qt in _bases(as_rtn).items())
    as_rtn.close()
    out = export_from_run(tmp_path / "run", tmp_path / "export", verbose=False)
    from safetensors.torch import load_file

    q = resumed.model.model.layers[0].self_attn.q_proj
    base = load_file(str(out / "base" / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    # the adapters' base is the GPTQ base (in bf16), not the RTN one a rebuilt model would have
    assert torch.equal(base, q.qweight.dequantize(base.dtype))
    assert not torch.equal(base, rtn.model.model.layers[0].self_attn.q_proj.qweight.dequantize(base.dtype))


def test_resuming_a_round_to_nearest_run_keeps_its_base_and_says_why(tmp_path):
    """A run saved without a GPTQ base (round to nearest) resumed under a config that asks for GPTQ keeps the base
    it trained on and warns; it does not calibrate a new one under its adapters."""
    first = _trainer(tmp_path, 1, "precision.base_quantizer=rtn")
    assert first.train()["step"] == 1
    bases = _bases(first)
    assert not (tmp_path / "run" / BASE_CODES_FILE).exists()
    with pytest.warns(UserWarning, match="trained on a round-to-nearest qlora base, which it keeps"):
        resumed = _trainer(tmp_path, 2, f"resume={tmp_path / 'run'}", "precision.base_quantizer=gptq")
    assert all(same_codes(qt, bases[n]) for n, qt in _bases(resumed).items())


def test_the_progress_bar_counts_every_input_column_once(monkeypatch):
    """With progress, one bar counts the input columns quantized (every input of every layer once, K columns each)
    and ends full."""
    import tqdm.auto

    seen = {}

    class Recorded(tqdm.auto.tqdm):
        def close(self):
            seen.update(n=self.n, total=self.total)
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    torch.manual_seed(0)
    model = make_model("llama")
    gptq_base(model, "nvfp4", calibration_batches(rand_prompts([9, 7, 12]), "cpu"), progress=True)
    cfg = model.config
    per_layer = 3 * cfg.hidden_size + cfg.intermediate_size  # q/k/v, o, gate/up read hidden; down reads the MLP
    assert seen == {"n": cfg.num_layers * per_layer, "total": cfg.num_layers * per_layer}
