"""Qwen3-MoE: the sparse MoE block against transformers' Qwen3MoeForCausalLM (logits, greedy generation, loading),
the grouped expert computation and the gate weights against float64 references, the router kept out of
quantization, router replay (the training forward uses the rollout's experts, gradients reach the router), the
routing-mismatch metric, and 2-step CLI training runs with and without replay.

Tolerances: logits of size O(10) agree with transformers to 1e-4 absolute in float64 and float32 (transformers
computes RMSNorm in float32 even in a float64 model); our own float64 invariants at 1e-9.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quarl.cli import main
from quarl.config import load_config
from quarl.model.config import ModelConfig
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.loading import load_model, save_pretrained
from quarl.model.moe import (ExpertRouting, SparseMoeBlock, TopKRouter, grouped_gemm_ok, grouped_gemm_swiglu,
                             grouped_swiglu, moe_experts, plain_experts, routing_mismatch, routing_weights)
from quarl.model.precision_apply import apply_precision, full_precision, unquantized_linears
from quarl.model.tiny import tiny_hf_config, tiny_tokenizer
from quarl.precision import PrecisionConfig
from quarl.rl.batch import answer_logprobs, build_batch
from quarl.rollout.engine import RolloutEngine
from quarl.rollout.fast_engine import FastRolloutEngine
from tiny_models import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

# the built-in tiny shape (3 layers, the middle one dense, 8 experts, top-2, normalised) and a real-ish one:
# hidden 160 (not a multiple of 128), 6 experts of width 72, top-3 without renormalisation, every 2nd layer sparse
CASES = {
    "tiny": {},
    "realish": dict(hidden_size=160, head_dim=40, intermediate_size=224, num_hidden_layers=4, num_experts=6,
                    num_experts_per_tok=3, moe_intermediate_size=72, norm_topk_prob=False, decoder_sparse_step=2,
                    mlp_only_layers=[]),
}


def hf_state_dict_as_ours(sd: dict) -> dict:
    """transformers >= 5 keeps each MoE layer's experts stacked (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]); checkpoints and quarl name every expert apart (experts.{e}.gate_proj.weight ...)."""
    out = {}
    for key, value in sd.items():
        if key.endswith("experts.gate_up_proj"):
            prefix, inter = key[:-len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = value[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = value[e, inter:]
        elif key.endswith("experts.down_proj"):
            prefix = key[:-len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out


def hf_and_ours(case: str = "tiny", dtype=torch.float64):
    """(transformers Qwen3MoeForCausalLM, our model) with the same fresh random weights in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM

    hf = randomize_(AutoModelForCausalLM.from_config(tiny_hf_config("qwen3_moe", **CASES[case]))).to(dtype).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ours = QuarlForCausalLM(ModelConfig.from_hf(hf.config))
    ours.load_state_dict(hf_state_dict_as_ours(hf.state_dict()))
    return hf, ours.to(dtype).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    hf, ours = hf_and_ours(case)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == \
        [ours.config.is_moe_layer(i) for i in range(ours.config.num_layers)]
    assert ours.config.moe_layers == ([0, 2] if case == "tiny" else [1, 3])
    ids = torch.randint(0, hf.config.vocab_size, (3, 29))
    with torch.no_grad():
        ref64, got64 = hf(ids).logits, ours(ids)
        ref32, got32 = hf.float()(ids).logits, ours.float()(ids)
    assert ref64.abs().max() > 3.0
    # float64 but the router softmax runs in float32 on both sides (as transformers does): ~1e-7 relative
    torch.testing.assert_close(got64, ref64, atol=2e-5, rtol=0)
    torch.testing.assert_close(got32, ref32, atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_greedy_generation_matches_transformers(engine):
    hf, ours = hf_and_ours(dtype=torch.float32)
    tok = tiny_tokenizer()
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (6, 11)]
    eng = RolloutEngine(ours, tok) if engine == "reference" else FastRolloutEngine(ours, tok, max_batch_size=4)
    outs = eng.generate(prompts, max_new_tokens=16, temperature=0.0)
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id)[0, len(p):].tolist()
        assert out.completions[0].token_ids == ref


def test_loads_a_saved_transformers_directory_and_saves_one_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    hf, _ = hf_and_ours("realish", dtype=torch.float32)
    hf.save_pretrained(tmp_path / "hf")
    tiny_tokenizer().save_pretrained(tmp_path / "hf")
    ours, _ = load_model(str(tmp_path / "hf"), progress=False)
    assert ours.config.num_experts == 6 and ours.config.moe_layers == [1, 3]
    assert ours.model.layers[1].mlp.experts[5].down_proj.weight.shape == (160, 72)
    ids = torch.randint(0, 320, (2, 17))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(ours.eval()(ids), ref, atol=1e-4, rtol=0)
    save_pretrained(ours, tiny_tokenizer(), tmp_path / "ours")  # per-expert keys, num_experts in config.json
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref, atol=1e-4, rtol=0)


def test_config_errors_say_what_is_wrong():
    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3_moe"))
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and num_experts=8"):
        cfg.replace(num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"mlp_only_layers \[7\]"):
        cfg.replace(mlp_only_layers=[7])
    with pytest.raises(ValueError, match="exist only in qwen3_moe models"):
        cfg.replace(architecture="qwen3")
    with pytest.raises(ValueError, match="needs num_experts > 0"):
        cfg.replace(num_experts=0)


# ---------------------------------------------------------------------------------------------- routing numerics
def reference_moe(x, router_w, experts, top_k, norm, chosen=None):
    """float64 per-token loop: softmax over all experts, top-k (or `chosen`), renormalise, weighted SwiGLU sum."""
    x, router_w = x.detach().double(), router_w.detach().double()
    probs = torch.softmax(x @ router_w.T, -1)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        idx = probs[n].topk(top_k).indices if chosen is None or (chosen[n] < 0).any() else chosen[n]
        w = probs[n, idx]
        if norm:
            w = w / w.sum()
        for e, we in zip(idx.tolist(), w):
            ex = experts[e]
            g, u, d = (ex.gate_proj.weight.detach().double(), ex.up_proj.weight.detach().double(),
                       ex.down_proj.weight.detach().double())
            out[n] += we * (d @ (F.silu(g @ x[n]) * (u @ x[n])))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_expert_computation_matches_a_float64_per_token_loop(case):
    _, model = hf_and_ours(case, dtype=torch.float32)
    block = model.model.layers[model.config.moe_layers[0]].mlp
    x = torch.randn(2, 23, model.config.hidden_size)
    with torch.no_grad():
        got = block(x)
    ref = reference_moe(x.reshape(-1, x.shape[-1]), block.gate.weight, block.experts, block.top_k,
                        block.norm_topk_prob).reshape(x.shape)
    scale = float(ref.abs().max())
    assert scale > 0.5
    torch.testing.assert_close(got.double(), ref, atol=2e-5 * scale, rtol=0)
    # bf16 compute, routed to the float32 forward's experts (bf16 router logits may flip near-ties): the same
    # function within bf16 rounding
    routing = ExpertRouting(record=True)
    with torch.no_grad():
        block(x, routing)
        chosen = routing.used[block.moe_index]
        got16 = block.to(torch.bfloat16)(x.to(torch.bfloat16), ExpertRouting(replay=chosen[:, :, None]))
    ref16 = reference_moe(x.reshape(-1, x.shape[-1]), block.gate.weight.float(), block.experts, block.top_k,
                          block.norm_topk_prob, chosen.reshape(-1, block.top_k)).reshape(x.shape)
    assert float((got16.double() - ref16).abs().max()) < 0.03 * scale


def test_moe_experts_weights_each_pair_and_skips_idle_experts():
    _, model = hf_and_ours(dtype=torch.float64)
    experts = model.model.layers[0].mlp.experts
    N, k = 13, 3
    x = torch.randn(N, 64, dtype=torch.float64)
    idx = torch.stack([torch.randperm(5)[:k] for _ in range(N)])  # experts 5..7 own no token
    w = torch.rand(N, k, dtype=torch.float64)
    calls = []
    hooks = [experts[e].register_forward_hook(lambda m, a, o, e=e: calls.append(e)) for e in range(8)]
    got = moe_experts(x, idx, w, experts)
    for h in hooks:
        h.remove()
    ref = torch.zeros_like(x)
    for n in range(N):
        for j in range(k):
            ex = experts[int(idx[n, j])]
            ref[n] += w[n, j] * ex.down_proj.weight @ (F.silu(ex.gate_proj.weight @ x[n]) * (ex.up_proj.weight @ x[n]))
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    assert sorted(calls) == sorted(set(idx.flatten().tolist()))  # one call per expert that owns tokens


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_gemm_path_matches_the_per_expert_path_with_gradients(case):
    """`grouped_gemm_swiglu` (torch grouped_mm, which also runs on the CPU in float32) against the per-expert
    reference, forward and backward, with experts that own no rows; float64 reference at 1e-5 relative."""
    _, model = hf_and_ours(case, dtype=torch.float32)
    experts = model.model.layers[model.config.moe_layers[0]].mlp.experts
    E, H = len(experts), model.config.hidden_size
    counts = torch.tensor([5, 0, 9, 1] + [0] * (E - 5) + [7])  # idle experts between busy ones
    x = torch.randn(int(counts.sum()), H)
    grad = torch.randn(int(counts.sum()), H)
    results = []
    for swiglu in (grouped_gemm_swiglu, grouped_swiglu):
        model.zero_grad()
        xr = x.clone().requires_grad_(True)
        y = swiglu(xr, counts, experts)
        (y * grad).sum().backward()
        grads = [[torch.zeros_like(w) if w.grad is None else w.grad.clone() for w in ws]  # idle: None in the loop
                 for ws in ([e.gate_proj.weight for e in experts], [e.down_proj.weight for e in experts])]
        results.append((y.detach(), xr.grad, *grads))
    (y_g, gx_g, gg_g, gd_g), (y_r, gx_r, gg_r, gd_r) = results
    scale = float(y_r.abs().max())
    torch.testing.assert_close(y_g, y_r, atol=1e-5 * scale, rtol=0)
    torch.testing.assert_close(gx_g, gx_r, atol=1e-5 * float(gx_r.abs().max()), rtol=0)
    for a, b in zip(gg_g + gd_g, gg_r + gd_r):
        torch.testing.assert_close(a, b, atol=1e-5 * max(float(b.abs().max()), 1e-6), rtol=0)
    assert float(gg_g[1].abs().max()) == 0.0 and float(gg_g[0].abs().max()) > 0  # an idle expert gets zeros
    with torch.no_grad():  # and both against float64 per-token arithmetic
        ref = torch.cat([experts[e].double()(x[int(counts[:e].sum()):int(counts[:e + 1].sum())].double())
                         for e in range(E)])
    torch.testing.assert_close(y_g.double(), ref, atol=1e-5 * scale, rtol=0)


def test_only_plain_experts_take_the_grouped_gemm():
    _, model = hf_and_ours(dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(3, 64)
    assert plain_experts(experts, x) and not plain_experts(experts, x.double())
    assert not grouped_gemm_ok(experts, x, model.fast_paths)  # the CPU takes the reference path
    apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    assert plain_experts(experts, x)  # the split flow's training forward: plain bf16/fp32 GEMMs
    model.set_rollout(True)
    assert not plain_experts(experts, x)  # its rollout: int8 experts, one QuantLinear call each
    model.set_rollout(False)
    experts[3].up_proj.configure(lora_rank=2)
    assert not plain_experts(experts, x)


@pytest.mark.parametrize("norm", [True, False])
def test_routing_weights_of_replayed_experts_are_gathered_from_the_full_softmax(norm):
    logits = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    replay = torch.stack([torch.randperm(6)[:2] for _ in range(9)])
    replay[4] = -1  # a token without a record keeps its own top-k
    chosen, w, own = routing_weights(logits, 2, norm, replay)
    probs = torch.softmax(logits.detach(), -1)
    assert torch.equal(own, probs.topk(2).indices)
    expect = replay.clone()
    expect[4] = own[4]
    assert torch.equal(chosen, expect)
    ref = probs.gather(-1, expect)
    if norm:
        ref = ref / ref.sum(-1, keepdim=True)
    torch.testing.assert_close(w, ref, atol=1e-12, rtol=0)
    w.sum().backward() if not norm else (w * torch.arange(1.0, 3.0, dtype=torch.float64)).sum().backward()
    assert logits.grad.abs().sum() > 0  # gradients reach the router logits through the gathered softmax
    with pytest.raises(ValueError, match="has 6 experts"):
        routing_weights(logits.detach(), 2, norm, torch.full((9, 2), 6))


def test_routing_mismatch_counts_recorded_choices_missing_from_the_computed_ones():
    recorded = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [-1, -1]]])  # [tokens 2, layers 2, k 2]; one unrecorded
    computed = torch.tensor([[[1, 0], [2, 7]], [[6, 7], [0, 1]]])
    # decisions compared: 3 recorded (token, layer) x 2 = 6; different: expert 3 (token 0 layer 1), 4 and 5 -> 3/6
    assert routing_mismatch(recorded, computed) == (0.5, 6)
    assert routing_mismatch(torch.full((2, 2), -1), computed[0]) == (0.0, 0)


# --------------------------------------------------------------------------------------------- precision flows
def test_int8_quantizes_every_expert_and_leaves_the_router_in_full_precision():
    _, model = hf_and_ours(dtype=torch.float32)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    before = [r.weight.detach().clone() for r in routers]
    names = apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    assert len(routers) == 2 and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert "model.layers.0.mlp.experts.7.down_proj" in names and not any(n.endswith("mlp.gate") for n in names)
    assert unquantized_linears(model, PrecisionConfig(flow="split", format="int8")) == []
    x = torch.randn(2, 9, 64)
    block = model.model.layers[0].mlp
    model.set_rollout(True)
    try:
        with torch.no_grad():
            rollout_logits = block.gate(x.reshape(-1, 64))
            quantized = block.experts[0].gate_proj(x)
            full = F.linear(x, block.experts[0].gate_proj.weight)
    finally:
        model.set_rollout(False)
    assert all(torch.equal(r.weight, b) for r, b in zip(routers, before))
    torch.testing.assert_close(rollout_logits, x.reshape(-1, 64) @ before[0].T, atol=1e-6, rtol=0)
    assert not torch.equal(quantized, full)  # the experts' rollout projections are quantized


# ------------------------------------------------------------------------------------------------ router replay
def rollout_records(model, n=2, max_new=10):
    """(prompt ids, completions) of a recorded sampled rollout with the reference engine."""
    prompts = [torch.randint(0, 256, (L,)).tolist() for L in (5, 8)]
    outs = RolloutEngine(model, tiny_tokenizer(), record_routing=True).generate(
        prompts, n=n, max_new_tokens=max_new, temperature=1.0, seed=3)
    return [(o.prompt_token_ids, c) for o in outs for c in o.completions]


def test_rollout_records_the_routing_a_full_forward_computes():
    _, model = hf_and_ours(dtype=torch.float64)
    for prompt, c in rollout_records(model):
        ids = torch.tensor([prompt + c.token_ids])
        routing = ExpertRouting(record=True)
        with torch.no_grad():
            model(ids, routing=routing)
        assert c.routing.dtype == torch.int16 and c.routing.shape == (ids.shape[1] - 1, 2, 2)
        assert torch.equal(routing.stacked("own")[0, :-1], c.routing.long())
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        RolloutEngine(QuarlForCausalLM(ModelConfig.from_hf(tiny_hf_config("qwen3"))), None, record_routing=True)


def test_fast_engine_records_the_same_routing_as_a_full_forward_through_slot_refills_and_moves():
    torch.manual_seed(11)  # a draw whose answer lengths make the engine move slots (most draws do)
    _, model = hf_and_ours(dtype=torch.float64)
    model.config.eos_token_ids = list(range(0, 320, 4))  # answers of many lengths: neighbours finish early
    prompts = [torch.randint(0, 256, (L,)).tolist() for L in (1, 5, 9, 3, 7, 2, 4, 6)]  # 1 token: no prefill
    # 8 slots for 8 groups of 2: groups queue and refill freed slots, and long answers move down (compaction)
    engine = FastRolloutEngine(model, None, max_batch_size=8, record_routing=True, sync_every=1)
    outs = engine.generate(prompts, n=2, max_new_tokens=30, temperature=0)
    assert engine.last_stats["slot_moves"] > 0
    for o in outs:
        for c in o.completions:
            ids = torch.tensor([o.prompt_token_ids + c.token_ids])
            routing = ExpertRouting(record=True)
            with torch.no_grad():
                model(ids, routing=routing)
            assert c.routing.shape == (ids.shape[1] - 1, 2, 2)
            assert torch.equal(routing.stacked("own")[0, :-1], c.routing.long())


def patched_hf_router(hf, replay):
    """Make transformers' routers use `replay` [B, T, moe layers, k] (gate weights from their own softmax)."""
    moe = [layer.mlp for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    for ordinal, block in enumerate(moe):
        router = block.gate

        def forward(h, router=router, ordinal=ordinal):
            logits = F.linear(h.reshape(-1, router.hidden_dim), router.weight)
            probs = torch.softmax(logits, dtype=torch.float64, dim=-1)
            idx = replay[:, :, ordinal].reshape(-1, router.top_k).long()
            w = probs.gather(-1, idx)
            if router.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            return logits, w.to(logits.dtype), idx

        router.forward = forward


def test_replay_uses_the_recorded_experts_after_the_weights_moved_and_matches_a_float64_reference():
    hf, model = hf_and_ours(dtype=torch.float64)
    records = rollout_records(model)
    pad = 0
    batch = build_batch([p for p, _ in records], [c.token_ids for _, c in records], [c.logprobs for _, c in records],
                        [True] * len(records), torch.zeros(len(records)), torch.zeros(len(records)),
                        [0] * len(records), pad, routing=[c.routing for _, c in records])
    with torch.no_grad():  # the update moved the routers: many tokens now prefer other experts
        for m in (model, hf):
            for layer in m.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.add_(0.3 * torch.randn_like(layer.mlp.gate.weight))
        for ours_layer, hf_layer in zip(model.model.layers, hf.model.layers):
            if hasattr(ours_layer.mlp, "gate"):
                hf_layer.mlp.gate.weight.copy_(ours_layer.mlp.gate.weight)
    width = batch.answer_width
    replay = ExpertRouting(replay=batch.expert_indices, record=True)
    lp, _ = answer_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, width, routing=replay)
    own = ExpertRouting(record=True)
    lp_own, _ = answer_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, width, routing=own)
    recorded = batch.expert_indices.long()
    has = (recorded >= 0).all(-1)
    assert torch.equal(replay.stacked()[has], recorded[has])  # replay exactness: the rollout's experts, everywhere
    assert routing_mismatch(recorded, own.stacked("own"))[0] > 0.05  # without replay the routing moved
    # the first MoE layer's input does not depend on any routing: its own top-k is the same with and without replay
    assert torch.equal(replay.stacked("own")[:, :, 0], own.stacked("own")[:, :, 0])
    assert not torch.allclose(lp, lp_own, atol=1e-6)

    # float64 reference: transformers' model with its routers forced to the recorded experts, one row at a time
    # (the last token of each row has no record: its routing only affects logits past the sequence's end)
    for i, (prompt, c) in enumerate(records):
        n = len(prompt) + len(c.token_ids)
        rep = recorded[i:i + 1, -n:].clone()
        rep[:, -1] = rep[:, -2]  # any valid experts: the last position's logits are not used
        patched_hf_router(hf, rep)
        with torch.no_grad():
            logits = hf(batch.input_ids[i:i + 1, -n:]).logits[0, :-1]
        ref = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[i, -n + 1:, None])[:, 0]
        A = len(c.token_ids)
        torch.testing.assert_close(lp[i, width - A:], ref[-A:], atol=1e-4, rtol=0)


def test_replay_gradients_reach_the_router_and_survive_gradient_checkpointing():
    _, model = hf_and_ours(dtype=torch.float64)
    records = rollout_records(model, max_new=6)
    batch = build_batch([p for p, _ in records], [c.token_ids for _, c in records], [c.logprobs for _, c in records],
                        [True] * len(records), torch.zeros(len(records)), torch.zeros(len(records)),
                        [0] * len(records), 0, routing=[c.routing for _, c in records])
    model.train()
    grads = []
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        model.zero_grad()
        lp, _ = answer_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, batch.answer_width,
                                routing=ExpertRouting(replay=batch.expert_indices))
        lp.sum().backward()
        grads.append([p.grad.clone() for p in (model.model.layers[0].mlp.gate.weight,
                                               model.model.layers[2].mlp.gate.weight)])
    assert all(g.abs().sum() > 0 for g in grads[0])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


