"""Batch-invariant kernels (`quarl.kernels.batch_invariant`) in Triton's interpreter on the CPU, and the settings that
turn them on (`precision.batch_invariant`).

Kernel tolerances (fp16 here: the interpreter's bf16 dot is not faithful; the GPU tests cover bf16): against the
torch definitions, which sum in float32 in another order, two fp16 spacings of the output's magnitude; against
float64, four (attention rounds its probabilities to fp16 before the second product, as flash attention does;
with unit-variance scores that stays within the bound). Gradients, which torch computes from a recompute: RMSNorm
within 1e-2 of float64 for x (fp16 products of O(1) values) and 0.1 for the weight (a sum over 21 rows of
O(1) terms), attention within 1e-2 of the largest float64 gradient. Invariance is exact: a row computed alone or in
any batch has the same bits, and a decode step's query (one column of a slot cache) gets the bits the same query
gets inside a left-padded training row. Both scripts sum the interpreter's tile products in float64
(`ORDER_FREE_DOT_PATCH`): numpy's float32 matmul, which the interpreter's tl.dot is, sums a row in an order that
depends on the row's place in its tile on some CPUs, where a GPU tile sums every row alike. End to end, rollout
and training log-probs agree within 1e-5: the same fp16 logits through two float32 log-softmax computations.
"""

import textwrap

import pytest

from interpreter import INTERPRETER_PATCH, ORDER_FREE_DOT_PATCH, run_in_interpreter
from quarl.config import ConfigError, load_config
from quarl.model.precision_apply import apply_precision
from quarl.precision import PrecisionConfig
from tiny_models import make_model

