"""Shared test helpers: tiny random models with O(1) logits, and random token prompts."""

import torch

from quarl.model.decoder import QuarlForCausalLM
from quarl.model.tiny import tiny_config


def randomize_(model: torch.nn.Module, std: float = 0.25) -> torch.nn.Module:
    """Weights with O(1) logits and non-trivial attention (HF's 0.02 init gives nearly uniform outputs): norm
    weights 1 + 0.3 N(0, 1), every other parameter N(0, std). Works on ours and on transformers' models."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return model


def make_model(arch="llama", dtype=torch.float32, std=0.25, **overrides):
    """A tiny model with O(1) logits (so sampling parameters visibly change the distribution)."""
    return randomize_(QuarlForCausalLM(tiny_config(arch, **overrides)), std).to(dtype).eval()


def rand_prompts(lengths):
    """Random byte-token prompts of the given lengths (lists of ids < 256)."""
    return [torch.randint(0, 256, (n,)).tolist() for n in lengths]


def small_qwen2(vocab_size: int = 32000, num_layers: int = 4, device="cuda", dtype=torch.bfloat16):
    """Qwen2-style, hidden 512, GQA 8:2, head_dim 64, 0.02 init; lm_head std 0.15 -> logits std ~3 (clear argmaxes).
    EOS is the last token id."""
    from quarl.model.config import ModelConfig

    cfg = ModelConfig(architecture="qwen2", vocab_size=vocab_size, hidden_size=512, intermediate_size=1408,
                      num_layers=num_layers, num_heads=8, num_kv_heads=2, head_dim=64, attention_bias=True,
                      rope_theta=1e6, max_position_embeddings=4096, eos_token_ids=[vocab_size - 1])
    model = QuarlForCausalLM(cfg, init_std=0.02)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.15)
    return model.to(device, dtype).eval()


def logits_and_grads(model: torch.nn.Module, ids: torch.Tensor, params) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward of ids and the backward of mean(logits^2) from zeroed gradients: (the logits, detached; copies
    of the gradients of params)."""
    model.zero_grad()
    logits = model(ids)
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in params]


def rollout_vs_training(engine, prompts, n: int, max_new_tokens: int) -> float:
    """Max |behaviour log-prob - training log-prob| over the answer tokens `engine` samples (temperature 1, seed 0,
    ignoring EOS) for token-id `prompts`: the training side scores them as the trainer does, over its left-padded
    batch (`build_batch`, `answer_logprobs`) under no_grad."""
    from quarl.rl.batch import answer_logprobs, build_batch

    outs = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens, temperature=1.0, seed=0, ignore_eos=True)
    rows = [(p, c) for p, o in zip(prompts, outs) for c in o.completions]
    batch = build_batch([p for p, _ in rows], [c.token_ids for _, c in rows], [c.logprobs for _, c in rows],
                        [True] * len(rows), torch.zeros(len(rows)), torch.zeros(len(rows)), [0] * len(rows), 0)
    model, width = engine.model, batch.answer_width
    with torch.no_grad():
        lp, _ = answer_logprobs(model, batch.input_ids.to(model.device), batch.attention_mask.to(model.device), 1.0,
                                width)
    answer = batch.answer_mask[:, -width:].bool()
    return float((lp.cpu() - batch.behaviour_logprobs[:, -width:])[answer].abs().max())