def test_fast_engine_refuses_fused_decode_for_moe_and_a_cpu_model_decodes_without_graphs():
    _, model = hf_and_ours(dtype=torch.float32)
    with pytest.raises(ValueError, match="fused_decode=True does not cover mixture-of-experts"):
        FastRolloutEngine(model, None, fused_decode=True)
    with pytest.raises(ValueError, match="use_cuda_graphs=True needs a model on a CUDA device"):
        FastRolloutEngine(model, None, use_cuda_graphs=True)
    engine = FastRolloutEngine(model, None)
    assert not engine.use_cuda_graphs and engine._decoder is None


def test_a_moe_block_says_whether_its_rollout_path_runs_without_the_host():
    """The fast engine captures a MoE model's decode step in a CUDA graph only where every MoE block's rollout path
    is a grouped one: on the CPU the per-expert reference, which reads the token counts on the host."""
    _, model = hf_and_ours(dtype=torch.float32)
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    model.set_rollout(True)
    assert not any(b.rollout_path_host_free for b in blocks)  # nothing chosen before the rollout's first forward
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 5)))
    assert all(b._rollout_swiglu is not None for b in blocks) and not any(b.rollout_path_host_free for b in blocks)
    for b in blocks:  # a grouped choice (as on a GPU) is host-free
        key, _, copy = b._rollout_swiglu
        b._rollout_swiglu = (key, grouped_gemm_swiglu, copy)
    assert all(b.rollout_path_host_free for b in blocks)
    model.set_rollout(False)  # a new rollout chooses again
    assert not any(b.rollout_path_host_free for b in blocks)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="needs torch's grouped_mm")
