"""Tiny random models and a tiny byte-level tokenizer, for tests and examples that must run in seconds on a CPU.

`tiny_hf_config(arch)` is written in transformers' own vocabulary (independently of `ModelConfig.to_hf_dict`), so
an equivalence test that builds the HF model from it and ours via `ModelConfig.from_hf` checks our config
mapping as well as the decoder.
"""

from __future__ import annotations

from typing import Any

from quarl.model.config import ModelConfig

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")

# Shapes small enough for fast CPU tests but with every structural feature: GQA (4 query heads per 2 kv heads),
# several layers, head_dim != hidden/heads for qwen3.
_BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
             bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
_PER_ARCH: dict[str, dict[str, Any]] = {
    "llama": dict(head_dim=16, attention_bias=False),
    "qwen2": dict(),  # q/k/v bias is built in; head_dim = hidden / heads
    "qwen3": dict(head_dim=24, attention_bias=False),  # head_dim given separately, q/k norms built in
    # three layers, the middle one dense (mlp_only_layers): MoE ordinals differ from layer indices
    "qwen3_moe": dict(head_dim=24, attention_bias=False, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
}


def tiny_hf_config(arch: str, **overrides: Any):
    """A transformers config (LlamaConfig / Qwen2Config / Qwen3Config / Qwen3MoeConfig) for a tiny random model.

    `overrides` use transformers' names (e.g. tie_word_embeddings=True, rope_scaling={...}, rope_theta=...).
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"tiny arch {arch!r} is unknown; choose one of {TINY_ARCHS}")
    from transformers import AutoConfig

    kwargs = {**_BASE, **_PER_ARCH[arch], **overrides}
    rope_scaling = kwargs.pop("rope_scaling", None)
    rope_theta = kwargs.pop("rope_theta")
    # transformers >= 5 reads rope_parameters; older versions read rope_theta / rope_scaling. Give both.
    # Fresh dicts: transformers edits the rope dicts it is given (it adds rope_theta to them).
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope_parameters = {**rope_scaling, "rope_theta": rope_theta}
        rope_scaling = dict(rope_scaling)
    cfg = AutoConfig.for_model(arch, rope_theta=rope_theta, rope_scaling=rope_scaling,
                               rope_parameters=rope_parameters, **kwargs)
    if hasattr(cfg, "_attn_implementation"):
        cfg._attn_implementation = "eager"  # the plainest reference
    if arch == "qwen3_moe" and hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"  # a loop over experts, which also runs in float64
    return cfg


def tiny_config(arch: str = "llama", **overrides: Any) -> ModelConfig:
    """The ModelConfig of `tiny_hf_config(arch)`, with `overrides` in ModelConfig's names."""
    return ModelConfig.from_hf(tiny_hf_config(arch)).replace(**overrides)


LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table (the one ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges: ids 0..255 are bytes, 256 = <s>, 257 = </s>, 258 = <pad>.

    Round-trips any text, needs no files or network, and fits the tiny configs' vocab (320). Has a ChatML-style
    chat template so chat code paths can be exercised.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ByteLevel maps byte b to a printable char (GPT-2's table); order the vocab by byte value so id == byte.
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return fast