_KERNELS = INTERPRETER_PATCH + ORDER_FREE_DOT_PATCH + textwrap.dedent("""
    import math
    import torch
    import torch.nn.functional as F
    from quarl.kernels import batch_invariant as bi

    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    print("seed", seed)
    dt, ulp = torch.float16, 2.0**-10

    def close(got, want, exact, scale):
        assert got.dtype == dt
        assert float((got.double() - want.double()).abs().max()) <= 2 * ulp * scale, "vs torch"
        assert float((got.double() - exact).abs().max()) <= 4 * ulp * scale, "vs float64"

    # linear: K not a multiple of the tile (200), N neither (130), bias and an added term
    for M, N, K in [(70, 130, 200), (1, 576, 576), (129, 64, 1536)]:
        x, w = torch.randn(M, K).to(dt), (torch.randn(N, K) / math.sqrt(K)).to(dt)
        b, a = torch.randn(N).to(dt), torch.randn(M, N).to(dt)
        y = bi.linear(x, w, b, a)
        exact = x.double() @ w.double().t() + b.double() + a.double()
        close(y, bi.linear_torch(x, w, b, a), exact, float(exact.abs().max()))
        for rows in (slice(0, 1), slice(M // 2, M // 2 + 3), slice(M - 1, M)):
            assert torch.equal(bi.linear(x[rows], w, b, a[rows]), y[rows]), (M, N, K, rows)
    # linear's gradients are torch's GEMMs of the same operands
    x = torch.randn(9, 40).to(dt).requires_grad_()
    w = (torch.randn(24, 40) / 7).to(dt).requires_grad_()
    g = torch.randn(9, 24).to(dt)
    bi.linear(x, w).backward(g)
    assert torch.equal(x.grad, g @ w.detach()) and torch.equal(w.grad, g.t() @ x.detach())

    # RMSNorm with AQN noise (float32), D = 576 (not a power of two)
    x, w = torch.randn(3, 7, 576).to(dt), (1 + 0.3 * torch.randn(576)).to(dt)
    noise = torch.randn(576) * 1e-3
    y = bi.rms_norm(x, w, 1e-5, noise)
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * (w.double() + noise.double())
    close(y, bi.rms_norm_torch(x, w, 1e-5, noise), exact, float(exact.abs().max()))
    assert torch.equal(bi.rms_norm(x[1:2, 3:4], w, 1e-5, noise), y[1:2, 3:4])
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    bi.rms_norm(xg, wg, 1e-5).backward(torch.ones_like(x))
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * wr).sum().backward()
    assert torch.allclose(xg.grad.double(), xr.grad, atol=1e-2, rtol=1e-2)
    assert torch.allclose(wg.grad.double(), wr.grad, atol=0.1, rtol=1e-2)

    # attention over a left-padded batch (rows of 80, 50 and 9 tokens), GQA 6:2, head_dim 64
    B, Hq, Hkv, T, D = 3, 6, 2, 80, 64
    lens = torch.tensor([80, 50, 9])
    q, k, v = torch.randn(B, Hq, T, D).to(dt), torch.randn(B, Hkv, T, D).to(dt), torch.randn(B, Hkv, T, D).to(dt)
    first, zeros, S = T - lens, torch.zeros(B, dtype=torch.long), torch.full((B,), T)
    out = bi.attention(q, k, v, first, zeros, S)
    real = (torch.arange(T)[None, :] >= first[:, None])[:, None, :, None]
    mask = bi.visible_keys(first, zeros, S, T, T)
    s = (q.double() @ k.double().repeat_interleave(3, 1).transpose(-1, -2)) / 8.0
    exact = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0) @ \\
        v.double().repeat_interleave(3, 1)
    close(out * real, bi.attention_torch(q, k, v, first, zeros, S) * real, exact * real, float(exact.abs().max()))
    assert float(out[~real.expand_as(out)].abs().max()) == 0.0  # padding queries see no key: 0, not NaN
    # a decode step: row b's query at column c of a slot cache that holds the row from column 0
    for b in range(B):
        start, n = int(first[b]), int(lens[b])
        cache_k, cache_v = k[b:b + 1, :, start:].contiguous(), v[b:b + 1, :, start:].contiguous()
        for c in (0, 1, n // 2, n - 1):
            one = bi.attention(q[b:b + 1, :, start + c:start + c + 1].contiguous(), cache_k, cache_v,
                               torch.zeros(1, dtype=torch.long), torch.tensor([c]), torch.tensor([c + 1]))
            assert torch.equal(one[:, :, 0], out[b:b + 1, :, start + c]), (b, c)
    # gradients: SDPA's of the same masked attention
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn(B, Hq, T, D).to(dt) * real
    bi.attention(qg, kg, vg, first, zeros, S).backward(g)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    keep = mask | ~mask.any(-1, keepdim=True)
    F.scaled_dot_product_attention(qr, kr, vr, attn_mask=keep, enable_gqa=True).backward(g.double())
    for got, want in ((qg.grad, qr.grad), (kg.grad, kr.grad), (vg.grad, vr.grad)):
        assert float((got.double() - want).abs().max()) <= 1e-2 * float(want.abs().max()), "gradient"
    # keys and values with more rows than queries (a slot cache): the extra rows get a zero gradient
    kc, vc = (torch.cat([t, torch.randn_like(t[:1])]).requires_grad_() for t in (k, v))
    bi.attention(q, kc, vc, first, zeros, S).backward(g)
    assert torch.allclose(kc.grad[:B], kg.grad) and float(kc.grad[B:].abs().max()) == 0.0
    print("ok")
""")


_END_TO_END = INTERPRETER_PATCH + ORDER_FREE_DOT_PATCH + textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, "tests")
    from tiny_models import make_model, rollout_vs_training
    from quarl.model.precision_apply import apply_precision
    from quarl.precision import LoraConfig, PrecisionConfig
    from quarl.rollout.fast_engine import FastRolloutEngine

    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    print("seed", seed)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 70, 9)]  # 70: a block boundary mid-prompt
    for flow, fmt, lora in [("bf16", None, 0), ("unified", "int8", 0), ("qlora", "nvfp4", 4)]:
        model = make_model("llama", torch.float32, std=0.1).half()
        apply_precision(model, PrecisionConfig(flow=flow, format=fmt, batch_invariant=True, lora=LoraConfig(rank=lora),
                                               weight_only=False if flow == "unified" else None))  # unified: W8A8
        switched = [m.batch_invariant for m in model.modules() if hasattr(m, "batch_invariant")]
        assert model.batch_invariant and all(switched) and len(switched) > 10
        engine = FastRolloutEngine(model, None, max_batch_size=8, use_cuda_graphs=False)
        assert engine.attention_name is None and engine._decoder is None
        diff = rollout_vs_training(engine, prompts, 1, 8)  # 8 decode steps over the slot cache
        assert engine.attention_name == "invariant"
        assert diff < 1e-5, (flow, diff)
        model.set_batch_invariant(False)  # an engine keeps decoding as the model computed when it was built
        try:
            engine.generate(prompts[:1], n=1, max_new_tokens=2)
            raise AssertionError("the engine decoded after the model left batch invariance")
        except RuntimeError as e:
            assert "batch_invariant setting changed" in str(e)
        model.set_batch_invariant(True)
        try:
            FastRolloutEngine(model, None, fused_decode=True, use_cuda_graphs=False)
            raise AssertionError("a fused decode accepted for a batch-invariant model")
        except ValueError as e:
            assert "decodes on its module path" in str(e)
    split = make_model("llama", torch.float32, std=0.1).half()
    apply_precision(split, PrecisionConfig(flow="split", format="int8"))
    try:
        split.set_batch_invariant(True)
        raise AssertionError("a split rollout accepted for batch invariance")
    except ValueError as e:
        assert "configured for the quantized kernels or a split rollout" in str(e)
    print("ok")
