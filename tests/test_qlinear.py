"""QuantLinear: every mode's forward vs a float64 reference, in-place refresh, straight-through gradients, LoRA,
qlora (no master weight), dtype/device safety of the rollout buffers, the kernel hook.

Tolerances: a float32 matmul over K terms differs from the float64 result by at most ~K * 2^-24 * sum|x_k w_k|
(recursive summation bound); the checks use that bound elementwise. bf16 layers use 2^-7 instead of 2^-24 K
(one bf16 rounding of the output plus bf16 products).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import quarl.kernels
from quarl.formats import FORMATS, fake_quantize, quantize
from quarl.model.qlinear import QuantLinear
from quarl.precision import LoraConfig, PrecisionConfig

ALL = list(FORMATS)


def make_layer(k=300, n=200, bias=True, dtype=torch.float32, **settings) -> QuantLinear:
    layer = QuantLinear(k, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k) * 0.05)
        layer.weight[3] *= 40  # an outlier row
        if bias:
            layer.bias.copy_(torch.randn(n))
    if settings:
        layer.configure(**settings)
    return layer


def assert_matmul_close(y: torch.Tensor, x64: torch.Tensor, w64: torch.Tensor, b64: torch.Tensor | None,
                        dtype=torch.float32) -> None:
    """y ~= x64 @ w64^T + b64 within the summation error bound of `dtype`."""
    ref = x64 @ w64.T + (0 if b64 is None else b64)
    mag = x64.abs() @ w64.abs().T + (0 if b64 is None else b64.abs())
    k = x64.shape[-1]
    tol = (k * 2.0**-24 if dtype == torch.float32 else 2.0**-7) * mag + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= tol).all()), float((err / tol).max())


def test_full_precision_forward_and_unconfigured_layer():
    layer = make_layer()
    x = torch.randn(4, 7, 300)
    assert_matmul_close(layer(x), x.double(), layer.weight.double(), layer.bias.double())
    layer.configure()  # the bf16 flow: everything off
    assert layer.qweight is None and layer.lora_A is None
    layer.set_rollout(True)
    assert_matmul_close(layer(x), x.double(), layer.weight.double(), layer.bias.double())


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("weight_only", [False, True])
def test_rollout_forward_matches_float64_reference(fmt, weight_only):
    layer = make_layer(rollout_format=fmt, weight_only=weight_only)
    layer.set_rollout(True)
    x = torch.randn(2, 9, 300) * torch.exp(torch.randn(2, 9, 1))
    y = layer(x)
    assert y.shape == (2, 9, 200) and y.dtype == torch.float32
    w64 = quantize(layer.weight, fmt).dequantize(torch.float64)
    x64 = x.double() if weight_only else quantize(x, fmt, "activation").dequantize(torch.float64)
    assert_matmul_close(y, x64, w64, layer.bias.double())
    # the quantization is really applied: the full-precision output differs by more than the tolerance
    layer.set_rollout(False)
    assert not torch.allclose(layer(x), y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "fp8-block", "nvfp4"])
def test_rollout_forward_bf16_layer(fmt):
    layer = make_layer(dtype=torch.bfloat16, rollout_format=fmt, weight_only=fmt == "nvfp4")
    layer.set_rollout(True)
    x = torch.randn(5, 300, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    # the rollout copy quantizes the bf16 master values (what the training side sees too)
    w64 = quantize(layer.weight, fmt).dequantize(torch.bfloat16).double()
    x64 = x.double() if fmt == "nvfp4" else fake_quantize(x, fmt, "activation").double()
    assert_matmul_close(y, x64, w64, layer.bias.double(), dtype=torch.bfloat16)
    assert layer.qweight_data is not None and layer.weight_dequant.dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ALL)
def test_refresh_is_in_place_and_follows_the_master_weight(fmt):
    layer = make_layer(rollout_format=fmt)
    bufs = [b for b in (layer.qweight_data, layer.qweight_scale, layer.qweight_global_scale, layer.weight_dequant)
            if b is not None]
    ptrs = [b.data_ptr() for b in bufs]
    x = torch.randn(6, 300)
    layer.set_rollout(True)
    y_old = layer(x)
    with torch.no_grad():
        layer.weight.mul_(1.7).add_(0.01 * torch.randn_like(layer.weight))
    assert torch.equal(layer(x), y_old)  # the rollout copy only changes at the sync
    layer.refresh()
    assert [b.data_ptr() for b in bufs] == ptrs
    fresh = quantize(layer.weight, fmt)
    assert torch.equal(layer.qweight.dequantize(), fresh.dequantize())
    assert torch.equal(layer.weight_dequant, fresh.dequantize())
    y_new = layer(x)
    assert not torch.equal(y_new, y_old)
    ref = make_layer(rollout_format=None)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    ref.configure(rollout_format=fmt)
    ref.set_rollout(True)
    assert torch.equal(ref(x), y_new)  # same as a layer configured from scratch


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unified_rollout_equals_training_and_gradients_are_straight_through(fmt, dtype):
    weight_only = FORMATS[fmt].weight_only_default
    layer = make_layer(dtype=dtype, rollout_format=fmt, train_format=fmt, weight_only=weight_only)
    x = torch.randn(3, 5, 300, dtype=dtype, requires_grad=True)
    y_train = layer(x)
    with torch.no_grad():
        layer.set_rollout(True)
        y_roll = layer(x)
        layer.set_rollout(False)
    assert torch.equal(y_train, y_roll)

    g = torch.randn_like(y_train)
    y_train.backward(g)
    # reference: autograd of F.linear on the quantized values, same upstream gradient
    xq = (x.detach() if weight_only else fake_quantize(x.detach(), fmt, "activation")).requires_grad_(True)
    wq = fake_quantize(layer.weight.detach(), fmt).requires_grad_(True)
    bq = layer.bias.detach().clone().requires_grad_(True)
    y_ref = F.linear(xq, wq, bq)
    # same values; BLAS may pick a differently blocked kernel for the reference, hence a few-ulp tolerance
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(y_ref, y_train.detach(), **tol)
    y_ref.backward(g)
    torch.testing.assert_close(layer.weight.grad, wq.grad, **tol)
    torch.testing.assert_close(x.grad, xq.grad, **tol)
    torch.testing.assert_close(layer.bias.grad, bq.grad, **tol)
    assert layer.weight.grad.abs().sum() > 0


def test_split_training_forward_is_full_precision_with_full_gradients():
    layer = make_layer(**PrecisionConfig(flow="split", format="int8").linear_settings())
    x = torch.randn(4, 300, requires_grad=True)
    y = layer(x)
    assert_matmul_close(y, x.double(), layer.weight.double(), layer.bias.double())
    y.sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.ones(4, 200).T @ x.detach(), rtol=1e-5, atol=1e-5)


def test_lora_starts_as_noop_then_learns_with_frozen_base():
    torch.manual_seed(0)
    base = make_layer(rollout_format="int8")
    layer = copy.deepcopy(base)
    layer.configure(rollout_format="int8", lora_rank=4, lora_alpha=8.0)
    assert layer.lora_A.shape == (4, 300) and layer.lora_B.shape == (200, 4) and layer.scaling == 2.0
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    assert layer.lora_A.std() > 0 and torch.count_nonzero(layer.lora_B) == 0
    x = torch.randn(8, 300)
    for mode in (False, True):
        layer.set_rollout(mode)
        base.set_rollout(mode)
        assert torch.equal(layer(x), base(x))
    layer.set_rollout(False)
    w0 = layer.weight.detach().clone()
    y0 = layer(x).detach()
    opt = torch.optim.SGD([layer.lora_A, layer.lora_B], lr=0.1)
    target = torch.randn(8, 200)
    losses = []
    for _ in range(5):
        loss = (layer(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert not torch.equal(layer(x), y0)
    assert torch.equal(layer.weight, w0) and layer.weight.grad is None
    # the LoRA term is x @ A^T @ B^T * scaling, also in rollout mode (added to the quantized base)
    layer.set_rollout(True)
    lora64 = x.double() @ layer.lora_A.double().T @ layer.lora_B.double().T * 2.0
    base.set_rollout(True)
    torch.testing.assert_close((layer(x) - base(x)).double(), lora64, rtol=1e-4, atol=1e-5)


def test_lora_dropout_only_in_training_forward():
    layer = make_layer(lora_rank=4, lora_dropout=0.5)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(16, 300)
    layer.train()
    assert not torch.equal(layer(x), layer(x))  # random masks
    layer.set_rollout(True)
    assert torch.equal(layer(x), layer(x))  # the behaviour policy is deterministic
    layer.set_rollout(False)
    layer.eval()
    assert torch.equal(layer(x), layer(x))


@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_qlora_drops_master_weight_and_matches_across_modes(fmt):
    settings = PrecisionConfig(flow="qlora", format=fmt, lora=LoraConfig(rank=8)).linear_settings()
    assert settings["frozen_base"] and settings["weight_only"]
    w = torch.randn(200, 300) * 0.05
    layer = make_layer(rollout_format=None)
    with torch.no_grad():
        layer.weight.copy_(w)
    layer.configure(**settings)
    assert layer.weight is None
    assert "weight" not in dict(layer.named_parameters())
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}
    sd = layer.state_dict()
    assert "qweight_data" in sd and "qweight_scale" in sd  # the quantized base IS the weight now
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    x = torch.randn(2, 4, 300, requires_grad=True)
    y_train = layer(x)
    with torch.no_grad():
        layer.set_rollout(True)
        y_roll = layer(x)
        layer.set_rollout(False)
    assert torch.equal(y_train, y_roll)
    deq = quantize(w, fmt).dequantize(torch.float64)
    lora = layer.lora_B.double() @ layer.lora_A.double() * layer.scaling
    assert_matmul_close(y_train.detach(), x.detach().double(), deq + lora, layer.bias.double())
    torch.testing.assert_close(layer.merged_weight().double(), deq + lora, rtol=1e-5, atol=1e-6)
    y_train.sum().backward()
    assert layer.lora_A.grad is not None and layer.lora_B.grad is not None and x.grad is not None
    layer.refresh()  # a no-op: the base never changes
    with pytest.raises(ValueError, match="dropped"):
        layer.configure(rollout_format=fmt)
    layer.configure(**settings)  # re-applying the same configuration is a no-op
    assert layer.lora_B.grad is not None


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_module_dtype_and_device_moves_keep_the_quantized_copy(fmt):
    layer = make_layer(rollout_format=fmt)
    before = layer.qweight.dequantize()
    dtypes = (layer.qweight.data.dtype, layer.qweight.scale.dtype)
    layer.to(torch.bfloat16)
    assert (layer.qweight.data.dtype, layer.qweight.scale.dtype) == dtypes
    assert torch.equal(layer.qweight.dequantize(), before)
    assert layer.weight_dequant.dtype == torch.bfloat16
    layer.set_rollout(True)
    assert layer(torch.randn(2, 300, dtype=torch.bfloat16)).dtype == torch.bfloat16
    layer.to("cpu")  # .to(device) moves the buffers (the same call moves them to a GPU)
    clone = copy.deepcopy(layer)
    assert torch.equal(clone.qweight.dequantize(), before)
    clone.refresh()
    assert clone.qweight_data.data_ptr() != layer.qweight_data.data_ptr()


def test_cache_policy_gives_identical_outputs():
    cached = make_layer(rollout_format="nvfp4")
    uncached = copy.deepcopy(cached)
    uncached.configure(rollout_format=None)
    uncached.cache_dequantized = False
    uncached.configure(rollout_format="nvfp4")
    assert cached.weight_dequant is not None and uncached.weight_dequant is None
    x = torch.randn(3, 300)
    for m in (cached, uncached):
        m.set_rollout(True)
    assert torch.equal(cached(x), uncached(x))
    assert uncached.weight_dequant is None  # False means never
    # automatic policy where no cache exists yet (a GPU layer): the first fallback forward builds it
    lazy = copy.deepcopy(cached)
    lazy.weight_dequant = None
    y = lazy(x)
    assert lazy.weight_dequant is not None and torch.equal(y, cached(x))
    ptr = lazy.weight_dequant.data_ptr()
    with torch.no_grad():
        lazy.weight.mul_(2)
    lazy.refresh()
    assert lazy.weight_dequant.data_ptr() == ptr
    assert torch.equal(lazy.weight_dequant, lazy.qweight.dequantize())


def test_fake_quantize_unchecked_matches_fake_quantize():
    from quarl.formats.registry import fake_quantize_unchecked

    for fmt in ALL:
        x = torch.randn(3, 4, 200, dtype=torch.bfloat16)
        assert torch.equal(fake_quantize_unchecked(x, fmt, "activation"), fake_quantize(x, fmt, "activation"))


def test_kernel_hook_is_used_in_rollout_when_no_gradient_is_needed(monkeypatch):
    layer = make_layer(rollout_format="fp8", bias=True)
    calls = []

    def fake_kernel(x, qweight, weight_only, bias=None):
        calls.append((tuple(x.shape), qweight.fmt, weight_only, bias is layer.bias))
        return torch.full((x.shape[0], qweight.shape[0]), 7.0)

    monkeypatch.setattr(quarl.kernels, "try_quantized_matmul", fake_kernel)
    layer.set_rollout(True)
    with torch.no_grad():
        y = layer(torch.randn(2, 3, 300))
    assert calls == [((6, 300), "fp8", False, True)]
    assert y.shape == (2, 3, 200) and bool((y == 7).all())
    y = layer(torch.randn(2, 300, requires_grad=True))  # autograd needs the reference path
    assert len(calls) == 1 and not bool((y == 7).all())


def test_empty_batch():
    layer = make_layer(rollout_format="fp8-block")
    layer.set_rollout(True)
    assert layer(torch.randn(0, 300)).shape == (0, 200)


@pytest.mark.parametrize("fmt,weight_only", [("nvfp4", True), ("int8", False)])
def test_qlora_backward_keeps_no_dequantized_weight_and_matches_float64(fmt, weight_only):
    """The frozen base's backward re-dequantizes instead of keeping deq(base) [out, in] alive (QLoRA memory);
    gradients of x, bias and the adapters equal the float64 chain rule through the same quantized values."""
    n, k = 200, 300
    layer = QuantLinear(k, n, bias=True, dtype=torch.float64)
    layer.cache_dequantized = False  # the memory-saving path (the GPU default for a frozen base)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    w64 = layer.weight.detach().clone()
    layer.configure(rollout_format=fmt, train_format=fmt, weight_only=weight_only, frozen_base=True, lora_rank=4)
    layer.bias.requires_grad_(True)  # exercise the bias gradient too
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    x = torch.randn(3, 5, k, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, n, dtype=torch.float64)
    saved_shapes = []

    def pack(t):
        saved_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert (n, k) not in saved_shapes and (k, n) not in saved_shapes, saved_shapes
    (y * g).sum().backward()

    deq = quantize(w64, fmt).dequantize(torch.float64)
    xq = x.detach() if weight_only else fake_quantize(x.detach(), fmt, "activation")
    a, b, s = layer.lora_A.detach(), layer.lora_B.detach(), layer.scaling
    torch.testing.assert_close(y.detach(), xq @ deq.T + layer.bias.detach() + (x.detach() @ a.T @ b.T) * s,
                               rtol=1e-12, atol=1e-12)
    g2, x2 = g.reshape(-1, n), x.detach().reshape(-1, k)
    # straight-through activation quantization: d/dx of Q_act(x) is the identity
    torch.testing.assert_close(x.grad, g @ deq + (g @ b @ a) * s, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, g2.sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.lora_B.grad, s * g2.T @ (x2 @ a.T), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.lora_A.grad, s * (g2 @ b).T @ x2, rtol=1e-12, atol=1e-12)


def test_frozen_base_accepts_new_adapters_but_not_a_new_base():
    layer = make_layer(rollout_format="nvfp4", weight_only=True, frozen_base=True)
    assert layer.lora_A is None and layer.weight is None
    codes = layer.qweight_data.clone()
    layer.configure(rollout_format="nvfp4", weight_only=True, frozen_base=True, lora_rank=4, lora_alpha=8.0)
    assert layer.lora_A.shape == (4, 300) and layer.scaling == 2.0 and not layer.bias.requires_grad
    assert torch.equal(layer.qweight_data, codes)  # the base is untouched
    layer.configure(rollout_format="nvfp4", weight_only=True, frozen_base=True, lora_rank=0)
    assert layer.lora_A is None and layer.bias.requires_grad  # freezing by the adapters is undone with them
    with pytest.raises(ValueError, match="base cannot be reconfigured"):
        layer.configure(rollout_format="int8", weight_only=True, frozen_base=True, lora_rank=4)


def test_bad_configuration_and_input():
    layer = make_layer()
    with pytest.raises(ValueError, match="unknown number format 'int4'.*valid formats"):
        layer.configure(rollout_format="int4")
    with pytest.raises(ValueError, match="needs a rollout_format"):
        layer.configure(frozen_base=True, lora_rank=4)
    with pytest.raises(ValueError, match="differ"):
        layer.configure(rollout_format="nvfp4", train_format="int8", frozen_base=True)
    with pytest.raises(ValueError, match="lora_rank"):
        layer.configure(lora_rank=-1)
    with pytest.raises(ValueError, match="lora_dropout"):
        layer.configure(lora_rank=2, lora_dropout=1.0)
    with pytest.raises(ValueError, match=r"\[\.\.\., 300\]"):
        layer(torch.randn(2, 299))
    with pytest.raises(TypeError):
        layer.configure("int8")  # keyword-only, like PrecisionConfig.linear_settings()


def test_reconfigure_restores_trainability_and_repr():
    layer = make_layer(rollout_format="int8", lora_rank=4)
    text = repr(layer)
    assert "rollout=int8" in text and "lora_rank=4" in text
    assert not layer.weight.requires_grad
    layer.configure(rollout_format="fp8-block", train_format="fp8-block")
    assert layer.weight.requires_grad and layer.lora_A is None
    assert "train=fp8-block" in repr(layer) and "lora" not in repr(layer)
    assert layer.qweight.fmt == "fp8-block"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL)
def test_cuda_rollout_kernel_path_matches_reference(fmt):
    """On a GPU the rollout forward may run a kernel; it must match the float64 product of the quantized
    values (bf16 tolerance), as the CPU reference path does, and refresh must stay in place.
    K = 576 (SmolLM2's hidden size) is not a multiple of 128: it exercises the padded fp8-block layout."""
    weight_only = FORMATS[fmt].weight_only_default
    layer = make_layer(k=576, n=384, dtype=torch.bfloat16).cuda()
    layer.configure(rollout_format=fmt, weight_only=weight_only)
    assert layer.weight_dequant is None  # no dequantized cache on a GPU by default
    layer.set_rollout(True)
    w64 = quantize(layer.weight.cpu(), fmt).dequantize(torch.float64)  # bit-identical to the GPU quantization
    assert torch.equal(layer.qweight.dequantize(torch.float64).cpu(), w64)
    for m in (1, 64, 300):
        x = torch.randn(m, 576, dtype=torch.bfloat16)
        with torch.no_grad():
            y = layer(x.cuda()).cpu()
        x64 = x.double() if weight_only else quantize(x, fmt, "activation").dequantize(torch.float64)
        assert_matmul_close(y, x64, w64, layer.bias.detach().double().cpu(), dtype=torch.bfloat16)
    ptr = layer.qweight_data.data_ptr()
    with torch.no_grad():
        layer.weight.mul_(0.5)
    layer.refresh()
    assert layer.qweight_data.data_ptr() == ptr
    assert torch.equal(layer.qweight.dequantize().cpu(), quantize(layer.weight.cpu(), fmt).dequantize())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int8"])
def test_cuda_qlora_training_forward_and_backward_match_float64(fmt):
    """A frozen base on a GPU: the dequantized base (one Triton kernel for fp4) equals the reference values
    bit for bit, and the memory-saving backward gives the float64 chain-rule gradients (bf16 tolerance)."""
    layer = make_layer(k=576, n=384, dtype=torch.bfloat16).cuda()
    w_ref = layer.weight.detach().cpu()
    layer.configure(rollout_format=fmt, train_format=fmt, weight_only=True, frozen_base=True, lora_rank=4)
    assert layer.weight_dequant is None
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(layer._dequantized_base(dtype).cpu(), quantize(w_ref, fmt).dequantize(dtype))
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    x = torch.randn(2, 33, 576, dtype=torch.bfloat16)
    xc = x.cuda().requires_grad_(True)
    g = torch.randn(2, 33, 384, dtype=torch.bfloat16)
    y = layer(xc)
    (y * g.cuda()).sum().backward()
    w64 = quantize(w_ref, fmt).dequantize(torch.float64)
    a, b = layer.lora_A.detach().double().cpu(), layer.lora_B.detach().double().cpu()
    merged = w64 + layer.scaling * b @ a
    assert_matmul_close(y.detach().cpu(), x.double(), merged, layer.bias.detach().double().cpu(), dtype=torch.bfloat16)
    # dL/dx = g @ W: the same bound, with g as the input and W^T as the weight
    assert_matmul_close(xc.grad.cpu(), g.double(), merged.T, None, dtype=torch.bfloat16)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-tensor"])
def test_weight_rounding_helper_is_the_reference_on_cpu(fmt):
    """`kernels.fake_quantize_weight` rounds int8/fp8/fp8-tensor weights as activations (its GPU path relies on
    per-row / per-tensor weight scales being the activation scales): the reference weight values."""
    from quarl import kernels

    w = torch.randn(70, 300) * torch.rand(70, 1)
    assert torch.equal(kernels.fake_quantize_weight(w, fmt), fake_quantize(w, fmt, "weight"))


def _lora64(y, x, a, b, g, scaling):
    """float64 (y + x A^T B^T * scaling) and the gradients of y, x, A, B under output gradient g."""
    leaves = [t.detach().double().requires_grad_(True) for t in (y, x, a, b)]
    out = leaves[0] + leaves[1] @ leaves[2].T @ leaves[3].T * scaling
    out.backward(g.double())
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_accumulates_in_the_gemm_epilogue_with_float64_values_and_gradients(dtype):
    """add_lora: y + x A^T B^T * scaling, the scaling folded into B and the sum done by addmm; its value and the
    gradients of y, x, A and B equal the float64 ones elementwise within a few roundings of the dtype times the
    same sums taken over absolute values (float32: 2^-20; bf16: 2^-6, i.e. four roundings of its intermediate
    products, B * scaling and the output). in_place into a column slice of a wider output (the rollout's stacked
    q/k/v) gives the same values as out of place."""
    layer = QuantLinear(96, 40)
    layer.configure(lora_rank=3, lora_alpha=6.0)
    with torch.no_grad():
        layer.lora_B.normal_()
    y = torch.randn(2, 5, 40, dtype=dtype, requires_grad=True)
    x = torch.randn(2, 5, 96, dtype=dtype, requires_grad=True)
    g = torch.randn(2, 5, 40, dtype=dtype)
    out = layer.add_lora(y, x)
    out.backward(g)
    a, b = layer.lora_A.detach(), layer.lora_B.detach()
    want = _lora64(y, x, a, b, g, layer.scaling)
    mag = _lora64(y.abs(), x.abs(), a.abs(), b.abs(), g.abs(), layer.scaling)
    eps = 2.0**-20 if dtype == torch.float32 else 2.0**-6
    for got, ref, m in zip([out, y.grad, x.grad, layer.lora_A.grad, layer.lora_B.grad], want, mag):
        err = (got.detach().double() - ref).abs()
        assert bool((err <= eps * m + 1e-12).all()), float((err / (eps * m + 1e-12)).max())
    assert not torch.equal(layer.lora_A.grad, torch.zeros_like(a))  # the adapter really took part
    with torch.no_grad():
        wide = torch.randn(10, 70, dtype=dtype)
        expected = layer.add_lora(wide[:, 20:60].clone(), x.reshape(10, 96))
        layer.add_lora(wide[:, 20:60], x.reshape(10, 96), in_place=True)
        assert torch.equal(wide[:, 20:60], expected)


def test_sync_requantizes_a_frozen_base_only_when_it_changed(monkeypatch):
    """refresh(only_if_changed=True), the trainer's sync: a LoRA-frozen weight is not quantized again while it is
    unchanged (torch's version counter), is after an in-place change, and a trained weight always is; a plain
    refresh() always re-quantizes (it also covers writes through .data)."""
    import quarl.model.qlinear as qlinear

    calls = []
    real = qlinear.QuantLinear._quantize_into_rollout_copy
    monkeypatch.setattr(qlinear.QuantLinear, "_quantize_into_rollout_copy",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    frozen = make_layer(rollout_format="int8", lora_rank=4)
    trained = make_layer(rollout_format="int8")
    assert not frozen.weight.requires_grad and trained.weight.requires_grad
    calls.clear()
    frozen.refresh(only_if_changed=True)
    assert calls == []
    trained.refresh(only_if_changed=True)
    assert calls == [1]
    with torch.no_grad():
        frozen.weight.mul_(2.0)
    frozen.refresh(only_if_changed=True)
    assert len(calls) == 2
    torch.testing.assert_close(frozen.qweight.dequantize(torch.float32),
                               quantize(frozen.weight.detach(), "int8", "weight").dequantize(torch.float32))
    frozen.weight.data.mul_(0.5)  # invisible to the version counter: only a plain refresh() sees it
    frozen.refresh(only_if_changed=True)
    assert len(calls) == 2
    frozen.refresh()
    assert len(calls) == 3


@pytest.mark.parametrize("alpha", [8.0, 4.0])  # scaling 2, and 1 (B in the parameter's own dtype)
def test_rollout_uses_a_cast_copy_of_the_adapter_refreshed_in_place(alpha):
    """In rollout mode (no autograd) add_lora reads (A, B * scaling) cast when the rollout began: the same
    output bit for bit as casting on every call; the copy never aliases the parameters, and the next rollout
    rewrites it in place (same storage, new values) so captured CUDA graphs see the trained adapter."""
    layer = make_layer(rollout_format="int8", lora_rank=4, lora_alpha=alpha)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(6, 300)
    layer.set_rollout(True)
    a_copy, b_copy = layer._rollout_adapter
    assert a_copy.data_ptr() != layer.lora_A.data_ptr()
    assert b_copy.data_ptr() != layer.lora_B.data_ptr()
    with torch.no_grad():
        y = layer(x)
        uncached = layer._rollout_forward(x, layer.bias)
        uncached = torch.addmm(uncached, x @ layer.lora_A.T, (layer.lora_B * layer.scaling).T)
    assert torch.equal(y, uncached)
    layer.set_rollout(False)
    with torch.no_grad():
        layer.lora_B.add_(1.0)  # a training step changes the adapter
    layer.set_rollout(True)
    assert layer._rollout_adapter[1].data_ptr() == b_copy.data_ptr()
    torch.testing.assert_close(layer._rollout_adapter[1], layer.lora_B * layer.scaling, rtol=0, atol=0)
    with torch.no_grad():
        assert not torch.equal(layer(x), y)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block", "nvfp4"])
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (1536, 576), (576, 1536), (130, 200)])
def test_cuda_sync_kernels_give_the_reference_codes(fmt, n, k):
    """The per-step sync on a GPU (a one-pass kernel where one exists): the rollout copy's codes and scales equal
    `quarl.formats.quantize` of the bf16 master bit for bit, after an update too, in the same buffers."""
    if fmt.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    layer = make_layer(k=k, n=n, rollout_format=fmt, dtype=torch.bfloat16).cuda()
    ptr = layer.qweight_data.data_ptr()
    for _ in range(2):
        with torch.no_grad():
            layer.weight.add_(torch.randn_like(layer.weight) * 0.01)
        layer.refresh()
        ref = quantize(layer.weight.detach(), fmt, "weight")
        qw = layer.qweight
        assert torch.equal(qw.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(qw.scale.float(), ref.scale.float().reshape(qw.scale.shape))
    assert layer.qweight_data.data_ptr() == ptr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_straight_through_forwards_the_value_exactly_and_passes_the_gradient_unchanged(dtype):
    from quarl.formats import fake_quantize
    from quarl.model.qlinear import _straight_through

    source = torch.randn(5, 576, dtype=dtype, requires_grad=True)
    value = fake_quantize(source.detach(), "fp8-block", "activation")
    out = _straight_through(value, source)
    assert torch.equal(out, value) and out.requires_grad and out.dtype == dtype
    grad = torch.randn(5, 576, dtype=dtype)
    (out * grad).sum().backward()
    assert torch.equal(source.grad, grad)  # the identity, no rounding
    with torch.no_grad():
        assert not _straight_through(value, source).requires_grad


def _exact_kernel(calls):
    """A stand-in for `kernels.quantized_matmul` on the CPU: Q(x) @ deq(qweight)^T + b computed exactly (float64),
    rounded once to x's dtype, as an 8-bit GEMM with float32 accumulation nearly does."""
    from quarl.formats import fake_quantize

    def matmul(x, qweight, weight_only, bias=None):
        calls.append(qweight)
        xq = x if weight_only else fake_quantize(x, qweight.fmt, "activation")
        y = xq.double() @ qweight.dequantize(torch.float64).T
        return (y if bias is None else y + bias.double()).to(x.dtype)

    return matmul


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
def test_unified_training_forward_runs_the_rollout_kernel_with_straight_through_gradients(fmt, monkeypatch):
    """kernel_forward: the training forward returns the kernel's product (not bf16 GEMMs of the rounded fake-quantized
    operands), reads the rollout copy while it is current, and gets the fake-quantized path's gradients."""
    from quarl import kernels
    from quarl.formats import fake_quantize, quantize

    calls = []
    monkeypatch.setattr(kernels, "kernels_available", lambda device=None: True)
    monkeypatch.setattr(kernels, "fp8_kernels_available", lambda device=None: True)
    monkeypatch.setattr(kernels, "quantized_matmul", _exact_kernel(calls))
    torch.manual_seed(0)
    layer = make_layer(k=576, n=200, dtype=torch.bfloat16, rollout_format=fmt, train_format=fmt,
                       kernel_forward=True)
    x = torch.randn(2, 7, 576, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    reads_copy = lambda qt: qt.data.data_ptr() == layer.qweight_data.data_ptr()  # noqa: E731
    assert len(calls) == 1 and reads_copy(calls[0])  # the rollout copy, current since configure
    with torch.no_grad():
        want = _exact_kernel([])(x.reshape(-1, 576), layer.qweight, False, layer.bias).reshape(2, 7, 200)
        plain = F.linear(fake_quantize(x, fmt, "activation"), fake_quantize(layer.weight, fmt), layer.bias)
    assert torch.equal(y, want) and not torch.equal(y, plain)  # the kernel's values, which bf16 GEMMs round otherwise
    with torch.no_grad():  # the rollout forward takes the kernel too, so both compute one function
        layer.set_rollout(True)
        assert torch.equal(layer(x), y) and reads_copy(calls[-1])
        layer.set_rollout(False)
    g = torch.randn_like(y)
    y.backward(g)
    # float64 reference of the straight-through gradients: d/dx = g @ Q(W), d/dW = g^T Q(x), d/db = sum g
    g64 = g.double().reshape(-1, 200)
    wq = fake_quantize(layer.weight.detach(), fmt).double()
    xq = fake_quantize(x.detach(), fmt, "activation").double().reshape(-1, 576)
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.double().reshape(-1, 576), g64 @ wq, **tol)
    torch.testing.assert_close(layer.weight.grad.double(), g64.T @ xq, **tol)
    torch.testing.assert_close(layer.bias.grad.double(), g64.sum(0), **tol)
    # and bit for bit those of the fake-quantized path (off the kernel: bf16 GEMMs) on the same weights and input
    twin = copy.deepcopy(layer)
    twin.configure(rollout_format=fmt, train_format=fmt, bf16_gemms=True)
    with torch.no_grad():
        twin.weight.copy_(layer.weight)
        twin.bias.copy_(layer.bias)
    x2 = x.detach().clone().requires_grad_(True)
    twin(x2).backward(g)
    assert torch.equal(x2.grad, x.grad) and torch.equal(twin.weight.grad, layer.weight.grad)
    assert torch.equal(twin.bias.grad, layer.bias.grad)
    # an optimizer step in place makes the rollout copy stale: the forward re-quantizes the weight as it is now
    # into the rollout copy (same buffers), which is then current for the next micro-batch and the rollout
    with torch.no_grad():
        layer.weight.mul_(1.5)
    layer(x)
    assert reads_copy(calls[-1]) and torch.equal(calls[-1].data, quantize(layer.weight.detach(), fmt).data)
    assert layer._current_rollout_copy(fmt) is not None
    # on bf16 GEMMs: no kernel, the fake-quantized path
    layer.configure(rollout_format=fmt, train_format=fmt, bf16_gemms=True)
    count = len(calls)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(fake_quantize(x, fmt, "activation"), fake_quantize(layer.weight, fmt),
                                              layer.bias))
    assert len(calls) == count


