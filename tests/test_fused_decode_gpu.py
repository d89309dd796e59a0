"""GPU: the fused decode kernels (quarl.kernels.decode_fused) against the PyTorch module math, and the fused
decode forward against the module-by-module one.

Tolerances: the residual add, SiLU·mul and rotary kernels round exactly where PyTorch rounds, so they must be bit
for bit equal, up to the float32 summation order of the norm's mean square and the exp of SiLU: at most one bf16
rounding step apart (2^-7 relative) and at most max(2, 0.1 %) elements not identical. FP8/int8 codes are checked bit
for bit against `quarl.formats.quantize` of the kernel's own bf16 values. Logits of the fused forward vs the module
forward of a bf16 model: 3e-2 of the largest logit (a different GEMM algorithm for the stacked weights rounds bf16
outputs differently).
"""

import pytest
import torch
import torch.nn.functional as F

from quarl import kernels
from quarl.formats import quantize
from quarl.model.layers import apply_rope
from quarl.model.precision_apply import apply_precision
from quarl.precision import PrecisionConfig
from quarl.rollout.fast_engine import FastRolloutEngine
from quarl.rollout.fused_decode import both_decode_logits
from tiny_models import small_qwen2

pytestmark = [pytest.mark.gpu, pytest.mark.fp8]
DEV = "cuda"
BF16 = torch.bfloat16


