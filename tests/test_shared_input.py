"""Sibling linears run together (`quarl.model.shared_input`): the stacked LoRA path gives what the linears give
one by one, and the cases it must not take run one by one."""

import pytest
import torch

from quarl.fast_paths import FastPaths
from quarl.model import shared_input
from quarl.model.qlinear import QuantLinear
from tiny_models import logits_and_grads


def _group(ranks, dropout=0.0, k=40, sizes=(48, 16, 16), dtype=torch.float32):
    """Linears [n, k] with LoRA of the given ranks (0: none, the linear itself trained), B nonzero; float32 adapters
    (as `configure` keeps them for 16-bit models) in a model of `dtype`."""
    linears = []
    for n, r in zip(sizes, ranks):
        linear = QuantLinear(k, n, bias=True).to(dtype)
        if r:
            linear.configure(lora_rank=r, lora_alpha=2 * r, lora_dropout=dropout)
            with torch.no_grad():
                linear.lora_B.normal_()
        linears.append(linear)
    return linears


def _run(linears, x, stacked):
    """Outputs, and gradients of x and of every trainable parameter after a backward of a fixed random projection,
    with `FastPaths.stack_lora` set to `stacked`."""
    for linear in linears:
        linear.zero_grad()
    xg = x.clone().requires_grad_(True)
    ys = shared_input.shared_input_linears(linears, xg, FastPaths(stack_lora=stacked))
    gen = torch.Generator().manual_seed(1)
    sum((y * torch.randn(y.shape, generator=gen).to(y.dtype)).sum() for y in ys).backward()
    params = [p for linear in linears for p in linear.parameters() if p.requires_grad]
    return [y.detach() for y in ys] + [xg.grad] + [p.grad.clone() for p in params]


def _count_stacked_adds(monkeypatch) -> list:
    """Record, for every `QuantLinear.add_lora` call, whether it got its x @ A^T from the stacked GEMM."""
    calls = []
    real = QuantLinear.add_lora

    def counting(self, y, x, *args, **kw):
        calls.append(kw.get("xa") is not None)
        return real(self, y, x, *args, **kw)

    monkeypatch.setattr(QuantLinear, "add_lora", counting)
    return calls


@pytest.mark.parametrize("ranks,dtype", [((4, 2, 8), torch.float32), ((4, 0, 2), torch.float32),
                                         ((4, 2, 8), torch.bfloat16)])
def test_stacked_adapters_equal_the_linears_one_by_one(monkeypatch, ranks, dtype):
    """q/k/v-like groups (ranks 4/2/8, or the middle one without an adapter and so trained itself), x [2, 3, K]:
    outputs and the gradients of x and every trainable parameter equal the linears run one by one (float32: 1e-5
    relative; a bf16 model with float32 adapters: within two bf16 roundings); every adapter took the stacked
    GEMM's product."""
    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    linears = _group(ranks, dtype=dtype)
    x = torch.randn(2, 3, 40).to(dtype)
    calls = _count_stacked_adds(monkeypatch)
    stacked = _run(linears, x, True)
    adapted = sum(1 for r in ranks if r)
    assert calls == [True] * adapted
    one_by_one = _run(linears, x, False)
    assert calls[adapted:] == [False] * adapted
    # outputs, x, then A and B of each adapted linear (its base frozen), weight and bias of the others
    assert len(stacked) == len(one_by_one) == 3 + 1 + 2 * len(ranks)
    rel = 1e-5 if dtype == torch.float32 else 2**-7
    for a, b in zip(stacked, one_by_one):
        torch.testing.assert_close(a.float(), b.float(), rtol=rel, atol=rel * float(b.float().abs().max()),
                                   msg=lambda m: f"seed {seed}: {m}")


