"""SmoothQuant smoothing of W8A8 rollouts (quarl/model/smoothing.py, `precision.smooth_alpha`): the factors against
their formula in float64, the smoothed rollout linear against a float64 reference of Q(x / s) @ Q(W diag(s))^T,
the sync, the model-level calibration, the fused decoder, the config checks and a training run.

Tolerances: the smoothed rollout linear takes the same reference quantizers as the check, so only the float32
matmul's summation order differs (the bound of tests/test_qlinear.py)."""

from __future__ import annotations

import pytest
import torch
import yaml

from quarl.config import load_config
from quarl.formats import quantize
from quarl.model.precision_apply import apply_precision, full_precision, rollout_mode
from quarl.model.qlinear import QuantLinear
from quarl.model.smoothing import (calibration_batches, input_absmax, input_groups, smooth_rollout,
                                   smoothing_factors)
from quarl.precision import PrecisionConfig
from quarl.rollout.fast_engine import FastRolloutEngine
from quarl.rollout.fused_decode import both_decode_logits
from tiny_models import make_model, rand_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def outlier_inputs(m: int, k: int, channels=(3, 100, 511)) -> torch.Tensor:
    """Activations [m, k] with a few channels 60x larger than the rest, as small LLMs have."""
    x = torch.randn(m, k)
    x[:, [c for c in channels if c < k]] *= 60.0
    return x


def test_smoothing_factors_follow_the_formula_and_leave_dead_channels_alone():
    k = 576
    x_absmax = torch.rand(k, dtype=torch.float64) * 10
    x_absmax[7] = 0.0  # a channel calibration never saw
    weights = [torch.randn(200, k, dtype=torch.float64), torch.randn(64, k, dtype=torch.float64)]
    weights[1][:, 9] = 0.0
    weights[0][:, 9] = 0.0  # a column no weight reads
    for alpha in (0.3, 0.5, 0.8):
        s = smoothing_factors(x_absmax, weights, alpha)
        w_absmax = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
        want = x_absmax ** alpha / w_absmax ** (1 - alpha)
        want[7] = want[9] = 1.0
        assert s.dtype == torch.float32
        torch.testing.assert_close(s.double(), want, rtol=2e-6, atol=0)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="alpha must be in"):
            smoothing_factors(x_absmax, weights, bad)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
def test_a_smoothed_rollout_linear_is_q_of_x_over_s_times_q_of_w_s(fmt):
    k, n = 576, 300  # SmolLM2's hidden size: not a multiple of 128
    torch.manual_seed(0)
    layer = QuantLinear(k, n, bias=True)
    layer.configure(rollout_format=fmt)
    x = outlier_inputs(37, k)
    s = smoothing_factors(x.abs().amax(0), [layer.weight], 0.5)
    layer.set_rollout_smoothing(s)
    layer.set_rollout(True)
    with torch.no_grad():
        got = layer(x)
    w64, s64 = layer.weight.detach().double(), s.double()
    xq = quantize((x.double() / s64).float(), fmt, "activation").dequantize(torch.float64)
    wq = quantize((w64 * s64).float(), fmt, "weight").dequantize(torch.float64)
    want = xq @ wq.T + layer.bias.detach().double()
    bound = k * 2.0 ** -24 * (xq.abs() @ wq.abs().T) + 1e-6
    assert bool(((got.double() - want).abs() <= bound).all())
    # and the point of it: closer to the exact product than the unsmoothed W8A8 rollout
    exact = x.double() @ w64.T + layer.bias.detach().double()
    layer.set_rollout_smoothing(None)
    with torch.no_grad():
        plain = layer(x)
    # (FP8's error is relative to each value, so outliers cost it less than INT8's uniform steps; fp8-block's
    # 1x128 activation groups already confine an outlier to its group: no gain there)
    gain = (plain.double() - exact).abs().mean() / (got.double() - exact).abs().mean()
    assert gain > {"int8": 2.0, "fp8": 1.15, "fp8-block": 0.9}[fmt], gain