def test_packed_expert_weights_are_read_in_place_and_train_as_stacked_copies():
    """The grouped GEMM reads packed expert weights through a view (no [E, out, in] copy per call) and computes
    exactly what it computes from stacked copies, forward and backward; an optimizer step on the packed weights is
    what the view reads, and a weight given new memory makes it stack copies again."""
    from quarl.model.moe import PROJECTIONS, pack_expert_weights, stacked_weights

    _, model = hf_and_ours("realish", dtype=torch.float32)
    experts = model.model.layers[1].mlp.experts
    params = [getattr(e, name).weight for e in experts for name in PROJECTIONS]
    values = [p.detach().clone() for p in params]
    counts = torch.tensor([9, 0, 3, 17, 1, 10])
    x = torch.randn(int(counts.sum()), 160)

    def run():
        for p in params:
            p.grad = None
        xr = x.clone().requires_grad_(True)
        y = grouped_gemm_swiglu(xr, counts, experts)
        y.square().sum().backward()
        return y.detach(), xr.grad, [p.grad.clone() for p in params]

    gates = [e.gate_proj.weight for e in experts]
    assert stacked_weights(gates).data_ptr() != gates[0].data_ptr()  # loaded apart: a stacked copy
    want = run()
    assert pack_expert_weights(experts) and not pack_expert_weights(experts)  # packed once
    assert [getattr(e, name).weight for e in experts for name in PROJECTIONS] == params  # the same Parameters
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    view = stacked_weights(gates)
    assert view.data_ptr() == gates[0].data_ptr() and torch.equal(view, torch.stack(gates))
    got = run()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    torch.optim.AdamW(params, lr=1e-2).step()
    assert not torch.equal(gates[3], values[3 * len(PROJECTIONS)])  # the step moved the packed weights
    assert torch.equal(stacked_weights(gates), torch.stack(gates))
    gates[2].data = gates[2].data + 1.0  # new memory for one expert
    again = stacked_weights(gates)
    assert again.data_ptr() != gates[0].data_ptr() and torch.equal(again, torch.stack(gates))