def test_a_lora_model_takes_the_stacked_path_with_the_same_values(monkeypatch):
    """A tiny Qwen2 with LoRA on every linear: with the model's `FastPaths.stack_lora` on, q/k/v's and gate/up's adapters (5 of 7 per
    layer) take the stacked product, and the logits and LoRA gradients equal the per-linear run (float32, 1e-5
    relative), with gradient checkpointing too."""
    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.precision_apply import apply_precision
    from quarl.model.tiny import tiny_config
    from quarl.precision import LoraConfig, PrecisionConfig

    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    cfg = tiny_config("qwen2")
    model = QuarlForCausalLM(cfg)
    apply_precision(model, PrecisionConfig(flow="bf16", lora=LoraConfig(rank=4)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    calls = _count_stacked_adds(monkeypatch)
    out = {}
    for stacked, checkpointing in [(True, False), (False, False), (True, True)]:
        model.set_fast_paths(FastPaths(stack_lora=stacked))
        model.gradient_checkpointing = checkpointing
        model.train()
        model.zero_grad()
        logits = model(ids)
        logits.square().mean().backward()
        out[stacked, checkpointing] = [logits.detach()] + [p.grad.clone() for n, p in model.named_parameters()
                                                           if "lora_" in n]
        if (stacked, checkpointing) == (True, False):
            assert calls.count(True) == 5 * cfg.num_layers and calls.count(False) == 2 * cfg.num_layers
    assert len(out[True, False]) == 1 + 14 * cfg.num_layers
    for key in [(True, False), (True, True)]:
        for a, b in zip(out[key], out[False, False]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()),
                                       msg=lambda m: f"seed {seed}: {m}")


def test_only_plain_groups_stack():
    """Stacking needs `FastPaths.stack_lora`, two adapters or more, no dropout in training, no rollout mode,
    QuantLinears of one input size and no forward hooks."""
    assert shared_input._stack_adapters(_group((4, 0, 2)), True)
    assert not shared_input._stack_adapters(_group((4, 0, 0)), True)
    dropped = _group((4, 4, 4), dropout=0.1)
    assert not shared_input._stack_adapters(dropped, True)
    for linear in dropped:
        linear.eval()  # dropout acts only in training
    assert shared_input._stack_adapters(dropped, True)
    rolled = _group((4, 4, 4))
    rolled[1].configure(rollout_format="fp8", lora_rank=4)
    rolled[1].set_rollout(True)
    assert not shared_input._stack_adapters(rolled, True)
    assert not shared_input._stack_adapters(_group((4, 4)) + [torch.nn.Linear(40, 8)], True)
    wider = _group((4, 4)) + [QuantLinear(41, 8)]
    assert not shared_input._stack_adapters(wider, True)
    hooked = _group((4, 4, 4))
    hooked[2].register_forward_hook(lambda module, args, out: None)
    assert not shared_input._stack_adapters(hooked, True)
    assert not shared_input._stack_adapters(_group((4, 4, 4)), False)


@pytest.mark.gpu
@pytest.mark.parametrize("flow", ["bf16", "jet-rl"])
def test_cuda_stacked_lora_matches_the_per_linear_path(monkeypatch, flow):
    """On the GPU, a bf16 LoRA model (float32 adapters), plain or in the Jet-RL setting (unified fp8-block,
    quantized backward): `FastPaths.stack_lora` on and off give logits within bf16 rounding and LoRA gradients within 2^-5
    relative (Frobenius; 2^-3 in the Jet-RL setting). The stacked GEMM may sum in another order, and the FP8
    backward re-rounds gradients that differ by an ulp, flipping E4M3 codes (2^-4 steps; a one-ulp change
    upstream measured 4.6 % Frobenius there). Mixed-up adapters would miss by O(1)."""
    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.precision_apply import apply_precision
    from quarl.model.tiny import tiny_config
    from quarl.precision import LoraConfig, PrecisionConfig

    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    cfg = tiny_config("qwen2", hidden_size=512, num_heads=4, num_kv_heads=1, head_dim=128, intermediate_size=1024,
                      num_layers=2)
    model = QuarlForCausalLM(cfg).cuda().to(torch.bfloat16)
    precision = PrecisionConfig(flow="bf16", lora=LoraConfig(rank=8)) if flow == "bf16" else PrecisionConfig(
        flow="unified", format="fp8-block", quantized_backward=True, lora=LoraConfig(rank=8))
    apply_precision(model, precision)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, cfg.vocab_size, (16, 64), device="cuda")
    calls = _count_stacked_adds(monkeypatch)
    out = {}
    for stacked in (True, False):
        model.set_fast_paths(FastPaths(stack_lora=stacked))
        logits, grads = logits_and_grads(model, ids, [p for n, p in model.named_parameters() if "lora_" in n])
        out[stacked] = [logits.float()] + [g.float() for g in grads]
    assert calls.count(True) == 5 * cfg.num_layers
    torch.testing.assert_close(out[True][0], out[False][0], rtol=2**-6, atol=2**-6 * float(out[False][0].abs().max()))
    tol = 2**-5 if flow == "bf16" else 2**-3
    for a, b in zip(out[True][1:], out[False][1:]):
        assert float((a - b).norm() / b.norm()) < tol, float((a - b).norm() / b.norm())