def one_rounding_apart(got, want):
    g, w = got.float(), want.float()
    assert bool(((g - w).abs() <= w.abs() * 2.0**-7 + 1e-30).all()), (g - w).abs().max()
    # A float32 ulp of difference in a row's mean square flips a bf16 rounding about once in 10^4 elements, so a
    # small row may hold one or two such flips: allow max(2, 0.1 %) differing elements.
    assert int((g != w).sum()) <= max(2, g.numel() // 1000), int((g != w).sum())


def assert_codes_of(h, codes, scales, fmt):
    ref = quantize(h, fmt, "activation")  # fp8-block pads K to whole groups; the kernels write K columns
    assert torch.equal(codes.view(torch.uint8), ref.data.view(torch.uint8)[:, :h.shape[1]])
    assert torch.equal(scales, ref.scale)
    if fmt == "fp8-block":
        assert scales.stride(0) == 1  # column-major, as torch._scaled_mm's 1x128 scaling reads it


def test_the_self_check_accepts_the_kernels():
    assert kernels.decode_fused_ok(torch.device(DEV), BF16)
    assert kernels.decode_fused_scaled_ok(torch.device(DEV), BF16)  # the scaled-input variants too
    assert kernels.decode_fused_group_ok(torch.device(DEV))  # and the fp8-block group codes
    assert kernels.decode_fused_smooth_ok(torch.device(DEV))  # and the smoothed codes


@pytest.mark.parametrize("m,h", [(1, 896), (37, 3584), (512, 5000)])
@pytest.mark.parametrize("quant", [None, "fp8", "int8", "fp8-block"])
def test_add_rms_norm_kernel(m, h, quant):
    from quarl.kernels.decode_fused import rms_norm_rows

    x, d = torch.randn(m, h, device=DEV, dtype=BF16) * 3, torch.randn(m, h, device=DEV, dtype=BF16)
    w, noise = 1 + 0.3 * torch.randn(h, device=DEV, dtype=BF16), 0.05 * torch.randn(h, device=DEV)  # noise: float32
    r, hh, codes, scales = rms_norm_rows(x, d, w, noise, 1e-6, quant)
    assert torch.equal(r, x + d)
    rf = (x + d).float()
    want = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.float() + noise)).to(BF16)
    one_rounding_apart(hh, want)
    if quant:
        assert_codes_of(hh, codes, scales, quant)
        _, none, c2, s2 = rms_norm_rows(x, d, w, noise, 1e-6, quant, write_h=False)
        assert none is None and torch.equal(c2.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(s2, scales)
    r0, h0, _, _ = rms_norm_rows(x, None, w, None, 1e-6)  # no residual add, no noise
    assert r0 is x
    xf = x.float()
    one_rounding_apart(h0, (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(BF16))


@pytest.mark.parametrize("m,h", [(1, 576), (37, 3584)])
def test_the_last_layers_residual_add_equals_the_torch_definition(m, h):
    """The fused decode's last layer adds its MLP output (a unit-scale FP8 product, or not) with `add_delta` before
    the model's final norm, through the norm kernel that adds it everywhere else: bit for bit the PyTorch
    definition (scaled, rounded to bf16, added and rounded)."""
    from quarl.model.layers import RMSNorm
    from quarl.rollout.fused_decode import add_delta

    norm = RMSNorm(h).to(DEV, BF16)
    x, d = torch.randn(m, h, device=DEV, dtype=BF16) * 3, torch.randn(m, h, device=DEV, dtype=BF16) * 40
    rows, cols = torch.rand(m, 1, device=DEV) / 50, torch.rand(h, device=DEV) / 50
    scaled = (d.float() * rows * cols).to(BF16)
    assert torch.equal(add_delta(norm, x, d, (rows, cols)), (x.float() + scaled.float()).to(BF16))
    assert torch.equal(add_delta(norm, x, d), (x.float() + d.float()).to(BF16))


@pytest.mark.parametrize("m,n", [(1, 1408), (300, 18944), (64, 1000), (3, 40000)])  # 40000: two-pass kernel
@pytest.mark.parametrize("quant", [None, "fp8", "int8", "fp8-block"])
def test_silu_mul_kernel_on_the_halves_of_a_fused_output(m, n, quant):
    from quarl.kernels.decode_fused import silu_mul_rows

    gu = torch.randn(m, 2 * n, device=DEV, dtype=BF16) * 4
    g, u = gu[:, :n], gu[:, n:]
    h, codes, scales = silu_mul_rows(g, u, quant)
    one_rounding_apart(h, F.silu(g) * u)
    if quant:
        assert_codes_of(h, codes, scales, quant)


@pytest.mark.parametrize("m,h,n", [(1, 576, 1536), (128, 576, 1536), (37, 3584, 18944), (3, 896, 40000)])
@pytest.mark.parametrize("quant", ["int8", "fp8", "fp8-block"])
def test_smoothed_codes_of_the_norm_and_silu_mul_kernels(m, h, n, quant):
    """With a smoothed next linear (SmoothQuant factors s), the kernels' codes are bit for bit those of their own
    bf16 values divided by s as `QuantLinear.smooth_input` divides (float32, rounded once), and the values they
    write stay undivided (SmolLM2's 576 / 1536, a 7B MLP's 18944, the two-pass 40000)."""
    from quarl.kernels.decode_fused import rms_norm_rows, silu_mul_rows

    x, d = torch.randn(m, h, device=DEV, dtype=BF16) * 3, torch.randn(m, h, device=DEV, dtype=BF16)
    w = 1 + 0.3 * torch.randn(h, device=DEV, dtype=BF16)
    s_h, s_n = torch.rand(h, device=DEV) * 8 + 0.01, torch.rand(n, device=DEV) * 8 + 0.01
    _, hh, codes, scales = rms_norm_rows(x, d, w, None, 1e-6, quant, smooth=s_h)
    _, plain, _, _ = rms_norm_rows(x, d, w, None, 1e-6, quant)
    assert torch.equal(hh, plain)
    assert_codes_of((hh / s_h).to(BF16), codes, scales, quant)
    gu = torch.randn(m, 2 * n, device=DEV, dtype=BF16) * 4
    a, codes, scales = silu_mul_rows(gu[:, :n], gu[:, n:], quant, smooth=s_n)
    assert torch.equal(a, silu_mul_rows(gu[:, :n], gu[:, n:], quant)[0])
    assert_codes_of((a / s_n).to(BF16), codes, scales, quant)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_smoothed_fused_decode_hands_codes_and_matches_the_module_path(monkeypatch, fmt):
    """A smoothed split-flow rollout (SmoothQuant factors on every dense linear) decodes through the fused
    kernels' smoothed codes at a small batch (q/k/v, gate/up and down take handed codes) with the module path's
    logits: within 3e-2 of the largest, argmaxes agreeing (the bound of the unsmoothed test above)."""
    from quarl.model.smoothing import calibration_batches, smooth_rollout
    from quarl.rollout.fused_decode import FusedDecoder
    from tiny_models import rand_prompts

    torch.manual_seed(0)
    model = small_qwen2()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[1, 5]] *= 40.0  # outlier channels
    apply_precision(model, PrecisionConfig(flow="split", format=fmt, smooth_alpha=0.5))
    assert smooth_rollout(model, calibration_batches(rand_prompts([7, 9, 5]), DEV), 0.5) > 0
    FusedDecoder.for_model(model).deferred_scales = False
    engine = FastRolloutEngine(model, None, max_batch_size=64)
    engine.generate([[1, 2, 3, 4]] * 8, n=1, max_new_tokens=4, temperature=0.0)  # allocates the cache
    handed = []
    from_codes = kernels.matmul_from_codes
    monkeypatch.setattr(kernels, "matmul_from_codes", lambda *a: handed.append(1) or from_codes(*a))
    tokens, positions = torch.randint(0, 4096, (3,), device=DEV), torch.randint(0, 60, (3,), device=DEV)
    want, got = both_decode_logits(model, engine, tokens, positions)
    assert len(handed) == 3 * len(model.model.layers)
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * scale, rtol=0)
    assert bool((got.argmax(-1) == want.argmax(-1)).all())