def test_a_smoothed_rollout_linear_with_a_lora_adapter_feeds_the_adapter_the_unsmoothed_input():
    """Split flow + LoRA (smoothing is int8 W8A8's default there too): the base computes Q(x / s) Q(W diag(s))^T and
    the adapter reads x itself, scaling * (x A^T) B^T, against float64."""
    k, n, r = 576, 96, 8
    torch.manual_seed(5)
    layer = QuantLinear(k, n)
    layer.configure(rollout_format="int8", lora_rank=r, lora_alpha=16)
    with torch.no_grad():
        layer.lora_B.normal_()  # B starts at zero: give the adapter a term to get wrong
    x = outlier_inputs(21, k)
    s = smoothing_factors(x.abs().amax(0), [layer.weight], 0.5)
    layer.set_rollout_smoothing(s)
    layer.set_rollout(True)
    with torch.no_grad():
        got = layer(x).double()
    s64, x64 = s.double(), x.double()
    xq = quantize((x64 / s64).float(), "int8", "activation").dequantize(torch.float64)
    wq = quantize((layer.weight.detach().double() * s64).float(), "int8", "weight").dequantize(torch.float64)
    lora = layer.scaling * (x64 @ layer.lora_A.detach().double().T) @ layer.lora_B.detach().double().T
    want = xq @ wq.T + lora
    bound = k * 2.0 ** -24 * (xq.abs() @ wq.abs().T + (x64.abs() @ layer.lora_A.detach().double().abs().T)
                              @ layer.lora_B.detach().double().abs().T * layer.scaling) + 1e-5
    assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())


def test_the_sync_quantizes_the_current_weight_times_s():
    torch.manual_seed(1)
    layer = QuantLinear(200, 64)
    layer.configure(rollout_format="int8")
    s = torch.rand(200) + 0.5
    layer.set_rollout_smoothing(s)
    with torch.no_grad():
        layer.weight.add_(torch.randn_like(layer.weight) * 0.1)  # an optimizer step
    layer.refresh(only_if_changed=True)
    want = quantize((layer.weight.detach() * s).float(), "int8", "weight")
    assert torch.equal(layer.qweight.data, want.data) and torch.equal(layer.qweight.scale, want.scale.reshape(
        layer.qweight.scale.shape))
    layer.set_rollout_smoothing(None)  # back to the plain copy, re-quantized at once
    plain = quantize(layer.weight.detach().float(), "int8", "weight")
    assert torch.equal(layer.qweight.data, plain.data)
    layer.set_rollout_smoothing(s)
    layer.to(torch.bfloat16)  # a dtype move keeps the factors float32, as the copy was made with them
    assert layer.rollout_smoothing.dtype == torch.float32 and torch.equal(layer.rollout_smoothing, s)
    layer.float()
    for bad in (torch.zeros(200), torch.ones(199), torch.full((200,), float("nan"))):
        with pytest.raises(ValueError, match="smoothing factors must be"):
            layer.set_rollout_smoothing(bad)
    layer.configure(rollout_format="int8", weight_only=True)
    with pytest.raises(ValueError, match="W8A8 rollout copy"):
        layer.set_rollout_smoothing(s)


