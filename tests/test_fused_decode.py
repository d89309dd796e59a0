"""The fused decode forward (quarl.rollout.fused_decode) on the CPU: its torch pieces and stacked weights.

Tolerances: the fused q/k/v and gate/up GEMMs multiply the same float32 values as the per-projection GEMMs, but a
wider matrix may be blocked differently by the CPU BLAS, so outputs agree to float32 summation order (1e-5
relative to the largest value); greedy tokens of the tiny models (O(1) logits) must be identical.
"""

import textwrap

import pytest
import torch

from quarl.model.precision_apply import apply_precision
from quarl.model.qlinear import QuantLinear
from quarl.precision import LoraConfig, PrecisionConfig
from quarl.rollout import fused_decode
from quarl.rollout.fast_engine import FastRolloutEngine
from quarl.rollout.fused_decode import (DEFAULT_DEFERRED, FusedDecoder, FusedProjection, add_norm,
                                       both_decode_logits, rope_qk, silu_mul)
from tiny_models import make_model, rand_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def close(a, b, rel=1e-5):
    torch.testing.assert_close(a, b, atol=rel * float(b.detach().abs().max()), rtol=0)


def _parts(fmt, sizes=(64, 32, 32), k=48):
    parts = []
    for n in sizes:
        p = QuantLinear(k, n, bias=True)
        with torch.no_grad():
            p.bias.normal_()
        p.configure(rollout_format=fmt)
        p.set_rollout(True)
        parts.append(p)
    return parts


@pytest.mark.parametrize("fmt,stacked", [("int8", True), ("fp8", True), ("mxfp4", True), ("nvfp4", False),
                                         ("fp8-tensor", False)])