@pytest.mark.parametrize("hq,hkv,d", [(28, 4, 128), (8, 2, 64), (3, 3, 32)])
def test_rope_kernel_is_bit_exact(hq, hkv, d):
    from quarl.kernels.decode_fused import rope_rows

    m = 77
    qkv = torch.randn(m, (hq + 2 * hkv) * d, device=DEV, dtype=BF16)
    angles = torch.rand(m, d // 2, device=DEV) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    q, k = rope_rows(qkv, cos, sin, hq, hkv, d)
    c, s = cos[:, None, None], sin[:, None, None]
    assert torch.equal(q, apply_rope(qkv[:, :hq * d].reshape(m, hq, 1, d), c, s)[:, :, 0])
    assert torch.equal(k, apply_rope(qkv[:, hq * d:(hq + hkv) * d].reshape(m, hkv, 1, d), c, s)[:, :, 0])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m,n,k", [(1, 37888, 3584), (3, 3584, 18944), (16, 3584, 3584), (64, 4608, 3584),
                                   (512, 3584, 3584), (1000, 3584, 3584), (512, 37888, 3584), (4096, 4608, 3584)])
def test_matmul_from_codes_equals_the_quantizing_matmul(fmt, m, n, k):
    """Per-token int8 / FP8 codes handed over give the quantizing matmul's result bit for bit, whichever GEMM the
    plan names at that shape (cuBLAS FP8, the persistent TMA W8A8 kernel, the transposed TMA decode kernel),
    wherever `codes_handoff` says the plan takes codes (a prequant GEMV would too; no table names one now).
    Everywhere (also where it does not: bf16, or a kernel quantizing inside) the result lies within 2e-2 of the
    largest float64 reference value (the bf16 output rounding and Hopper's reduced-precision FP8 accumulation;
    measured about 3e-3)."""
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    qw = quantize(torch.randn(n, k, device=DEV, dtype=BF16) * 0.02, fmt, "weight")
    bias = torch.randn(n, device=DEV, dtype=BF16)
    qx = quantize(x, fmt, "activation")
    got = kernels.matmul_from_codes(qx.data, qx.scale, qw, bias, BF16)
    if kernels.codes_handoff(qw, False, m):
        assert torch.equal(got, kernels.try_quantized_matmul(x, qw, False, bias))
    want = (qx.dequantize(torch.float64) @ qw.dequantize(torch.float64).T + bias.double())
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 2e-2, err


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_small_batches_hand_codes_to_the_triton_plans(fmt):
    """At decode batch sizes the dispatched int8 / fp8 plans of the 7B shapes that run a separate quantization
    pass (prequant W8A8 tiles) all take handed codes; the deferred unit-scale cuBLAS product is left to
    cuBLAS and the persistent (prefill) TMA plans."""
    taken = 0
    for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)):
        qw = quantize(torch.randn(n, k, device=DEV, dtype=BF16) * 0.02, fmt, "weight")
        for m in (1, 16, 64):
            plan = kernels.plan_for(fmt, False, m, n, k, torch.device(DEV))
            prequant = plan.kind in ("w8a8", "gemv") and plan.x_mode == "prequant"
            assert kernels.codes_handoff(qw, False, m) == (prequant or plan.kind == "scaled_mm"), (n, k, m, plan)
            taken += prequant
            persistent_tma = plan.cfg is not None and plan.cfg.tma and not plan.cfg.swap_ab
            assert kernels.unit_scales_ok(qw, m) == (fmt == "fp8" and (plan.kind == "scaled_mm" or persistent_tma))
    assert taken > 0