def _with_outlier_channels(model) -> None:
    """Give every norm a few large weights, so the linears after it see outlier channels."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[1, 5]] *= 40.0


def test_calibration_reads_each_groups_input_without_padding():
    torch.manual_seed(2)
    model = make_model("llama")
    apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    ids = torch.randint(0, model.config.vocab_size, (4, 12))
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    groups = input_groups(model)
    assert len(groups) == 4 * model.config.num_layers
    maxima = input_absmax(model, groups, calibration_batches([ids[0, :9].tolist(), *ids[1:].tolist()], "cpu", 2))
    with torch.no_grad(), full_precision(model):  # the first group's input: the first norm of the embeddings
        first = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))[mask.bool()]
    torch.testing.assert_close(maxima[0], first.abs().amax(0), rtol=0, atol=0)


def test_calibrated_smoothing_brings_the_rollout_model_closer_to_full_precision():
    """Summed over three random models with outlier channels, the INT8 W8A8 rollout's KL to full precision falls
    by more than half (per model it fell to 0.07-0.71 of the unsmoothed value)."""
    plain, smoothed = 0.0, 0.0
    for seed in range(3):
        torch.manual_seed(seed)
        model = make_model("llama")
        _with_outlier_channels(model)
        apply_precision(model, PrecisionConfig(flow="split", format="int8"))
        ids = torch.randint(0, model.config.vocab_size, (4, 12))
        with torch.no_grad(), full_precision(model):
            exact = torch.log_softmax(model(ids), -1)

        def rollout_kl():
            with torch.no_grad(), rollout_mode(model):
                lp = torch.log_softmax(model(ids), -1)
            return (lp.exp() * (lp - exact)).sum(-1).mean().item()

        plain += rollout_kl()
        assert smooth_rollout(model, calibration_batches(ids.tolist(), "cpu"), 0.5) == 7 * model.config.num_layers
        smoothed += rollout_kl()
        with torch.no_grad(), full_precision(model):  # training never sees the factors
            assert torch.equal(torch.log_softmax(model(ids), -1), exact)
    assert smoothed < 0.5 * plain, (smoothed, plain)


def test_the_fused_decoder_takes_the_smoothing_too():
    torch.manual_seed(3)
    model = make_model("qwen2")
    _with_outlier_channels(model)
    apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    smooth_rollout(model, calibration_batches(rand_prompts([7, 9, 5]), "cpu"), 0.5)
    plain = FastRolloutEngine(model, None, max_batch_size=8, fused_decode=False)
    fused = FastRolloutEngine(model, None, max_batch_size=8, fused_decode=True)
    prompts = rand_prompts([5, 3, 8])
    want = plain.generate(prompts, n=2, max_new_tokens=8, temperature=0.0)
    got = fused.generate(prompts, n=2, max_new_tokens=8, temperature=0.0)
    for w, g in zip(want, got):
        assert [c.token_ids for c in w.completions] == [c.token_ids for c in g.completions]
    module_logits, fused_logits = both_decode_logits(model, fused, torch.tensor([1, 2, 3]), torch.tensor([4, 0, 9]))
    torch.testing.assert_close(fused_logits, module_logits, atol=1e-5, rtol=1e-5)
    model.set_rollout(True)
    assert fused._decoder.qkv[0].fused_qweight is not None  # q/k/v share one s: still one stacked GEMM
    model.set_rollout(False)


@pytest.mark.parametrize("fmt,deferred", [("int8", False), ("fp8", False), ("fp8", True)])
def test_handed_codes_of_a_smoothed_linear_are_those_of_the_divided_activations(monkeypatch, fmt, deferred):
    """Where the fused norm and SiLU·mul kernels hand 8-bit codes to the next GEMM (forced here, as on a GPU; the
    torch pieces make the codes), a smoothed linear gets the codes of x / s, and o_proj's unit-scale path (fp8,
    deferred scales) quantizes x / s: float32 logits equal the module path's to 1e-5 of the largest logit, every
    q/k/v, gate/up and down GEMM took handed codes, and codes of the undivided activations would give other
    logits."""
    from quarl import kernels
    from quarl.rollout import fused_decode
    from quarl.rollout.fused_decode import DEFAULT_DEFERRED, FusedDecoder

    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = make_model("qwen2", dtype=torch.float32)
    _with_outlier_channels(model)
    apply_precision(model, PrecisionConfig(flow="split", format=fmt, smooth_alpha=0.5))
    smooth_rollout(model, calibration_batches(rand_prompts([7, 9, 5]), "cpu"), 0.5)
    engine = FastRolloutEngine(model, None, max_batch_size=8, fused_decode=True)
    engine.generate(rand_prompts([5, 3, 8]), n=1, max_new_tokens=6, temperature=0.0)  # fill the cache
    decoder = FusedDecoder.for_model(model)
    decoder.prepare()
    monkeypatch.setattr(fused_decode, "_handoff", lambda qweight, linear, m: True)
    handed = []

    def codes_matmul(codes, scales, qweight, bias, out_dtype):  # float32: cuBLAS would round to bf16
        handed.append(tuple(qweight.shape))
        y = (codes.float() * scales) @ qweight.dequantize(torch.float32).T
        return (y if bias is None else y + bias.float()).to(out_dtype)

    monkeypatch.setattr(kernels, "matmul_from_codes", codes_matmul)
    monkeypatch.setattr(kernels, "unit_scales_ok", lambda qweight, m: True)

    def step_logits():
        decoder.deferred_scales = frozenset(("o",)) if deferred else frozenset()
        try:
            return both_decode_logits(model, engine, torch.tensor([1, 2, 3]), torch.tensor([4, 0, 9]))
        finally:
            decoder.deferred_scales = DEFAULT_DEFERRED

    want, got = step_logits()
    assert len(handed) == 3 * model.config.num_layers  # q/k/v, gate/up, down
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)
    monkeypatch.setattr(fused_decode, "divided", lambda h, smooth: h)  # codes of x, not x / s
    monkeypatch.setattr(QuantLinear, "smooth_input", lambda self, x: x)
    undivided = step_logits()[1]
    assert float((undivided - want).abs().max()) > 1e-3 * float(want.abs().max())


_SMOOTHED_CODES_CHECK = """
import torch
from quarl.formats import quantize
from quarl.kernels.decode_fused import rms_norm_rows, silu_mul_rows
torch.manual_seed(int(torch.randint(0, 2**31, (1,))))

