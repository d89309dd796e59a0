"""The per-step weight sync (`RolloutSync`): every rollout copy equals a fresh quantization of its master weight.

On the CPU the sync is eager; on a GPU it is a CUDA graph, checked bit for bit against the eager re-quantization
(same kernels, so the codes and scales must be identical), across updates, after the weights move (re-capture),
and for every rollout format. The reference is `quantize(w, fmt, "weight")` of the master weight rounded to the
compute dtype (the rule `QuantLinear.refresh` documents).
"""

import pytest
import torch

from quarl.formats import quantize
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.precision_apply import apply_precision
from quarl.model.qlinear import QuantLinear
from quarl.model.rollout_sync import RolloutSync
from quarl.model.tiny import tiny_config
from quarl.precision import LoraConfig, PrecisionConfig


def build(flow: str, fmt: str, device: str, dtype=torch.float32, lora_rank: int = 0):
    torch.manual_seed(0)
    model = QuarlForCausalLM(tiny_config("llama")).to(device=device, dtype=dtype)
    apply_precision(model, PrecisionConfig(flow=flow, format=fmt, lora=LoraConfig(rank=lora_rank)).validate())
    return model


def linears(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear) and m.qweight_data is not None]


def perturb(model, scale=1e-2):
    """An optimizer-like in-place update of every trained weight (fresh random values)."""
    with torch.no_grad():
        for m in linears(model):
            if m.weight is not None and m.weight.requires_grad:
                m.weight.add_(torch.randn_like(m.weight) * scale)


def assert_copies_current(model):
    for m in linears(model):
        if m.weight is None:
            continue
        expected = quantize(m.weight.detach().to(m.compute_dtype), m.rollout_format, "weight")
        assert torch.equal(m.qweight.data.view(torch.uint8), expected.data.view(torch.uint8)), m.rollout_format
        assert torch.equal(m.qweight.scale.reshape(-1), expected.scale.reshape(-1))


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "nvfp4"])
def test_cpu_sync_requantizes_trained_weights(fmt):
    model = build("split", fmt, "cpu")
    sync = RolloutSync(model)
    for _ in range(2):
        perturb(model)
        sync()
        assert_copies_current(model)
    assert sync.captures == 0  # no graph off the GPU


def test_cpu_sync_leaves_a_frozen_base_alone_until_it_changes():
    model = build("qlora", "nvfp4", "cpu", lora_rank=4)
    sync = RolloutSync(model)
    before = [m.qweight.data.clone() for m in linears(model)]
    sync()
    assert all(torch.equal(a, m.qweight.data) for a, m in zip(before, linears(model)))


@pytest.mark.gpu
@pytest.mark.parametrize("flow,fmt", [("split", "int8"), ("split", "fp8"), ("unified", "fp8-block"),
                                      ("split", "nvfp4"), ("split", "mxfp4")])
def test_gpu_graph_sync_equals_eager_requantization(flow, fmt):
    model = build(flow, fmt, "cuda", torch.bfloat16)
    sync = RolloutSync(model)
    for step in range(4):  # eager warm-up, capture, then replays
        perturb(model)
        sync()
        torch.cuda.synchronize()
        assert_copies_current(model)
    if not sync.use_cuda_graph:
        pytest.fail("the sync fell back to eager: it must capture for every format")
    assert sync.captures == 1
    # the weights move (e.g. a checkpoint assigned new tensors): the stale graph must not be replayed
    for m in linears(model):
        m.weight = torch.nn.Parameter(m.weight.detach().clone() + 0.05)
    sync()
    torch.cuda.synchronize()
    assert_copies_current(model)
    perturb(model)
    sync()
    torch.cuda.synchronize()
    assert_copies_current(model)
    assert sync.captures == 2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
def test_gpu_graph_sync_writes_stacked_copies_caches_and_smoothed_weights(monkeypatch, fmt):
    """The sync quantizes straight into each rollout copy's buffers: also where they are row views of the fused
    decoder's stacked q/k/v and gate/up buffers (which must stay stacked), with smoothing factors (the copy is
    Q(W diag(s))) and with a dequantized cache, which must hold the copy's values; bit for bit the reference, over
    the eager sync, the capture and replays."""
    from quarl.model import qlinear
    from quarl.model.smoothing import input_groups
    from quarl.rollout.fused_decode import FusedDecoder

    model = build("split", fmt, "cuda", torch.bfloat16)
    # the quantize-then-copy path must not be what passes this test: every sync writes through out=
    monkeypatch.setattr(qlinear, "_quantize_weight", lambda w, fmt: pytest.fail("the sync took the copying path"))
    for group in input_groups(model):  # one factor tensor per input, shared as calibration shares it
        s = torch.rand(group[0].in_features, device="cuda") * 4 + 0.05
        for lin in group:
            lin.set_rollout_smoothing(s)
    for m in linears(model):
        m._build_dequant_cache()
    decoder = FusedDecoder.for_model(model)
    decoder.prepare()
    model.set_rollout(True)
    stacked = [p for p in decoder.qkv + decoder.gate_up if p.fused_qweight is not None]
    model.set_rollout(False)
    if fmt != "fp8-block":  # the tiny model's 64-wide projections are not whole fp8-block tiles
        assert len(stacked) == len(decoder.qkv) + len(decoder.gate_up)
    sync = RolloutSync(model)
    for _ in range(4):
        perturb(model)
        sync()
        torch.cuda.synchronize()
        for m in linears(model):
            w = m.weight.detach().to(m.compute_dtype)
            expected = quantize((w * m.rollout_smoothing).to(w.dtype), m.rollout_format, "weight")
            assert torch.equal(m.qweight.data.view(torch.uint8), expected.data.view(torch.uint8))
            assert torch.equal(m.qweight.scale.reshape(-1), expected.scale.reshape(-1))
            assert torch.equal(m.weight_dequant, expected.dequantize(m.weight_dequant.dtype))
    assert sync.captures == 1
    model.set_rollout(True)
    assert all(p.fused_qweight is not None for p in stacked)  # still views of the stacked buffers
    model.set_rollout(False)
