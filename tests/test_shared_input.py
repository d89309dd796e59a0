"""Sibling linears run together (`quarl.model.shared_input`): the stacked LoRA path gives what the linears give
one by one, and the cases it must not take run one by one."""

import pytest
import torch

from quarl.model import shared_input
from quarl.model.qlinear import QuantLinear


def _group(ranks, dropout=0.0, k=40, sizes=(48, 16, 16)):
    linears = []
    for n, r in zip(sizes, ranks):
        linear = QuantLinear(k, n, bias=True)
        if r:
            linear.configure(lora_rank=r, lora_alpha=2 * r, lora_dropout=dropout)
            with torch.no_grad():
                linear.lora_B.normal_()
        linears.append(linear)
    return linears


def _run(linears, x, stacked, monkeypatch):
    """Outputs, and gradients of x and of every trainable parameter after a backward of a random projection."""
    monkeypatch.setattr(shared_input, "_stack_adapters", lambda ls: stacked)
    for linear in linears:
        linear.zero_grad()
    xg = x.clone().requires_grad_(True)
    ys = shared_input.shared_input_linears(linears, xg)
    torch.manual_seed(1)
    sum((y * torch.randn_like(y)).sum() for y in ys).backward()
    params = [p for linear in linears for p in linear.parameters() if p.requires_grad]
    return [y.detach() for y in ys] + [xg.grad] + [p.grad.clone() for p in params]


@pytest.mark.parametrize("ranks", [(4, 2, 8), (4, 0, 2)])
def test_stacked_adapters_equal_the_linears_one_by_one(monkeypatch, ranks):
    """q/k/v-like groups (ranks 4/2/8, or the middle one without an adapter and so trained itself), x [2, 3, K]:
    outputs and the gradients of x and every trainable parameter equal the linears run one by one (float32, 1e-5
    relative); the stacked run adds no adapter through `add_lora`."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    linears = _group(ranks)
    x = torch.randn(2, 3, 40)
    calls = []
    for linear in linears:
        real = linear.add_lora
        monkeypatch.setattr(linear, "add_lora",
                            lambda y, h, *a, real=real, **kw: calls.append(1) or real(y, h, *a, **kw))
    stacked = _run(linears, x, True, monkeypatch)
    assert calls == []
    one_by_one = _run(linears, x, False, monkeypatch)
    assert len(calls) == sum(1 for r in ranks if r)
    # outputs, x, then A and B of each adapted linear (its base frozen), weight and bias of the others
    assert len(stacked) == len(one_by_one) == 3 + 1 + 2 * len(ranks)
    for a, b in zip(stacked, one_by_one):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_only_training_groups_without_dropout_stack(monkeypatch):
    """Stacking needs two adapters or more, no dropout in training, no rollout mode, one input size."""
    assert shared_input._stack_adapters(_group((4, 0, 2)))
    assert not shared_input._stack_adapters(_group((4, 0, 0)))
    dropped = _group((4, 4, 4), dropout=0.1)
    assert not shared_input._stack_adapters(dropped)
    for linear in dropped:
        linear.eval()  # dropout acts only in training
    assert shared_input._stack_adapters(dropped)
    rolled = _group((4, 4, 4))
    rolled[1].configure(rollout_format="fp8", lora_rank=4)
    rolled[1].set_rollout(True)
    assert not shared_input._stack_adapters(rolled)
    assert not shared_input._stack_adapters(_group((4, 4)) + [torch.nn.Linear(40, 8)])