def check(h, s, codes, scales):
    ref = quantize((h / s).to(h.dtype), "int8", "activation")
    assert torch.equal(codes, ref.data) and torch.equal(scales, ref.scale), (codes.int() - ref.data.int()).abs().max()
    plain = quantize(h, "int8", "activation")
    assert not torch.equal(codes, plain.data)  # the division shows

for m, h in [(3, 576), (2, 200)]:  # SmolLM2's hidden size; a row shorter than the kernel's block
    x, d = torch.randn(m, h).bfloat16() * 3, torch.randn(m, h).bfloat16()
    w = (1 + 0.3 * torch.randn(h)).bfloat16()
    s = torch.rand(h) * 4 + 0.05
    _, hh, codes, scales = rms_norm_rows(x, d, w, None, 1e-6, "int8", smooth=s)
    check(hh, s, codes, scales)
for m, n in [(2, 1536), (3, 300), (2, 40000)]:  # SmolLM2's MLP width (row pieces); two-pass kernel
    gu = (torch.randn(m, 2 * n) * 4).bfloat16()
    s = torch.rand(n) * 4 + 0.05
    hh, codes, scales = silu_mul_rows(gu[:, :n], gu[:, n:], "int8", smooth=s)
    check(hh, s, codes, scales)
print("ok")
"""


def test_the_fused_kernels_smoothed_codes_in_the_interpreter():
    """The fused norm and SiLU·mul kernels' int8 codes with smoothing factors, run by Triton's CPU interpreter:
    bit for bit `quarl.formats.quantize` of their own bf16 values divided by s (in float32, rounded to bf16) on
    SmolLM2's shapes, the row-pieces and the two-pass kernel; the written values stay undivided. (The GPU test
    checks FP8 and fp8-block codes too.)"""
    from interpreter import INTERPRETER_PATCH, run_in_interpreter

    run_in_interpreter(INTERPRETER_PATCH + _SMOOTHED_CODES_CHECK)


def test_the_fused_kernels_refuse_smoothing_factors_they_cannot_use():
    pytest.importorskip("triton")
    from quarl.kernels.decode_fused import rms_norm_rows

    x, w = torch.randn(2, 64).bfloat16(), torch.ones(64).bfloat16()
    with pytest.raises(ValueError, match="without a quant format"):
        rms_norm_rows(x, None, w, None, 1e-6, None, smooth=torch.ones(64))
    with pytest.raises(ValueError, match=r"float32 \[64\]"):
        rms_norm_rows(x, None, w, None, 1e-6, "int8", smooth=torch.ones(32))


def _smoothed_qkv(dequant_cache: bool = True):
    """A stacked q/k/v FusedProjection of a smoothed int8 rollout, in rollout mode, and an input with outliers;
    dequant_cache=False: no part keeps a dequantized weight (as on a GPU, where kernels read the codes)."""
    from quarl.rollout.fused_decode import FusedProjection

    torch.manual_seed(4)
    model = make_model("qwen2")
    _with_outlier_channels(model)
    apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    smooth_rollout(model, calibration_batches(rand_prompts([7, 9, 5]), "cpu"), 0.5)
    attn = model.model.layers[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    if not dequant_cache:
        for part in parts:
            part.cache_dequantized, part.weight_dequant = False, None
    model.set_rollout(True)
    proj = FusedProjection(parts)
    x = outlier_inputs(5, parts[0].in_features, channels=(1, 5))
    return proj, parts, x


def test_a_stacked_projection_falls_back_per_part_with_the_undivided_input(monkeypatch):
    proj, parts, x = _smoothed_qkv(dequant_cache=False)
    assert proj.fused_qweight is not None and "weight_dequant" not in proj._fused
    with torch.no_grad():
        want = torch.cat([p(x) for p in parts], dim=-1)
        # inside a CUDA-graph capture, no kernel and no stacked dequantized weight: each part runs on its own, on
        # the undivided x (each divides by s itself)
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            torch.testing.assert_close(proj(x), want, atol=0, rtol=0)
        torch.testing.assert_close(proj(x), want, atol=1e-5, rtol=1e-5)  # the stacked GEMM, dividing once


def test_a_stacked_projection_stops_stacking_when_its_parts_factors_differ():
    proj, parts, x = _smoothed_qkv()
    parts[1].set_rollout_smoothing(parts[1].rollout_smoothing * 2.0)  # k alone, after stacking
    assert proj.fused_qweight is None
    with torch.no_grad():
        torch.testing.assert_close(proj(x), torch.cat([p(x) for p in parts], dim=-1), atol=0, rtol=0)


@pytest.mark.parametrize("overrides,match", [
    (["precision.flow=unified", "precision.format=int8"], "needs precision.flow=split"),
    (["precision.flow=split", "precision.format=int8", "precision.weight_only=true"], "activations quantized"),
    (["precision.flow=bf16"], "needs precision.flow=split"),
    (["precision.flow=qlora", "lora.rank=8"], "needs precision.flow=split"),
    (["precision.flow=split", "precision.format=int8", "precision.smooth_alpha=1.5"], "must be in"),
])
def test_smoothing_is_refused_where_it_does_not_apply(overrides, match):
    alpha = [] if any("smooth_alpha" in o for o in overrides) else ["precision.smooth_alpha=0.5"]
    with pytest.raises(Exception, match=match):
        load_config(None, [*overrides, *alpha])


def test_calibration_takes_prompts_rendered_to_token_ids_as_they_are():
    """A task whose prompts render to token ids (the step benchmark's) calibrates on those ids, with no answer;
    text prompts are encoded and followed by their gold answer."""
    from types import SimpleNamespace

    from quarl.model.smoothing import calibration_sequences
    from quarl.model.tiny import tiny_tokenizer

    examples = [SimpleNamespace(gold="42", meta={"ids": [5, 9, 11]}), SimpleNamespace(gold=None, meta={"ids": [7]})]
    by_ids = SimpleNamespace(train_batch=lambda step, attempt, n: examples[:n], render=lambda ex: ex.meta["ids"])
    assert calibration_sequences(by_ids, None, 2) == [[5, 9, 11], [7]]
    tok = tiny_tokenizer()
    by_text = SimpleNamespace(train_batch=lambda step, attempt, n: examples[:n], render=lambda ex: "What is 2+2?")
    from quarl.model.tokenizer import encode_prompt

    prompt = encode_prompt(tok, "What is 2+2?")
    assert calibration_sequences(by_text, tok, 2) == [prompt + list(tok("42", add_special_tokens=False).input_ids),
                                                       prompt]


@pytest.mark.parametrize("overrides,alpha", [
    (["precision.flow=split", "precision.format=int8"], 0.5),
    (["precision.flow=split"], 0.5),  # the split flow's default format is int8
    (["precision.flow=split", "precision.format=int8", "precision.weight_only=true"], 0.0),
    (["precision.flow=split", "precision.format=fp8"], 0.0),
    (["precision.flow=split", "precision.format=fp8-block"], 0.0),
    (["precision.flow=unified", "precision.format=int8"], 0.0),
    (["precision.flow=qlora", "precision.format=int8", "lora.rank=8"], 0.0),
    (["precision.flow=bf16"], 0.0),
    (["precision.flow=split", "precision.format=int8", "precision.smooth_alpha=0"], 0.0),
    (["precision.flow=split", "precision.format=int8", "precision.smooth_alpha=0.7"], 0.7),
])
def test_int8_w8a8_split_rollouts_are_smoothed_by_default(overrides, alpha):
    from quarl.config import effective_config_dict

    cfg = load_config(None, overrides)
    assert cfg.precision.resolved_smooth_alpha == alpha
    assert effective_config_dict(cfg)["precision"]["smooth_alpha"] == alpha


def test_a_run_with_smoothing_trains_and_resumes_with_the_same_factors(tmp_path):
    from quarl.rl.trainer import Trainer

    def trainer(steps, *extra):
        return Trainer(load_config(None, [
            "model.name=tiny-random-llama", "model.device=cpu", "precision.flow=split", "precision.format=int8",
            "data.train=arithmetic", "data.num_train=16", "data.num_eval=2",  # smoothed: int8 W8A8's default
            "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=4",
            f"train.steps={steps}", "eval.before=false", "eval.after=false", "output.tensorboard=false",
            "output.progress=false", f"output.dir={tmp_path / 'run'}", *extra]))

    def factors(t):
        return [m.rollout_smoothing for m in t.model.modules() if isinstance(m, QuantLinear) and m.smoothable]

    first = trainer(1)
    assert factors(first) and all(f is not None for f in factors(first))
    assert any(not torch.equal(f, torch.ones_like(f)) for f in factors(first))
    assert first.train()["step"] == 1
    resumed = trainer(2, f"resume={tmp_path / 'run'}")  # calibrates on the model as loaded, as the first run did
    assert all(torch.equal(a, b) for a, b in zip(factors(first), factors(resumed)))
    assert resumed.train()["step"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sharded_runs_rollout_copy_holds_the_smoothed_codes(dtype):
    """Many ranks: `make_rollout_copy` turns each linear into a frozen quantized base, which forgets the factors
    unless kept. The copy keeps them (float32, one tensor per input group as in the model) and its codes are
    Q(W diag(s)) as the one-process rollout copy's; a sync's `load_frozen_base` quantizes W diag(s) again."""
    from quarl.rl.sharding import make_rollout_copy

    torch.manual_seed(4)
    model = make_model("llama")
    _with_outlier_channels(model)
    apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    model = model.to(dtype)  # as the trainer has it: in its compute dtype before calibration
    ids = torch.randint(0, model.config.vocab_size, (4, 12))
    smooth_rollout(model, calibration_batches(ids.tolist(), "cpu"), 0.5)
    copy = make_rollout_copy(model, dtype)
    pairs = [(a, b) for a, b in zip(model.modules(), copy.modules()) if isinstance(a, QuantLinear)
             and a.rollout_smoothing is not None]
    assert len(pairs) == 7 * model.config.num_layers
    for a, b in pairs:
        assert b.frozen_base and b.weight is None and b.rollout_smoothing.dtype == torch.float32
        assert torch.equal(b.rollout_smoothing, a.rollout_smoothing)
        assert torch.equal(b.qweight_data, a.qweight_data) and torch.equal(b.qweight_scale, a.qweight_scale)
    attn = copy.model.layers[0].self_attn
    assert attn.q_proj.rollout_smoothing.data_ptr() == attn.v_proj.rollout_smoothing.data_ptr()  # one s to stack
    a, b = pairs[0]
    with torch.no_grad():
        a.weight.add_(0.01 * torch.randn_like(a.weight))
        a.refresh()
        b.load_frozen_base(a.weight)
    assert torch.equal(b.qweight_data, a.qweight_data) and torch.equal(b.qweight_scale, a.qweight_scale)
    with torch.no_grad(), rollout_mode(model), rollout_mode(copy):
        torch.testing.assert_close(copy(ids), model(ids), rtol=0, atol=0)


def test_a_run_saved_before_smoothing_existed_resumes_without_it(tmp_path):
    """A config.yaml written before `precision.smooth_alpha` existed resumes with smoothing off, as that run computed
    (today's default would turn it on halfway); a saved null, or a value, stays as saved."""
    from quarl.api import _resumed
    from quarl.config import config_to_dict, saved_run_defaults

    data = config_to_dict(load_config(None, ["precision.flow=split", "precision.format=int8"]))
    assert data["precision"]["smooth_alpha"] is None  # saved unresolved: a copied config follows its own flow
    old = {**data, "precision": {k: v for k, v in data["precision"].items() if k != "smooth_alpha"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert saved_run_defaults(tmp_path / "config.yaml") == {"precision.smooth_alpha": 0.0}
    config, overrides = _resumed(None, {"resume": str(tmp_path)})
    assert load_config(config, [f"{k}={v}" for k, v in overrides.items()]).precision.resolved_smooth_alpha == 0.0
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    assert saved_run_defaults(tmp_path / "config.yaml") == {}
    config, overrides = _resumed(None, {"resume": str(tmp_path)})
    assert load_config(config, [f"{k}={v}" for k, v in overrides.items()]).precision.resolved_smooth_alpha == 0.5