def _grouped_on_cpu(monkeypatch):
    """Let MoE blocks take the grouped GEMM path on the CPU (torch's grouped_mm runs float32 there), as CUDA bf16
    models on Hopper do."""
    import quarl.model.moe as moe

    monkeypatch.setattr(moe, "grouped_gemm_ok", lambda experts, x, fast_paths: moe.plain_experts(experts, x))


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="needs torch's grouped_mm")
def test_a_block_on_the_grouped_path_packs_its_experts_again_after_they_moved(monkeypatch):
    from quarl.model.moe import stacked_weights

    _grouped_on_cpu(monkeypatch)
    _, model = hf_and_ours("realish", dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 9))
    gates = lambda: [e.gate_proj.weight for e in model.model.layers[1].mlp.experts]  # noqa: E731
    with torch.inference_mode():  # a rollout under inference mode packs normal tensors
        want = model(ids)
    assert stacked_weights(gates()).data_ptr() == gates()[0].data_ptr()
    loss = model(ids).square().mean()
    loss.backward()  # inference tensors could not be saved for backward
    torch.testing.assert_close(model(ids).detach(), want, atol=0, rtol=0)
    model.double().float()  # new memory for every weight
    assert stacked_weights(gates()).data_ptr() != gates()[0].data_ptr()
    torch.testing.assert_close(model(ids).detach(), want, atol=0, rtol=0)  # the forward packs them again
    assert stacked_weights(gates()).data_ptr() == gates()[0].data_ptr()