def test_fp8_block_matmul_from_group_codes_equals_the_quantizing_matmul():
    """fp8-block: the fused norm's 1x128-group codes (column-major scales) handed to cuBLAS blockwise give the
    quantizing matmul's result bit for bit; row-major scales are refused with a clear error."""
    from quarl.kernels.decode_fused import rms_norm_rows

    x, w = torch.randn(512, 3584, device=DEV, dtype=BF16), 1 + 0.1 * torch.randn(3584, device=DEV, dtype=BF16)
    qw = quantize(torch.randn(3584, 3584, device=DEV, dtype=BF16) * 0.02, "fp8-block", "weight")
    bias = torch.randn(3584, device=DEV, dtype=BF16)
    assert kernels.codes_handoff(qw, False, 512)
    assert not kernels.codes_handoff(qw, False, 504)  # rows not a multiple of 16: no blockwise handoff
    _, h, codes, scales = rms_norm_rows(x, None, w, None, 1e-6, "fp8-block", write_h=True)
    got = kernels.matmul_from_codes(codes, scales, qw, bias, BF16)
    assert torch.equal(got, kernels.try_quantized_matmul(h, qw, False, bias))
    with pytest.raises(ValueError, match="column-major"):
        kernels.matmul_from_codes(codes, scales.contiguous(), qw, bias, BF16)


def _small_model(fmt):
    torch.manual_seed(0)
    model = small_qwen2(vocab_size=4096, num_layers=3, device=DEV)
    apply_precision(model, PrecisionConfig(flow="bf16") if fmt is None else PrecisionConfig(flow="split", format=fmt))
    return model


@pytest.mark.parametrize("fmt,kv", [(None, "auto"), ("fp8", "fp8"), ("fp8", "fp8-token"), ("int8", "auto"),
                                    ("nvfp4", "fp8"), ("fp8-block", "fp8")])
def test_fused_decoder_logits_match_the_module_path(fmt, kv):
    """With the scales applied in the GEMMs (deferred scales off) the fused step runs the module path's operations:
    its logits lie within 3e-2 of the largest, and argmaxes agree."""
    from quarl.rollout.fused_decode import FusedDecoder

    model = _small_model(fmt)
    FusedDecoder.for_model(model).deferred_scales = False
    engine = FastRolloutEngine(model, None, max_batch_size=512, kv_cache_dtype=kv)
    engine.generate([[1, 2, 3, 4]] * 8, n=1, max_new_tokens=4, temperature=0.0)  # allocates the cache
    for batch in (3, 512):  # codes handed to the small-M Triton plans at 3 rows, to cuBLAS FP8 (fp8) at 512
        tokens = torch.randint(0, 4096, (batch,), device=DEV)
        positions = torch.randint(0, 60, (batch,), device=DEV)
        want, got = both_decode_logits(model, engine, tokens, positions)
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * scale, rtol=0)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_small_batches_take_handed_codes_with_the_module_paths_logits(monkeypatch, fmt):
    """At decode batch sizes the int8 / fp8 Triton plans take the codes written by the norm and SiLU·mul kernels
    (counted), with their own scales (the default deferred scales stay with cuBLAS / TMA plans): the codes are
    those the GEMM would have made from the kernels' bf16 outputs, so the logits equal the module path's bit for
    bit."""
    from quarl.rollout import fused_decode

    model = _small_model(fmt)
    assert fused_decode.FusedDecoder.for_model(model).deferred_scales == frozenset(fused_decode.DEFAULT_DEFERRED)
    engine = FastRolloutEngine(model, None, max_batch_size=64)
    engine.generate([[1, 2, 3, 4]] * 8, n=1, max_new_tokens=4, temperature=0.0)  # allocates the cache
    handed = []
    real = kernels.matmul_from_codes
    monkeypatch.setattr(kernels, "matmul_from_codes", lambda *a: handed.append(a[0].dtype) or real(*a))
    for batch in (3, 16):
        tokens = torch.randint(0, 4096, (batch,), device=DEV)
        positions = torch.randint(0, 60, (batch,), device=DEV)
        handed.clear()
        want, got = both_decode_logits(model, engine, tokens, positions)
        assert len(handed) == 3 * 3, handed  # q/k/v, gate/up and down of each of the 3 layers
        assert set(handed) == {torch.int8 if fmt == "int8" else torch.float8_e4m3fn}
        assert torch.equal(got, want)