""")


def test_rollout_and_training_log_probs_agree_on_the_invariant_kernels_in_the_interpreter():
    """The fast engine's rollout (prefill of right-padded prompts, decode steps over the slot cache) and the training
    forward over a left-padded batch give the same log-probs (up to the float32 log-softmax of each side) for the bf16,
    unified and qlora flows with `precision.batch_invariant`: fp16, CPU, Triton's interpreter."""
    run_in_interpreter(_END_TO_END)


def test_batch_invariant_kernels_in_the_interpreter():
    """Linear, RMSNorm and attention against torch and float64; rows alike alone and in a batch; a decode step's
    query alike in a slot cache and in a left-padded training row; gradients."""
    run_in_interpreter(_KERNELS)


@pytest.mark.parametrize("overrides,match", [
    (["precision.flow=split"], r"flow=split \(rollout and training differ by design; use bf16, unified or qlora"),
    (["precision.flow=unified", "precision.kv_cache=fp8"], r"kv_cache=fp8 \(set auto\)"),
    (["precision.flow=unified", "precision.kernel_forward=true"], r"kernel_forward=true \(set null"),
    (["precision.flow=unified", "precision.quantized_backward=true"], r"quantized_backward=true \(set false\)"),
    (["precision.compute_dtype=float32"], r"compute_dtype=float32 \(set auto"),
    (["rollout.engine=reference"], "rollout.engine=fast"),
])
def test_batch_invariant_refuses_what_it_does_not_cover(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["precision.batch_invariant=true", *overrides])


def test_batch_invariant_takes_bf16_gemms_at_every_size():
    """The unified flow's default path at a large hidden size is the quantized kernels; batch invariance moves it to
    bf16 GEMMs (the kernel it covers)."""
    plain = PrecisionConfig(flow="unified").linear_settings(4096)
    invariant = PrecisionConfig(flow="unified", batch_invariant=True).linear_settings(4096)
    assert plain["kernel_forward"] and not plain["bf16_gemms"]
    assert not invariant["kernel_forward"] and invariant["bf16_gemms"]


def test_model_refuses_batch_invariance_where_the_kernels_do_not_run():
    model = make_model("llama")
    with pytest.raises(ValueError, match="dense bf16/fp16 model on a CUDA GPU.*float32"):
        model.set_batch_invariant(True)
    with pytest.raises(ValueError, match="dense bf16/fp16 model on a CUDA GPU.*on cpu"):
        apply_precision(model.half(), PrecisionConfig(batch_invariant=True))
    assert not model.batch_invariant and not any(getattr(m, "batch_invariant", False) for m in model.modules())
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_model("qwen3_moe").half().set_batch_invariant(True)
    model.set_batch_invariant(False)  # off is always allowed


@pytest.mark.parametrize("overrides", [["aqn.sigma_start=0.01", "precision.flow=qlora", "lora.rank=4"],
                                       ["rollout.top_p=0.9"], ["rollout.top_k=20"]])
def test_batch_invariance_refuses_rollouts_that_differ_by_design(overrides):
    with pytest.raises(ConfigError, match=f"but {overrides[0]}.* differ by design"):
        load_config(None, ["precision.batch_invariant=true", *overrides])