SHARDED_MOE = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import quarl.model.moe as moe
from quarl.rl.sharding import shard_model
from test_moe import hf_and_ours
moe.grouped_gemm_ok = lambda experts, x, fast_paths: moe.plain_experts(experts, x)
torch.manual_seed(0)
_, plain = hf_and_ours("realish", dtype=torch.float32)
_, sharded = hf_and_ours("realish", dtype=torch.float32)
sharded.load_state_dict(plain.state_dict())
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
shard_model(sharded, torch.device("cpu"), torch.float32)
blocks = [m for m in sharded.modules() if isinstance(m, moe.SparseMoeBlock)]
assert blocks and not any(b.pack_experts for b in blocks)
ids = torch.randint(0, 256, (2, 9))
losses = {}
for name, model in (("plain", plain), ("sharded", sharded)):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses[name] = []
    for _ in range(4):
        loss = model(ids).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[name].append(float(loss))
print(losses)
assert all(abs(a - b) < 1e-5 for a, b in zip(losses["plain"], losses["sharded"])), losses
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # FSDP keeps gloo threads alive past destroy_process_group (see quarl.distributed.end_process)
"""


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="needs torch's grouped_mm")
def test_sharded_moe_blocks_do_not_pack_and_train_as_one_process(tmp_path):
    """FSDP swaps each expert's unsharded weight in from its own gather buffer at every forward: a block that packed
    them would keep training on the first step's weights. A one-rank FSDP model on the grouped path trains exactly
    as the plain model."""
    import subprocess
    import sys

    script = tmp_path / "sharded_moe.py"
    script.write_text(SHARDED_MOE)
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": f"{Path(tests).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), tests], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_replay_of_another_batch_is_refused():
    _, model = hf_and_ours(dtype=torch.float32)
    with pytest.raises(ValueError, match="router replay covers tokens"):
        model(torch.randint(0, 256, (2, 7)), routing=ExpertRouting(replay=torch.zeros(2, 6, 2, 2, dtype=torch.long)))
    with pytest.raises(ValueError, match="integer tensor"):
        ExpertRouting(replay=torch.zeros(2, 6, 2, 2))


def test_uaq_keeps_a_moe_model_s_function():
    from quarl.rl.uaq import apply_uaq

    _, model = hf_and_ours(dtype=torch.float64)
    ids = torch.randint(0, 320, (2, 11))
    with torch.no_grad():
        before = model(ids)
        count = apply_uaq(model, 1.5)
        after = model(ids)
    assert count == 2 * (3 + 1 + 16) + 1 * (3 + 2)  # 2 MoE layers: q/k/v, router, 8 x gate/up; 1 dense layer
    torch.testing.assert_close(after, before, atol=1e-9, rtol=0)


def test_rollout_roofline_counts_k_of_e_experts_per_token_and_reads_every_expert():
    from quarl.bench.rollout import linear_bytes_and_params

    _, model = hf_and_ours(dtype=torch.float32)
    nbytes, params = linear_bytes_and_params(model)
    H, V = 64, 320
    attention = H * 4 * 24 * 2 + H * 2 * 24 * 2  # q/o: 4 heads x 24; k/v: 2 heads x 24
    dense, expert = 3 * H * 128, 3 * H * 32
    # 3 layers of attention, 1 dense MLP, 2 MoE layers of 8 experts (2 per token), lm_head
    assert params == 3 * attention + dense + 2 * 2 * expert + H * V
    assert nbytes == 4 * (3 * attention + dense + 2 * 8 * expert + H * V)  # float32, every expert read


# --------------------------------------------------------------------------------------------- training runs
def test_router_replay_needs_a_moe_model(tmp_path):
    from quarl.rl.trainer import Trainer

    cfg = load_config(None, ["model.name=tiny-random-qwen3", "model.device=cpu", "rollout.router_replay=true",
                             f"output.dir={tmp_path}"])
    with pytest.raises(ValueError, match="rollout.router_replay=true needs a mixture-of-experts model"):
        Trainer(cfg)


FLOWS = {"bf16": ["precision.flow=bf16"], "split-int8": ["precision.flow=split", "precision.format=int8"],
         "qlora-nvfp4": ["precision.flow=qlora", "precision.format=nvfp4", "lora.rank=4", "train.lr=1e-2"]}


@pytest.mark.parametrize("flow,replay,engine", [("bf16", False, "reference"), ("bf16", True, "reference"),
                                                ("split-int8", True, "reference"), ("split-int8", False, "fast"),
                                                ("qlora-nvfp4", True, "fast")])
def test_tiny_moe_trains_two_steps_from_the_command_line(tmp_path, capsys, flow, replay, engine):
    precision = FLOWS[flow]
    rc = main(["train", "model.name=tiny-random-qwen3-moe", "model.device=cpu", "train.steps=2", "train.lr=1e-3",
               f"rollout.router_replay={str(replay).lower()}", f"rollout.engine={engine}", *precision,
               "data.train=arithmetic",
               "data.num_train=8", "data.num_eval=2", "rollout.prompts_per_step=2", "rollout.num_generations=2",
               "rollout.max_new_tokens=6", "train.micro_batch_size=2", "eval.before=false", "eval.after=false",
               "output.tensorboard=false", "output.progress=false", f"output.dir={tmp_path / 'run'}"])
    assert rc == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 <= r["moe/routing_mismatch"] <= 1.0
        if replay:
            assert r["moe/routing_mismatch_used"] == 0.0
        else:
            assert r["moe/routing_mismatch_used"] == r["moe/routing_mismatch"]
    if flow == "split-int8":  # rollouts route with quantized experts: some decisions differ from training's
        assert max(r["moe/routing_mismatch"] for r in records) > 0.0


# ------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_bf16_moe_block_matches_float64_and_both_engines_record_the_same_routing():
    _, model = hf_and_ours("realish", dtype=torch.float32)
    block = model.model.layers[1].mlp
    x = torch.randn(4, 37, 160)
    routing = ExpertRouting(record=True)
    with torch.no_grad():
        block(x, routing)
    chosen = routing.used[block.moe_index]
    ref = reference_moe(x.reshape(-1, 160), block.gate.weight, block.experts, block.top_k, block.norm_topk_prob,
                        chosen.reshape(-1, block.top_k)).reshape(x.shape)
    cuda = model.cuda()
    with torch.no_grad():
        replay = ExpertRouting(replay=chosen[:, :, None].cuda())
        got = cuda.to(torch.bfloat16).model.layers[1].mlp(x.cuda().bfloat16(), replay)
    assert float((got.double().cpu() - ref).abs().max()) < 0.03 * float(ref.abs().max())

    model = cuda.float()
    prompts = [torch.randint(0, 256, (L,)).tolist() for L in (3, 8, 13)]
    fast = FastRolloutEngine(model, None, max_batch_size=8, record_routing=True)
    ref_outs = RolloutEngine(model, None, record_routing=True).generate(prompts, n=2, max_new_tokens=12,
                                                                        temperature=0)
    fast_outs = fast.generate(prompts, n=2, max_new_tokens=12, temperature=0)
    # float32 experts take the per-expert path, which reads token counts on the host: no graph, and it says why
    assert not fast.use_cuda_graphs and "per-expert path" in fast.last_stats["graph_error"]
    for r, f in zip(ref_outs, fast_outs):
        for a, b in zip(r.completions, f.completions):
            assert a.token_ids == b.token_ids
            assert (a.routing == b.routing).float().mean() > 0.99  # float32 near-ties may flip a rare choice


@pytest.mark.gpu
def test_cuda_tiny_moe_trains_one_step_with_router_replay(tmp_path):
    from quarl.rl.trainer import Trainer

    cfg = load_config(None, [
        "model.name=tiny-random-qwen3-moe", "model.device=cuda", "train.steps=1", "rollout.router_replay=true",
        "precision.flow=split", "precision.format=fp8", "data.train=arithmetic", "data.num_train=8",
        "data.num_eval=2", "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=6",
        "eval.before=false", "eval.after=false", "output.tensorboard=false", "output.progress=false",
        f"output.dir={tmp_path / 'run'}"])
    summary = Trainer(cfg).train()
    last = summary["last"]
    assert last["moe/routing_mismatch_used"] == 0.0 and 0.0 <= last["moe/routing_mismatch"] <= 1.0


@pytest.mark.gpu
def test_cuda_grouped_gemm_matches_the_per_expert_path_in_bf16():
    _, model = hf_and_ours("realish", dtype=torch.float32)
    experts = model.model.layers[1].mlp.experts.cuda().to(torch.bfloat16)
    counts = torch.tensor([40, 0, 3, 17, 0, 25], device="cuda")
    x = torch.randn(int(counts.sum()), 160, device="cuda", dtype=torch.bfloat16)
    assert grouped_gemm_ok(experts, x, model.fast_paths)
    outs = []
    for swiglu in (grouped_gemm_swiglu, grouped_swiglu):
        experts.zero_grad()
        xr = x.clone().requires_grad_(True)
        y = swiglu(xr, counts, experts)
        y.float().square().sum().backward()
        outs.append((y.float(), xr.grad.float(), experts[3].down_proj.weight.grad.float()))
    for a, b in zip(*outs):
        assert float((a - b).abs().max()) <= 0.02 * float(b.abs().max())  # bf16 outputs of fp32-accumulated GEMMs


def test_a_rollout_chooses_the_expert_path_once_and_a_new_rollout_again(monkeypatch):
    """In rollout mode the block asks `expert_path` once per rollout (checking every expert projection at every
    decode step would cost more than the layer); training forwards ask every time; outputs are unchanged."""
    import quarl.model.moe as moe

    model = QuarlForCausalLM(ModelConfig.from_hf(tiny_hf_config("qwen3_moe")))
    apply_precision(model, PrecisionConfig(flow="split", format="int8"))
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    x = torch.randn(2, 5, model.config.hidden_size)
    calls = []
    choose = moe.expert_path
    monkeypatch.setattr(moe, "expert_path", lambda *a: calls.append(1) or choose(*a))
    with torch.no_grad():
        training = block(x)
        block(x)
        assert len(calls) == 2
        model.set_rollout(True)
        first = block(x)
        for _ in range(3):
            torch.testing.assert_close(block(x), first, rtol=0, atol=0)
        block(x.double())  # another dtype: chosen again
        assert len(calls) == 4
        model.set_rollout(False)
        model.set_rollout(True)
        block(x)
        assert len(calls) == 5
        with full_precision(model):  # the experts' formats set aside inside a rollout: chosen again, both ways
            unquantized = block(x)
        assert len(calls) == 6
        torch.testing.assert_close(block(x), first, rtol=0, atol=0)
        assert len(calls) == 7
        model.set_rollout(False)
    assert not torch.equal(unquantized, first)
    assert not torch.equal(first, training)  # the rollout ran the int8 experts


def test_every_expert_gradient_gives_idle_experts_zero_gradients_and_changes_nothing_else():
    """Sharded training: experts without rows get zero gradients (so every rank reduces the same parameters); the
    output and the used experts' gradients are those of the plain per-expert path."""
    from quarl.model.moe import grouped_swiglu

    model = QuarlForCausalLM(ModelConfig.from_hf(tiny_hf_config("qwen3_moe")))
    experts = next(m for m in model.modules() if isinstance(m, SparseMoeBlock)).experts
    counts = torch.zeros(len(experts), dtype=torch.long)
    counts[[1, 4]] = torch.tensor([3, 2])
    x = torch.randn(5, model.config.hidden_size)
    results = []
    for every in (False, True):
        experts.zero_grad(set_to_none=True)
        y = grouped_swiglu(x, counts, experts, every_expert_gradient=every)
        y.square().sum().backward()
        results.append((y.detach(), [[p.grad for p in e.parameters()] for e in experts]))
    (y0, g0), (y1, g1) = results
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    for e in range(len(experts)):
        for a, b in zip(g0[e], g1[e]):
            if counts[e]:
                torch.testing.assert_close(b, a, rtol=0, atol=0)
            else:
                assert a is None and b is not None and not b.any()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [None, "int8", "fp8"])