@pytest.mark.parametrize("kv", ["fp8", "auto"])
def test_deferred_scales_match_the_module_path(monkeypatch, kv):
    """`FusedDecoder.deferred_scales` (unit-scale cuBLAS FP8, scales applied by the next kernel) rounds each product
    to bf16 once more before its scales. The small random model is chaotic: that one rounding moves its logits as
    much as any perturbation of that size does (a flipped FP8 code grows layer after layer). So one step's logits
    at 512 rows (every FP8 GEMM on codes) must lie no further from the module path, on average, than the module
    path's own logits move when the embeddings are perturbed by one relative 2^-9 (a bf16 rounding), with a margin
    of 1.5; and an engine generating with it (captured graphs, 256 rows: also deferred) must give the module-path
    engine's greedy tokens through the first decode step for most sequences. Later steps diverge as under any such
    perturbation (measured: 0.86-0.89 of the argmaxes agree per step, so whole 16-token sequences agree for about a
    fifth). A misapplied scale moves the logits by the activations' size, far beyond these bounds."""
    from quarl.rollout.fused_decode import FusedDecoder

    model = _small_model("fp8")
    decoder = FusedDecoder.for_model(model)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,)).tolist() for n in torch.randint(3, 20, (128,)).tolist()]
    plain = FastRolloutEngine(model, None, max_batch_size=512, fused_decode=False, kv_cache_dtype=kv)
    want_tokens = [c.token_ids for o in plain.generate(prompts, n=2, max_new_tokens=16, temperature=0.0)
                   for c in o.completions]
    decoder.deferred_scales = True
    engine = FastRolloutEngine(model, None, max_batch_size=512, kv_cache_dtype=kv)
    got_tokens = [c.token_ids for o in engine.generate(prompts, n=2, max_new_tokens=16, temperature=0.0)
                  for c in o.completions]
    assert engine.last_stats["cuda_graphs"] and engine.last_stats.get("graph_captures", 0) > 0
    assert sum(a[:2] == b[:2] for a, b in zip(got_tokens, want_tokens)) >= 0.6 * len(want_tokens)
    tokens = torch.randint(0, 4096, (512,), device=DEV)
    positions = torch.randint(0, 60, (512,), device=DEV)
    from quarl.rollout import fused_decode

    unit_products = []
    real = fused_decode.unit_scale_matmul
    monkeypatch.setattr(fused_decode, "unit_scale_matmul", lambda *a: unit_products.append(1) or real(*a))
    want, got = both_decode_logits(model, engine, tokens, positions)
    assert unit_products  # the deferred-scale path ran at 512 rows
    emb = model.model.embed_tokens.weight
    saved = emb.detach().clone()
    with torch.no_grad():
        emb.copy_((emb.float() * (1 + 2.0**-9 * torch.randn_like(emb, dtype=torch.float32))).to(emb.dtype))
    perturbed, _ = both_decode_logits(model, engine, tokens, positions)
    with torch.no_grad():
        emb.copy_(saved)
    moved = float((perturbed.float() - want.float()).abs().mean())
    assert moved > 0
    assert float((got.float() - want.float()).abs().mean()) <= 1.5 * moved


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_captured_graphs_follow_the_weight_sync(fmt):
    """Generate, update the master weights and sync (refresh_rollout_weights), generate again: the fused engine's
    CUDA graphs must read the new stacked weights (they are views the sync writes into), so its greedy tokens keep
    agreeing with the module-path engine's, and both change from the first round."""
    from quarl.model.precision_apply import refresh_rollout_weights
    from quarl.model.qlinear import QuantLinear

    model = _small_model(fmt)

    @torch.no_grad()
    def update():
        for m in model.modules():
            if isinstance(m, QuantLinear) and m.weight is not None:
                m.weight.add_(torch.randn_like(m.weight) * 0.05)
        refresh_rollout_weights(model)

    fused, rounds, _ = _greedy_rounds_around_an_update(model, update)
    assert fused._graphs and fused.use_cuda_graphs  # the second round replayed graphs captured in the first
    assert sum(x != y for x, y in zip(*rounds)) >= 0.5 * len(rounds[0])  # the update changed the outputs