def test_fused_projection_equals_its_parts_and_follows_refresh(fmt, stacked):
    """One GEMM over the stacked rollout weights gives the parts' outputs side by side; the parts' buffers are
    views of the stacked one, so a sync (refresh after a weight update) reaches the fused GEMM."""
    torch.manual_seed(0)
    parts = _parts(fmt)
    fused = FusedProjection(parts)
    assert (fused.fused_qweight is not None) == stacked
    x = torch.randn(5, 48)
    close(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    with torch.no_grad():
        for p in parts:
            p.weight.mul_(-2.0)
            p.refresh()
    close(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_fused_projection_restacks_after_reconfigure_and_skips_unstackable_blocks():
    torch.manual_seed(0)
    parts = _parts("fp8")
    fused = FusedProjection(parts)
    x = torch.randn(3, 48)
    for p in parts:
        p.configure(rollout_format="int8")  # new buffers: the old views are gone
        p.set_rollout(True)
    assert fused.fused_qweight is None  # stale: the parts run apart until prepare() re-stacks
    close(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    fused.prepare()
    assert fused.fused_qweight.fmt == "int8"
    close(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    blocks = FusedProjection(_parts("fp8-block", sizes=(128, 64)))  # 64 rows: not whole 128x128 tiles
    assert blocks.fused_qweight is None
    for p in parts:
        p.set_rollout(False)  # training mode: the parts' own (full-precision) forward
    assert fused.fused_qweight is None
    close(fused(x), torch.cat([p(x) for p in parts], dim=-1))


@pytest.mark.parametrize("stack", [True, False])
def test_fused_projection_adds_each_parts_lora(stack):
    """In rollout the group adds every part's adapter into its columns: as one stacked pair of GEMMs
    (`FastPaths.stack_rollout_lora`, the default) or part by part; both equal the parts run one by one."""
    from quarl.fast_paths import FastPaths

    torch.manual_seed(0)
    parts = _parts("fp8")
    for p in parts:
        p.set_rollout(False)
        p.configure(rollout_format="fp8", lora_rank=4)
        with torch.no_grad():
            p.lora_B.normal_()
        p.set_rollout(True)  # a rollout starts: the adapter's rollout copy is made
    fused = FusedProjection(parts, FastPaths(stack_rollout_lora=stack))
    fused.prepare()
    assert (fused._adapter is not None) == stack
    x = torch.randn(4, 48)
    with torch.no_grad():
        close(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_fused_projection_stacks_the_rollout_adapters():
    """prepare() stacks the parts' rollout adapters (ranks 4 and 2, the middle part without one) into one A and a
    block-diagonal B whose blocks are the parts' own copies: the group's output equals the parts one by one. A new
    rollout rewrites the copies in place (no re-stacking, same buffers: captured graphs stay valid) and the output
    follows the trained adapter; a new rank un-stacks until the next prepare(); removing every adapter frees the
    stack."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    parts = _parts("fp8")
    for p, rank in zip(parts, (4, 0, 2)):
        p.set_rollout(False)
        if rank:
            p.configure(rollout_format="fp8", lora_rank=rank)
            with torch.no_grad():
                p.lora_B.normal_()
        p.set_rollout(True)
    fused = FusedProjection(parts)  # the default paths stack the rollout adapters
    x = torch.randn(5, 48)

    def one_by_one():  # from the parameters themselves, not from the rollout copies the stack holds
        return torch.cat([p._rollout_forward(x, p.bias) + (x @ p.lora_A.T @ (p.lora_B * p.scaling).T
                                                           if p.lora_rank else 0) for p in parts], dim=-1)

    assert fused.prepare() and fused._adapters_current()
    a, b = fused._adapter
    assert a.shape == (6, 48) and b.shape == (128, 6)
    assert torch.equal(b[64:96], torch.zeros(32, 6)) and torch.equal(b[:64, 4:], torch.zeros(64, 2))
    with torch.no_grad():
        close(fused(x), one_by_one())
        lora_free = torch.cat([p._rollout_forward(x, p.bias) for p in parts], dim=-1)
    assert (fused(x) - lora_free).abs().max() > 1e-2  # the adapters act
    for p in parts:  # a training step changes an adapter, then the next rollout starts
        p.set_rollout(False)
    with torch.no_grad():
        parts[2].lora_B.mul_(-3.0)
        parts[0].lora_A.add_(0.5)
    for p in parts:
        p.set_rollout(True)
    assert not fused.prepare() and fused._adapter[0] is a  # rewritten in place, nothing moved
    with torch.no_grad():
        close(fused(x), one_by_one())
    parts[2].set_rollout(False)
    parts[2].configure(rollout_format="fp8", lora_rank=3)
    parts[2].set_rollout(True)
    assert not fused._adapters_current()
    with torch.no_grad():
        close(fused(x), one_by_one())  # per part meanwhile
    assert fused.prepare() and fused._adapter[0].shape == (7, 48)
    with torch.no_grad():
        close(fused(x), one_by_one())
    for p in parts:  # adapters removed: the stack is freed, the base alone remains
        p.set_rollout(False)
        p.configure(rollout_format="fp8", lora_rank=0)
        p.set_rollout(True)
    fused.prepare()
    assert fused._adapter is None
    with torch.no_grad():
        close(fused(x), one_by_one())


def test_elementwise_pieces_match_the_modules():
    """The torch definitions of the fused pieces are the modules' math (the GPU kernels are tested against them)."""
    torch.manual_seed(0)
    model = make_model("qwen2")
    layer = model.model.layers[0]
    norm = layer.input_layernorm
    norm.set_rollout(True)
    with torch.no_grad():
        norm.rollout_noise.normal_(0, 0.1)
    norm.aqn_enabled = True  # as quarl.rl.aqn.set_aqn_noise does
    x, d = torch.randn(3, model.config.hidden_size), torch.randn(3, model.config.hidden_size)
    r, h, codes = add_norm(norm, x, d, None)
    assert codes is None and torch.equal(r, x + d) and torch.equal(h, norm(x + d))
    _, _, codes = add_norm(norm, x, d, "fp8")
    from quarl.formats import quantize

    ref = quantize(norm(x + d), "fp8", "activation")
    assert torch.equal(codes[0].float(), ref.data.float()) and torch.equal(codes[1], ref.scale)
    g, u = torch.randn(3, 40), torch.randn(3, 40)
    a, _ = silu_mul(g, u, None)
    assert torch.equal(a, torch.nn.functional.silu(g) * u)
    attn = layer.self_attn
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = torch.randn(3, (Hq + 2 * Hkv) * D)
    pos = torch.tensor([0, 5, 17])
    cos, sin = model.model.rotary_emb(pos[:, None], qkv.dtype)
    q, k = rope_qk(qkv, cos.reshape(3, D), sin.reshape(3, D), Hq, Hkv, D)
    from quarl.model.layers import apply_rope

    assert torch.equal(q, apply_rope(qkv[:, :Hq * D].view(3, Hq, 1, D), cos, sin)[:, :, 0])
    assert torch.equal(k, apply_rope(qkv[:, Hq * D:(Hq + Hkv) * D].view(3, Hkv, 1, D), cos, sin)[:, :, 0])


@pytest.mark.parametrize("precision,kv", [(None, "auto"), ("fp8", "fp8"), ("int8", "fp8-token"),
                                          ("nvfp4", "auto")])
def test_fused_decoder_logits_and_greedy_tokens_match_the_module_path(precision, kv):
    torch.manual_seed(0)
    model = make_model("qwen2")
    pc = PrecisionConfig(flow="bf16") if precision is None else PrecisionConfig(flow="split", format=precision)
    apply_precision(model, pc)
    prompts = rand_prompts([5, 3, 8])
    plain = FastRolloutEngine(model, None, max_batch_size=8, fused_decode=False, kv_cache_dtype=kv)
    ref = plain.generate(prompts, n=2, max_new_tokens=12, temperature=0.0)
    fused = FastRolloutEngine(model, None, max_batch_size=8, fused_decode=True, kv_cache_dtype=kv)
    out = fused.generate(prompts, n=2, max_new_tokens=12, temperature=0.0)
    model.set_rollout(True)
    stacked = fused._decoder.qkv[0].fused_qweight is not None and fused._decoder.gate_up[0].fused_qweight is not None
    model.set_rollout(False)
    assert stacked == (precision in ("fp8", "int8"))
    for o, r in zip(out, ref):
        for c, cr in zip(o.completions, r.completions):
            assert c.token_ids == cr.token_ids
            close(torch.tensor(c.logprobs), torch.tensor(cr.logprobs), rel=1e-4)
    # the logits of one step, directly
    assert FusedDecoder.for_model(model) is fused._decoder
    want, got = both_decode_logits(model, fused, torch.tensor([1, 2, 3]), torch.tensor([4, 0, 9]))
    close(got, want)


def test_a_fused_decode_step_that_skips_a_layer_is_an_error():
    """Each layer of a fused decode step hands its MLP output to the next layer's norm (`SlotDecode.carry`); a
    forward that leaves one pending (not every layer ran) would drop it, so the step refuses to return."""
    torch.manual_seed(0)
    model = make_model("qwen2")
    engine = FastRolloutEngine(model, None, max_batch_size=4, fused_decode=True)
    engine.generate(rand_prompts([3]), max_new_tokens=2, temperature=0.0)  # allocates the slot cache
    model.model.layers = model.model.layers[:-1]
    with pytest.raises(RuntimeError, match="still pending"):
        both_decode_logits(model, engine, torch.tensor([1]), torch.tensor([2]))


def test_fused_decode_refuses_models_it_does_not_cover():
    model = make_model("qwen3")  # per-head q/k norms
    with pytest.raises(ValueError, match="q/k norms"):
        FastRolloutEngine(model, None, max_batch_size=4, fused_decode=True)
    assert FastRolloutEngine(model, None, max_batch_size=4)._decoder is None


def test_stacking_keeps_the_state_dict_and_one_decoder_serves_every_engine():
    """A frozen (qlora) base saves its quantized buffers, never the dequantized cache; two engines on one model
    share one decoder (two would re-stack the same buffers away from each other)."""
    torch.manual_seed(0)
    model = make_model("qwen2")
    apply_precision(model, PrecisionConfig(flow="qlora", format="int8", lora=LoraConfig(rank=4)))
    keys = set(model.state_dict())
    a = FastRolloutEngine(model, None, max_batch_size=4)
    b = FastRolloutEngine(model, None, max_batch_size=4)
    assert a._decoder is b._decoder and a._decoder.qkv[0].fused_qweight is None  # not in rollout mode yet
    model.set_rollout(True)
    assert a._decoder.qkv[0].fused_qweight is not None
    model.set_rollout(False)
    assert set(model.state_dict()) == keys
    fresh = make_model("qwen2")
    apply_precision(fresh, PrecisionConfig(flow="qlora", format="int8", lora=LoraConfig(rank=4)))
    fresh.load_state_dict(model.state_dict())  # strict: no extra keys
    prompts = rand_prompts([4, 6])
    out_a = a.generate(prompts, n=2, max_new_tokens=6, temperature=0.0)
    out_b = b.generate(prompts, n=2, max_new_tokens=6, temperature=0.0)
    assert [c.token_ids for o in out_a for c in o.completions] == [c.token_ids for o in out_b for c in o.completions]


def test_parts_with_and_without_a_fallback_cache_still_stack():
    """When only some parts built their dequantized fallback cache (e.g. a prefill shape with no kernel), prepare()
    stacks them anyway, with one stacked cache that every part then views."""
    torch.manual_seed(0)
    parts = []
    for n in (64, 32):
        p = QuantLinear(48, n, bias=True)
        p.cache_dequantized = False  # no cache from configure on
        p.configure(rollout_format="int8")
        p.set_rollout(True)
        parts.append(p)
    fused = FusedProjection(parts)
    assert fused.fused_qweight is not None and parts[0].weight_dequant is None
    parts[1]._build_dequant_cache()  # only this part: its buffer is not a view of anything stacked
    assert fused.fused_qweight is None
    assert fused.prepare() is True  # re-stacked: buffers moved
    assert fused.prepare() is False  # already current: nothing moves
    assert fused.fused_qweight is not None
    assert all(p.weight_dequant is not None for p in parts)
    stacked = fused._fused["weight_dequant"]
    assert parts[0].weight_dequant.data_ptr() == stacked.data_ptr()
    x = torch.randn(3, 48)
    close(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_engine_restacks_what_a_prefill_fallback_unstacked():
    """A prefill runs the module path; a projection with no kernel for its shape builds its own dequantized cache
    there, which un-stacks the fused weight. The engine stacks again after the prefill, so its decode steps use
    the fused GEMMs."""
    torch.manual_seed(0)
    model = make_model("qwen2", dtype=torch.float32)
    apply_precision(model, PrecisionConfig(flow="split", format="fp8"))
    for m in model.modules():
        if isinstance(m, QuantLinear):  # as on a GPU: no cache until a fallback needs one
            m.register_buffer("weight_dequant", None, persistent=False)
    engine = FastRolloutEngine(model, None, max_batch_size=4, use_cuda_graphs=False)
    decoder = FusedDecoder.for_model(model)
    decoder.prepare()
    assert all(p.weight_dequant is None for p in decoder.qkv[0].parts)
    engine.generate(rand_prompts([5, 3]), n=2, max_new_tokens=3, temperature=0)
    assert all(p.weight_dequant is not None for p in decoder.qkv[0].parts)  # the prefill's fallbacks ran
    assert all(proj._views_current() for proj in decoder.qkv + decoder.gate_up)


def test_prepare_reports_no_move_for_parts_that_do_not_stack():
    """bf16 parts never stack: prepare() must say nothing moved (the engine drops its CUDA graphs when it says
    otherwise, which would re-capture them after every prefill)."""
    parts = _parts(None)
    fused = FusedProjection(parts)
    assert fused.fused_qweight is None
    assert fused.prepare() is False
    fp8 = FusedProjection(_parts("fp8"))
    assert fp8.prepare() is False  # stacked at construction, still current


def test_fused_kernels_serve_bf16_without_fp8_support(monkeypatch):
    """On a GPU with the Triton kernels but no FP8 (Ampere) the fused kernels still serve bf16 rollouts, with a
    self-check that leaves out the FP8 codes; fp16 activations never take them."""
    from quarl import kernels
    from quarl.kernels import availability, capabilities

    seen = []
    monkeypatch.setattr(capabilities, "CAPABILITIES", capabilities.CapabilityRegistry())
    monkeypatch.setattr(availability, "kernels_available", lambda device=None: True)
    monkeypatch.setattr(availability, "fp8_kernels_available", lambda device=None: False)
    monkeypatch.setattr(capabilities, "_decode_fused_agrees",
                        lambda device, dtype, fp8=True: seen.append(fp8) or True)
    assert kernels.decode_fused_ok(torch.device("cpu"), torch.bfloat16)
    assert seen == [False]
    assert not kernels.decode_fused_ok(torch.device("cpu"), torch.float16)
    assert kernels.decode_fused_ok(torch.device("cpu"), torch.bfloat16) and seen == [False]  # probed once
    monkeypatch.setattr(availability, "kernels_available", lambda device=None: False)
    capabilities.CAPABILITIES.clear("decode_fused")
    assert not kernels.decode_fused_ok(torch.device("cpu"), torch.bfloat16)


def test_matmul_from_codes_checks_its_inputs_and_serves_int8_on_the_cpu():
    """int8 codes on a CPU take the float32 reference product (within 1e-5 of float64); codes of the wrong dtype
    or scales of the wrong shape are refused with what was expected."""
    from quarl import kernels
    from quarl.formats import quantize

    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    x, w, bias = torch.randn(5, 96), torch.randn(40, 96) * 0.05, torch.randn(40)
    qw, qx = quantize(w, "int8", "weight"), quantize(x, "int8", "activation")
    got = kernels.matmul_from_codes(qx.data, qx.scale, qw, bias, torch.float32)
    want = qx.dequantize(torch.float64) @ qw.dequantize(torch.float64).T + bias.double()
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5
    with pytest.raises(ValueError, match="int8 codes"):
        kernels.matmul_from_codes(qx.data.float(), qx.scale, qw, bias, torch.float32)
    with pytest.raises(ValueError, match=r"float32 scales \[5, 1\]"):
        kernels.matmul_from_codes(qx.data, qx.scale.reshape(-1), qw, bias, torch.float32)


def _deferred_setup(monkeypatch, dtype):
    """A tiny fp8 Qwen2 model with a filled cache, and the fused decoder with codes handed over as on a GPU."""
    from quarl import kernels

    torch.manual_seed(0)
    model = make_model("qwen2", dtype=dtype)
    apply_precision(model, PrecisionConfig(flow="split", format="fp8"))
    engine = FastRolloutEngine(model, None, max_batch_size=8, fused_decode=True)
    engine.generate(rand_prompts([5, 3, 8]), n=1, max_new_tokens=6, temperature=0.0)  # fill the cache
    decoder = FusedDecoder.for_model(model)
    decoder.prepare()
    monkeypatch.setattr(FusedProjection, "codes_handoff", lambda self, m: "fp8")
    monkeypatch.setattr(fused_decode, "linear_codes_handoff", lambda linear, m, fast_paths: "fp8")
    monkeypatch.setattr(kernels, "unit_scales_ok", lambda qweight, m: True)  # as for cuBLAS plans on a GPU
    return model, engine, decoder


def _codes_matmul_f32(handed: list | None = None):
    """A stand-in for `kernels.matmul_from_codes` in float32 (dequantized codes times the dequantized weight: cuBLAS
    would round to bf16), appending each weight's shape to `handed` when given."""
    def matmul(codes, scales, qweight, bias, out_dtype):
        if handed is not None:
            handed.append(tuple(qweight.shape))
        y = (codes.float() * scales) @ qweight.dequantize(torch.float32).T
        return (y if bias is None else y + bias.float()).to(out_dtype)
    return matmul


def _step_logits(model, engine, decoder, deferred):
    decoder.deferred_scales = deferred
    try:
        return both_decode_logits(model, engine, torch.tensor([1, 2, 3]), torch.tensor([4, 0, 9]))
    finally:
        decoder.deferred_scales = DEFAULT_DEFERRED


@pytest.mark.parametrize("which", [True, ("qkv",), ("o", "down"), ("gate_up",), ("qkv", "gate_up", "down")])
def test_deferred_scales_match_the_module_path(monkeypatch, which):
    """With `deferred_scales`, the FP8 GEMMs that get activation codes run with unit per-tensor scales and the
    next piece applies the per-token and per-channel scales (the torch pieces here, codes handed over as on a
    GPU). In float32 the logits equal the module path's to 1e-5 of the largest logit, with the same greedy
    tokens, and exactly the chosen GEMMs (all four kinds for True) took the unit-scale path. The GEMMs left to
    apply their own scales get the handed codes too; cuBLAS rounds their output to bf16, so here they compute in
    float32 (dequantized codes times the dequantized weight) to keep the comparison at float32's precision."""
    from quarl import kernels

    model, engine, decoder = _deferred_setup(monkeypatch, torch.float32)

    monkeypatch.setattr(kernels, "matmul_from_codes", _codes_matmul_f32())
    cfg = model.config
    q_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    out_rows = {"qkv": q_out, "o": cfg.hidden_size, "gate_up": 2 * cfg.intermediate_size, "down": cfg.hidden_size}
    kinds = fused_decode.DEFERRABLE if which is True else which
    shapes = []
    real = fused_decode.unit_scale_matmul
    monkeypatch.setattr(fused_decode, "unit_scale_matmul", lambda *a: shapes.append(tuple(a[1].shape)) or real(*a))
    want, got = _step_logits(model, engine, decoder, which)
    expected = sorted([(out_rows[k], cfg.intermediate_size if k == "down" else cfg.hidden_size) for k in kinds]
                      * cfg.num_layers)
    assert sorted(shapes) == expected
    close(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_plans_without_unit_scales_take_the_codes_with_their_own_scales(monkeypatch):
    """Codes handed over (as on a GPU) to GEMMs whose plan does not allow the unit-scale product
    (`kernels.unit_scales_ok` False: the small-M Triton plans): no unit-scale product runs even with every
    deferral requested, each GEMM takes the codes with its own scales, and float32 logits equal the module
    path's to 1e-5 of the largest."""
    from quarl import kernels

    model, engine, decoder = _deferred_setup(monkeypatch, torch.float32)
    monkeypatch.setattr(kernels, "unit_scales_ok", lambda qweight, m: False)
    handed = []
    monkeypatch.setattr(kernels, "matmul_from_codes", _codes_matmul_f32(handed))
    monkeypatch.setattr(fused_decode, "unit_scale_matmul", lambda *a: pytest.fail("a unit-scale GEMM ran"))
    want, got = _step_logits(model, engine, decoder, True)
    assert len(handed) == 3 * model.config.num_layers  # q/k/v, gate/up and down of every layer took the codes
    close(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_deferred_scales_take_known_names_only():
    model = make_model("qwen2")
    decoder = FusedDecoder.for_model(model)
    decoder.deferred_scales = ["o", "qkv"]
    assert decoder.deferred_scales == frozenset({"o", "qkv"})
    decoder.deferred_scales = False
    assert not decoder.deferred_scales
    decoder.deferred_scales = "qkv"
    assert decoder.deferred_scales == frozenset({"qkv"})
    with pytest.raises(ValueError, match="gate_up"):
        decoder.deferred_scales = ["gate"]
    decoder.deferred_scales = True
    assert decoder.deferred_scales == frozenset(("qkv", "o", "gate_up", "down"))
    assert FusedDecoder.for_model(make_model("qwen2")).deferred_scales == frozenset(("qkv", "o", "down"))


def test_deferred_scales_in_bf16_stay_as_close_as_the_handed_codes_path(monkeypatch):
    """In bf16 the unscaled product is rounded once more than with the scales inside the GEMM. This tiny random
    model magnifies bf16 roundings (the codes path that GPUs run today is already 10 % of the largest logit away
    from the module path), so the deferred logits must be no further from the module path than 1.5 times that."""
    pytest.importorskip("triton")  # the handed-codes path runs through the kernels' dispatch module
    model, engine, decoder = _deferred_setup(monkeypatch, torch.bfloat16)
    want, handed = _step_logits(model, engine, decoder, False)
    _, deferred = _step_logits(model, engine, decoder, True)
    handed_err = float((handed.float() - want.float()).abs().max())
    assert float((deferred.float() - want.float()).abs().max()) <= 1.5 * handed_err + 1e-3 * float(want.abs().max())


def test_graphs_are_keyed_by_the_decoders_mode():
    """A CUDA graph captured with the default deferred scales must not replay once they are off (and back)."""
    from quarl.rollout.sampling import SamplingParams

    model = make_model("qwen2")
    engine = FastRolloutEngine(model, None, max_batch_size=4, use_cuda_graphs=False)
    params = SamplingParams(1.0)
    assert engine._decoder.deferred_scales
    before = engine._graph_key(4, 64, params)
    engine._decoder.deferred_scales = False
    try:
        assert engine._graph_key(4, 64, params) != before
    finally:
        engine._decoder.deferred_scales = DEFAULT_DEFERRED
    assert engine._graph_key(4, 64, params) == before


def test_a_failing_scaled_check_only_turns_the_deferred_mode_off(monkeypatch):
    """The scaled-input variants have their own first-use check: its failure leaves the fused kernels on."""
    import quarl.fallbacks
    from quarl import kernels
    from quarl.kernels import availability, capabilities

    monkeypatch.setattr(capabilities, "CAPABILITIES", capabilities.CapabilityRegistry())
    monkeypatch.setattr(quarl.fallbacks, "_reported", {})  # reported once per process: start afresh
    monkeypatch.setattr(availability, "kernels_available", lambda device=None: True)
    monkeypatch.setattr(availability, "fp8_kernels_available", lambda device=None: True)
    monkeypatch.setattr(capabilities, "_decode_fused_agrees", lambda device, dtype, fp8=True: True)
    monkeypatch.setattr(capabilities, "_scaled_decode_fused_agrees", lambda device, dtype: False)
    with pytest.warns(UserWarning, match="scaled inputs"):
        assert not kernels.decode_fused_scaled_ok(torch.device("cpu"), torch.bfloat16)
    assert kernels.decode_fused_ok(torch.device("cpu"), torch.bfloat16)
    assert capabilities.CAPABILITIES.results() == {("decode_fused", ("cpu", torch.bfloat16)): True,
                                                   ("decode_fused_scaled", ("cpu", torch.bfloat16)): False}


_ROPE_CHECK = textwrap.dedent("""
    import torch
    from quarl.kernels.decode_fused import rope_rows, rope_rows_scaled
    from quarl.model.layers import apply_rope
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    for hq, hkv, d, m in [(28, 4, 128, 3), (8, 2, 64, 2), (3, 3, 32, 4), (5, 1, 16, 1)]:
        n = (hq + 2 * hkv) * d
        angles = torch.rand(m, d // 2) * 100
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()

        def reference(x):  # x [m, n] bf16: PyTorch's bf16 rotary of the q and k heads, and the v heads
            q = x[:, :hq * d].reshape(m, hq, 1, d)
            k = x[:, hq * d:(hq + hkv) * d].reshape(m, hkv, 1, d)
            c, s = cos[:, None, None], sin[:, None, None]
            return apply_rope(q, c, s)[:, :, 0], apply_rope(k, c, s)[:, :, 0], x[:, (hq + hkv) * d:].reshape(m, hkv, d)

        x = torch.randn(m, n).bfloat16()
        q, k = rope_rows(x, cos, sin, hq, hkv, d)
        want = reference(x)
        assert torch.equal(q, want[0]) and torch.equal(k, want[1]), (hq, hkv, d)
        y = (torch.randn(m, n) * 1e4).bfloat16()
        rows, cols = torch.rand(m, 1) * 1e-3, torch.rand(n) * 1e-2
        for bias in (None, torch.randn(n).bfloat16()):
            got = rope_rows_scaled(y, rows, cols, bias, cos, sin, hq, hkv, d)
            x = (y.float() * rows * cols + (0.0 if bias is None else bias.float())).bfloat16()
            for g, w in zip(got, reference(x)):
                assert torch.equal(g, w), (hq, hkv, d, bias is None)
    print("ok")
""")


def test_rotary_kernels_are_bit_exact_in_the_interpreter():
    """`rope_rows` and `rope_rows_scaled` (head halves loaded once, every rounding PyTorch's bf16 one) run by
    Triton's CPU interpreter equal PyTorch's bf16 rotary bit for bit, for several head sizes and head counts (a
    last group of heads only partly filled), and the scaled kernel's v heads equal the scaled product."""
    from interpreter import run_in_interpreter

    run_in_interpreter(_ROPE_CHECK)


_GROUP_CODES_CHECK = textwrap.dedent("""
    import torch
    from quarl.formats import quantize
    from quarl.kernels.decode_fused import rms_norm_rows, silu_mul_rows
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))

    def check(h, codes, scales):
        ref = quantize(h, "fp8-block", "activation")
        n = h.shape[1]
        assert codes.shape == h.shape and scales.shape == ref.scale.shape and scales.stride(0) == 1
        assert torch.equal(scales, ref.scale), (scales - ref.scale).abs().max()
        # The interpreter converts to E4M3 with its own rounding: a value that rounds up to a power of two comes
        # out as half that power (the mantissa carry is lost; rowwise codes show the same). Codes are checked to
        # one E4M3 step (2^-3 relative, plus the smallest subnormal step) apart from that case: a code under the
        # wrong group's scale, or at the wrong column, is far outside it.
        got = codes.float()
        want = ref.data.float()[:, :n]
        lost_carry = (got * 2 == want) & (torch.frexp(want).mantissa.abs() == 0.5)
        near = (got - want).abs() <= want.abs() * 2.0**-3 + 2.0**-9
        assert bool((near | lost_carry).all()) and float(lost_carry.float().mean()) < 0.1

    for m, h in [(3, 200), (2, 512), (1, 64)]:  # a partial last group; whole groups; one group wider than the row
        x, d = torch.randn(m, h).bfloat16() * 3, torch.randn(m, h).bfloat16()
        w = (1 + 0.3 * torch.randn(h)).bfloat16()
        _, hh, codes, scales = rms_norm_rows(x, d, w, None, 1e-6, "fp8-block")
        check(hh, codes, scales)
    for m, n in [(2, 1408), (3, 300), (2, 40000)]:  # row pieces (1024, 256, 128); (256, 64->128); two-pass kernel
        gu = (torch.randn(m, 2 * n) * torch.rand(1, 2 * n) * 8).bfloat16()
        hh, codes, scales = silu_mul_rows(gu[:, :n], gu[:, n:], "fp8-block")
        check(hh, codes, scales)
    print("ok")
""")


def test_group_codes_of_the_fused_kernels_in_the_interpreter():
    """fp8-block codes from the fused norm and SiLU·mul kernels (every 128 columns their own scale, scales
    column-major [M, groups]): run by Triton's CPU interpreter, the scales equal `quarl.formats.quantize`'s bit for
    bit and every code lies within one E4M3 step of the reference code, for partial groups, rows split into
    pieces and the two-pass kernel. (The GPU test checks the codes bit for bit.)"""
    from interpreter import INTERPRETER_PATCH, run_in_interpreter

    run_in_interpreter(INTERPRETER_PATCH + _GROUP_CODES_CHECK)


@pytest.mark.parametrize("deferred,handoff", [(False, True), (True, True), (False, False)])
def test_lora_adapters_keep_the_codes_handoff_with_the_same_logits(monkeypatch, deferred, handoff):
    """`FastPaths.lora_codes_handoff` (the engine's): with adapters on every linear, the fused decoder still hands
    FP8 codes to each base GEMM (as on a GPU; here the torch pieces) and adds each adapter from the bf16
    activations written alongside; the unit-scale (deferred) path is skipped for linears with adapters. Float32
    logits equal the module path's to 1e-5 of the largest logit, and every GEMM took the handed codes; with the
    handoff off in the engine's paths, none did, and the logits are still the module path's."""
    from quarl import kernels
    from quarl.fast_paths import FastPaths
    from quarl.precision import LoraConfig

    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = make_model("qwen2", dtype=torch.float32)
    apply_precision(model, PrecisionConfig(flow="split", format="fp8", lora=LoraConfig(rank=4)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    engine = FastRolloutEngine(model, None, max_batch_size=8, fused_decode=True,
                               fast_paths=FastPaths(lora_codes_handoff=handoff))
    engine.generate(rand_prompts([5, 3, 8]), n=1, max_new_tokens=6, temperature=0.0)  # fill the cache
    decoder = FusedDecoder.for_model(model)
    decoder.prepare()
    assert decoder.fast_paths is engine.fast_paths
    monkeypatch.setattr(fused_decode, "_handoff", lambda qweight, linear, m: True)
    handed = []
    monkeypatch.setattr(kernels, "matmul_from_codes", _codes_matmul_f32(handed))
    monkeypatch.setattr(fused_decode, "unit_scale_matmul", lambda *a: pytest.fail("a unit-scale GEMM with LoRA"))
    want, got = _step_logits(model, engine, decoder, deferred)
    cfg = model.config
    assert len(handed) == (3 * cfg.num_layers if handoff else 0)  # q/k/v, gate/up and down of every layer
    lora_free = _step_logits_without_lora(model, engine, decoder)
    assert (got - lora_free).abs().max() > 1e-3  # the adapters act
    close(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _step_logits_without_lora(model, engine, decoder):
    """The fused logits with every adapter's B zeroed for the call (restored after)."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in saved:
                p.zero_()
    try:
        return _step_logits(model, engine, decoder, False)[1]
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