def test_cuda_graph_decode_of_a_moe_model_equals_eager_decode(fmt):
    """bf16 (grouped GEMM, Hopper) and int8 / fp8 W8A8 rollouts (grouped kernel) make no host sync, so the fast
    engine captures MoE decode steps in CUDA graphs; tokens, behaviour log-probs and routing equal eager decoding."""
    from quarl.kernels.availability import format_kernels_available

    if fmt is None and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the grouped bf16 expert GEMM (torch's grouped_mm) needs a Hopper or newer GPU")
    if fmt is not None and not format_kernels_available(fmt, torch.device("cuda")):
        pytest.skip(f"no {fmt} kernels on this GPU")
    _, model = hf_and_ours("realish", dtype=torch.float32)
    model = model.cuda().to(torch.bfloat16)
    if fmt is not None:
        apply_precision(model, PrecisionConfig(flow="split", format=fmt))
    prompts = [torch.randint(0, 256, (L,)).tolist() for L in (3, 8, 13)]
    outs = {}
    for graphs in (True, False):
        engine = FastRolloutEngine(model, None, max_batch_size=8, record_routing=True, use_cuda_graphs=graphs)
        torch.manual_seed(0)
        outs[graphs] = engine.generate(prompts, n=2, max_new_tokens=12, temperature=1.0, seed=5)
        if graphs:
            assert engine.use_cuda_graphs and "graph_error" not in engine.last_stats
            assert engine.last_stats["graph_captures"] >= 1
    if fmt is None:  # the bf16 rollout packed each layer's expert weights: the grouped GEMM reads them in place
        from quarl.model.moe import stacked_weights

        gates = [e.gate_proj.weight for e in model.model.layers[1].mlp.experts]
        assert stacked_weights(gates).data_ptr() == gates[0].data_ptr()
    for a_out, b_out in zip(outs[True], outs[False]):
        for a, b in zip(a_out.completions, b_out.completions):
            assert a.token_ids == b.token_ids and torch.equal(a.routing, b.routing)
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