@pytest.mark.parametrize("fmt", ["int8", "fp8-block"])
def test_unified_kernel_backward_reads_the_forwards_codes_and_refreshes_once_per_optimizer_step(fmt, monkeypatch):
    """The kernel forward's backward dequantizes the codes the forward multiplied (no second quantization); after an
    optimizer step the rollout copy is re-quantized once, not in every micro-batch; and a re-quantization between a
    forward and its backward is refused by autograd rather than giving silently wrong gradients."""
    from quarl import kernels
    from quarl.model import qlinear

    monkeypatch.setattr(kernels, "kernels_available", lambda device=None: True)
    monkeypatch.setattr(kernels, "fp8_kernels_available", lambda device=None: True)
    monkeypatch.setattr(kernels, "quantized_matmul", _exact_kernel([]))
    dequantized, quantized = [], []
    monkeypatch.setattr(kernels, "dequantize", lambda q, dtype: dequantized.append(q) or q.dequantize(dtype))
    real = qlinear._quantize_weight
    monkeypatch.setattr(qlinear, "_quantize_weight", lambda w, f: quantized.append(f) or real(w, f))
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    layer = make_layer(k=576, n=200, dtype=torch.bfloat16, rollout_format=fmt, train_format=fmt,
                       kernel_forward=True)
    x = torch.randn(3, 5, 576, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    codes = lambda qt: qt.data.view(torch.uint8) if qt.data.element_size() == 1 else qt.data  # noqa: E731 (fp8 ==)
    assert len(dequantized) == 1 and torch.equal(codes(dequantized[0]), codes(layer.qweight)) and quantized == []
    with torch.no_grad():
        layer.weight.mul_(1.5)  # an optimizer step: the rollout copy is stale
    for _ in range(2):  # two micro-batches of the next mini-batch
        layer(x).sum().backward()
    assert quantized == [fmt] and torch.equal(codes(dequantized[-1]), codes(layer.qweight))
    y = layer(x)
    with torch.no_grad():
        layer.weight.mul_(0.5)
    layer.refresh()  # re-quantized in place before y's backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_kernel_forward_skips_the_kernel_where_none_can_run(monkeypatch):
    """float32 compute (or a GPU without the format's kernels): no weight quantization, no kernel call, the
    fake-quantized path (which the rollout forward takes there too)."""
    from quarl import kernels

    calls = []
    monkeypatch.setattr(kernels, "kernels_available", lambda device=None: True)
    monkeypatch.setattr(kernels, "fp8_kernels_available", lambda device=None: False)
    monkeypatch.setattr(kernels, "quantized_matmul", _exact_kernel(calls))
    monkeypatch.setattr(kernels, "try_quantize_weight", lambda *a: calls.append("quantized") or None)
    x = torch.randn(4, 300, requires_grad=True)
    layer = make_layer(rollout_format="int8", train_format="int8", kernel_forward=True)  # float32
    layer(x).sum().backward()
    bf16 = make_layer(dtype=torch.bfloat16, rollout_format="fp8", train_format="fp8", kernel_forward=True)
    bf16(x.detach().bfloat16())  # fp8 needs FP8 kernels, unavailable here
    assert calls == []


@pytest.mark.parametrize("fmt", ["int8", "fp8-block"])
def test_unified_on_bf16_gemms_multiplies_the_rollout_copy_in_rollout_and_training(fmt, monkeypatch):
    """bf16_gemms (the unified flow off the kernels): the rollout forward never calls a quantized kernel, even
    where one would serve, and the training forward multiplies the rollout copy's dequantized cache itself
    (re-quantized once after an optimizer step), so rollout and training return the same values; the gradients are
    the straight-through ones."""
    from quarl import kernels

    calls = []
    monkeypatch.setattr(kernels, "try_quantized_matmul", _exact_kernel(calls))
    monkeypatch.setattr(kernels, "quantized_matmul", _exact_kernel(calls))
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    x = torch.randn(3, 9, 576, dtype=torch.bfloat16, requires_grad=True)
    # control: a split-flow linear's rollout takes the (patched) kernel, so the patch sees kernel calls
    split = make_layer(k=576, n=256, dtype=torch.bfloat16, rollout_format=fmt)
    split.set_rollout(True)
    with torch.no_grad():
        split(x)
    assert len(calls) == 1 and not split.rollout_avoids_kernel()
    layer = make_layer(k=576, n=256, dtype=torch.bfloat16, rollout_format=fmt, train_format=fmt, bf16_gemms=True)
    assert layer.rollout_avoids_kernel() and layer.weight_dequant is not None and not layer.kernel_forward
    y = layer(x)
    layer.set_rollout(True)
    with torch.no_grad():
        rolled = layer(x)
    layer.set_rollout(False)
    assert len(calls) == 1 and torch.equal(rolled, y)
    with torch.no_grad():
        want = F.linear(fake_quantize(x, fmt, "activation"), fake_quantize(layer.weight, fmt), layer.bias)
    assert torch.equal(y, want)
    g = torch.randn_like(y)
    y.backward(g)
    g64 = g.double().reshape(-1, 256)
    xq = fake_quantize(x.detach(), fmt, "activation").double().reshape(-1, 576)
    wq = fake_quantize(layer.weight.detach(), fmt).double()
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(layer.weight.grad.double(), g64.T @ xq, **tol)
    torch.testing.assert_close(x.grad.double().reshape(-1, 576), g64 @ wq, **tol)
    # an optimizer step in place: the next training forward re-quantizes into the same cache and multiplies it
    cache_ptr = layer.weight_dequant.data_ptr()
    with torch.no_grad():
        layer.weight.mul_(1.5)
    assert layer._current_rollout_copy(fmt) is None
    with torch.no_grad():
        y2 = layer(x)
        assert torch.equal(y2, F.linear(fake_quantize(x, fmt, "activation"), fake_quantize(layer.weight, fmt),
                                        layer.bias))
    assert layer._current_rollout_copy(fmt) is not None and layer.weight_dequant.data_ptr() == cache_ptr
    assert torch.equal(layer.weight_dequant, fake_quantize(layer.weight, fmt)) and len(calls) == 1


def test_frozen_base_on_bf16_gemms_multiplies_its_dequantized_cache_in_rollout_and_training(monkeypatch):
    """A qlora base with bf16_gemms: the rollout never calls the 4-bit kernel (a base without it does), and rollout and
    training multiply the same dequantized cache, so both return the same values; the adapters still train."""
    from quarl import kernels

    calls = []
    monkeypatch.setattr(kernels, "try_quantized_matmul", _exact_kernel(calls))
    monkeypatch.setattr(kernels, "quantized_matmul", _exact_kernel(calls))
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    x = torch.randn(2, 5, 576, dtype=torch.bfloat16)
    settings = dict(rollout_format="nvfp4", train_format="nvfp4", weight_only=True, frozen_base=True, lora_rank=4)
    on_kernel = make_layer(k=576, n=192, dtype=torch.bfloat16, **settings)
    on_kernel.set_rollout(True)
    with torch.no_grad():
        on_kernel(x)
    assert len(calls) == 1 and on_kernel.rollout_needs_kernel()  # control: the patch sees the kernel
    layer = make_layer(k=576, n=192, dtype=torch.bfloat16, **settings, bf16_gemms=True)
    assert layer.rollout_avoids_kernel() and not layer.rollout_needs_kernel() and layer.weight_dequant is not None
    with torch.no_grad():
        layer.lora_B.normal_()  # a trained adapter, so that it shows in both outputs
    y = layer(x)
    layer.set_rollout(True)
    with torch.no_grad():
        rolled = layer(x)
    layer.set_rollout(False)
    assert len(calls) == 1
    base = layer.qweight.dequantize(torch.bfloat16)
    assert torch.equal(layer.weight_dequant, base)
    torch.testing.assert_close(rolled.float(), y.detach().float(), rtol=0, atol=0)
    y.sum().backward()
    assert layer.lora_A.grad is not None and layer.lora_A.grad.abs().sum() > 0


def test_siblings_on_bf16_gemms_fake_quantize_their_shared_input_once(monkeypatch):
    """q/k/v reading one input inside a shared-input block (`shared_input_linears`): the unified training forward
    and the rollout's module path fake-quantize it once, with the values each linear makes alone; a changed input
    (in place, or another tensor) is quantized again."""
    from quarl import kernels
    from quarl.model.fp8_training import shared_input_codes
    from quarl.model.shared_input import shared_input_linears

    real, calls = kernels.fake_quantize_activation, []
    monkeypatch.setattr(kernels, "fake_quantize_activation", lambda x, fmt: calls.append(fmt) or real(x, fmt))
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    parts = [make_layer(k=576, n=n, dtype=torch.bfloat16, rollout_format="fp8-block", train_format="fp8-block",
                        bf16_gemms=True) for n in (192, 64, 64)]
    x = torch.randn(2, 7, 576, dtype=torch.bfloat16, requires_grad=True)
    alone = [p(x) for p in parts]
    assert len(calls) == 3
    for rollout in (False, True):
        for p in parts:
            p.set_rollout(rollout)
        calls.clear()
        with torch.set_grad_enabled(not rollout):
            shared = shared_input_linears(parts, x)
        assert len(calls) == 1, rollout
        assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(alone, shared))
    with shared_input_codes():
        calls.clear()
        parts[0].set_rollout(False)
        parts[0](x)
        with torch.no_grad():
            x.add_(1.0)  # in place: a new version
        parts[0](x)
        parts[0](x.detach().clone())
        assert len(calls) == 3