def _greedy_rounds_around_an_update(model, update, check_round=lambda fused: None):
    """Greedy generation by the fused engine and the module-path engine, then update(), then again: each round's
    tokens must mostly agree between the two (and pass check_round(fused engine)). Returns (fused engine, the
    fused engine's tokens per round, {graph key: id} of its graphs after the first round)."""
    torch.manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,)).tolist() for n in (5, 9, 3, 12, 7, 4)]
    fused = FastRolloutEngine(model, None, max_batch_size=16)
    plain = FastRolloutEngine(model, None, max_batch_size=16, fused_decode=False)
    rounds, graphs = [], None
    for _ in range(2):
        a = [c.token_ids for o in fused.generate(prompts, n=2, max_new_tokens=24, temperature=0.0)
             for c in o.completions]
        b = [c.token_ids for o in plain.generate(prompts, n=2, max_new_tokens=24, temperature=0.0)
             for c in o.completions]
        assert sum(x == y for x, y in zip(a, b)) >= 0.75 * len(a), (a, b)
        check_round(fused)
        rounds.append(a)
        if graphs is None:
            graphs = {key: id(g) for key, g in fused._graphs.items()}
        update()
    return fused, rounds, graphs


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
def test_captured_graphs_follow_the_adapter_update(fmt):
    """A LoRA model with `FastPaths.stack_rollout_lora` (the default): generate, change every adapter (as an optimizer step would), generate
    again. The second round replays the graphs captured in the first, which read the stacked adapters that the
    next rollout start rewrites in place: its greedy tokens keep agreeing with the module-path engine's, and both
    change from the first round."""
    from quarl.precision import LoraConfig

    torch.manual_seed(0)
    model = small_qwen2(vocab_size=4096, num_layers=3, device=DEV)
    apply_precision(model, PrecisionConfig(flow="split", format=fmt, lora=LoraConfig(rank=8)))

    @torch.no_grad()
    def update():  # new adapters (B = 0 at init: draw them, so they act)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)

    def stacked(fused):  # after generate() (rollout mode is off again): the parts' copies are the stack's blocks
        for proj in fused._decoder.qkv + fused._decoder.gate_up:
            assert proj._adapter is not None
            a, b = proj._adapter
            for p, row, start in proj._adapter_blocks():
                assert p._rollout_adapter[0].data_ptr() == a[row:].data_ptr()
                assert p._rollout_adapter[1].data_ptr() == b[start:, row:].data_ptr()

    update()
    fused, rounds, graphs = _greedy_rounds_around_an_update(model, update, stacked)
    assert fused.use_cuda_graphs and graphs
    kept = [key for key, g in fused._graphs.items() if graphs.get(key) == id(g)]
    assert kept, "the second round recaptured every graph instead of replaying the first round's"
    assert sum(x != y for x, y in zip(*rounds)) >= 0.5 * len(rounds[0])  # the new adapters changed the outputs


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
def test_cuda_fused_projection_accumulates_each_parts_lora_in_place(fmt):
    """Rollout with LoRA on CUDA: the stacked projection adds the parts' adapters as one stacked pair (x @ A^T,
    then addmm with the block-diagonal B into the whole output); equal to the parts run one by one (each adding
    its adapter into its own columns) within one bf16 rounding of the output."""
    from quarl.model.qlinear import QuantLinear
    from quarl.rollout.fused_decode import FusedProjection

    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    parts = []
    for n in (512, 128, 128):
        p = QuantLinear(256, n, bias=True).cuda().to(torch.bfloat16)
        p.configure(rollout_format=fmt, lora_rank=8)
        with torch.no_grad():
            p.bias.normal_()
            p.lora_B.normal_()
        p.set_rollout(True)
        parts.append(p)
    fused = FusedProjection(parts)  # the default paths stack the rollout adapters
    fused.prepare()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = fused(x)
        want = torch.cat([p(x) for p in parts], dim=-1)
        base = torch.cat([p._rollout_forward(x, p.bias) for p in parts], dim=-1)
        lora_only = torch.cat([p.add_lora(torch.zeros_like(b), x)
                               for p, b in zip(parts, base.split((512, 128, 128), 1))], dim=-1)
    assert fused.fused_qweight is not None and fused._adapters_current()  # the stacked paths ran
    assert float(lora_only.abs().max()) > 1.0  # the adapters contribute visibly
    # The stacked and the per-part GEMMs may round the base differently, and the adapter can cancel the base: the
    # tolerance is relative to both terms' magnitudes (two bf16 roundings).
    err = (got.float() - want.float()).abs()
    tol = 2.0**-7 * (base.float().abs() + lora_only.float().abs()) + 2.0**-7
    assert bool((err <= tol).all()), (seed, float((err / tol).max()))


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
def test_lora_codes_handoff_matches_the_module_path(monkeypatch, fmt):
    """`FastPaths.lora_codes_handoff` (the default) on the GPU: with adapters on every linear, at 512 rows the norm / SiLU·mul kernels write
    codes and activations, the base GEMMs take the codes (counted) and the adapters the activations; logits as in
    `test_fused_decoder_logits_match_the_module_path` (3e-2 of the largest, argmaxes agree)."""
    from quarl import kernels
    from quarl.precision import LoraConfig
    from quarl.rollout import fused_decode

    torch.manual_seed(0)
    model = small_qwen2(vocab_size=4096, num_layers=3, device=DEV)
    apply_precision(model, PrecisionConfig(flow="split", format=fmt, lora=LoraConfig(rank=8)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    fused_decode.FusedDecoder.for_model(model).deferred_scales = False
    engine = FastRolloutEngine(model, None, max_batch_size=512, kv_cache_dtype="fp8")
    engine.generate([[1, 2, 3, 4]] * 8, n=1, max_new_tokens=4, temperature=0.0)  # allocates the cache
    handed = []
    real = kernels.matmul_from_codes
    monkeypatch.setattr(kernels, "matmul_from_codes", lambda *a: handed.append(1) or real(*a))
    tokens = torch.randint(0, 4096, (512,), device=DEV)
    positions = torch.randint(0, 60, (512,), device=DEV)
    want, got = both_decode_logits(model, engine, tokens, positions)
    assert len(handed) >= 2 * 3  # at least q/k/v and gate/up of each of the 3 layers took handed codes
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * scale, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("fmt", ["int8", "fp8-block"])
def test_unified_on_bf16_gemms_never_calls_a_quantized_kernel_in_the_fused_decode(monkeypatch, fmt):
    """The unified flow on bf16 GEMMs (`precision.kernel_forward=false`): the fast engine's fused decode (stacked
    projections, CUDA graphs) multiplies the dequantized caches with bf16 GEMMs, as the module path and training do,
    and never runs a quantized kernel; its logits match the module path's within the bf16 tolerance."""
    from quarl.model.qlinear import QuantLinear

    model = small_qwen2(vocab_size=4096, num_layers=3, device=DEV)
    apply_precision(model, PrecisionConfig(flow="unified", format=fmt, kernel_forward=False))
    assert all(m.rollout_avoids_kernel() for n, m in model.named_modules()
               if isinstance(m, QuantLinear) and not n.endswith("lm_head"))

    def refuse(*args, **kwargs):
        raise AssertionError("a quantized kernel ran in the unified flow on bf16 GEMMs")

    for name in ("quantized_matmul", "try_quantized_matmul", "matmul_from_codes"):
        monkeypatch.setattr(kernels, name, refuse)
    engine = FastRolloutEngine(model, None, max_batch_size=64)
    engine.generate([[1, 2, 3, 4]] * 8, n=1, max_new_tokens=6, temperature=0.0)
    assert engine._graphs and engine.use_cuda_graphs
    for batch in (3, 64):
        tokens = torch.randint(0, 4096, (batch,), device=DEV)
        positions = torch.randint(0, 60, (batch,), device=DEV)
        want, got = both_decode_logits(model, engine, tokens, positions)
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * scale, rtol=0)
