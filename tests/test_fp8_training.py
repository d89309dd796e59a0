"""FP8-block training GEMMs (`precision.quantized_backward`, Jet-RL): forward equal to the unified forward,
gradients equal to the float64 products of the quantized operands, configuration errors (the trainer runs
this flow in tests/test_trainer.py).

Tolerance: every GEMM here multiplies quantized values in float32; against the float64 product of the same
values the error is at most ~C * 2^-24 * sum|a_c b_c| over the C reduced terms (the recursive summation bound,
as in tests/test_qlinear.py), checked elementwise.
"""

import pytest
import torch

from quarl.fast_paths import FastPaths
from quarl.formats import fake_quantize
from quarl.model.fp8_training import FP8BlockLinear, block_matmul, fp8_block_linear, quantized_weight
from quarl.model.qlinear import QuantLinear
from quarl.precision import PrecisionConfig


def assert_product_close(got: torch.Tensor, a64: torch.Tensor, b64: torch.Tensor, dtype=torch.float32,
                         bias: torch.Tensor | None = None) -> None:
    """got ~= a64 @ b64^T (+ bias) within the float32 (or bf16) summation bound. The bias is one more summed term
    (a BLAS addmm accumulates the products into it, each step rounding at its magnitude)."""
    ref = a64 @ b64.T
    mag = a64.abs() @ b64.abs().T
    terms = a64.shape[1]
    if bias is not None:
        ref, mag, terms = ref + bias.double(), mag + bias.double().abs(), terms + 1
    tol = (terms * 2.0**-24 if dtype == torch.float32 else 2.0**-7) * mag + 1e-30
    err = (got.double() - ref).abs()
    assert bool((err <= tol).all()), float((err / tol).max())


def q_rows(t: torch.Tensor) -> torch.Tensor:
    """float64 values of t's rows rounded in 1x128 groups (FP8-block activation role)."""
    return fake_quantize(t.float(), "fp8-block", "activation").double()


def q_tiles(t: torch.Tensor) -> torch.Tensor:
    """float64 values of t rounded in 128x128 tiles (FP8-block weight role)."""
    return fake_quantize(t.float(), "fp8-block", "weight").double()


@pytest.mark.parametrize("m,n,k", [(5, 200, 300), (130, 96, 257)])
def test_every_gemm_takes_fp8_block_operands(m, n, k):
    x = (torch.randn(m, k) * torch.rand(m, 1) * 3).requires_grad_(True)
    w = (torch.randn(n, k) * 0.05).requires_grad_(True)
    b = torch.randn(n, requires_grad=True)
    g = torch.randn(m, n) * torch.rand(1, n)
    y = FP8BlockLinear.apply(x, w, b)
    (y * g).sum().backward()
    xd, wd = x.detach(), w.detach()
    assert_product_close(y.detach(), q_rows(xd), q_tiles(wd), bias=b.detach())
    assert_product_close(x.grad, q_rows(g), q_tiles(wd.t()))  # dx = Q(g) @ Q(W^T)^T
    assert_product_close(w.grad, q_rows(g.t()), q_rows(xd.t()))  # dW = Q(g^T) @ Q(x^T)^T
    torch.testing.assert_close(b.grad, g.sum(0))
    # The gradients really are quantized: they differ from the straight-through bf16-style gradients.
    assert not torch.allclose(x.grad, g @ q_tiles(wd).float(), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(w.grad, g.t() @ q_rows(xd).float(), rtol=1e-4, atol=1e-5)


def test_forward_is_the_unified_forward_bit_for_bit_and_leading_dims_are_kept():
    s = PrecisionConfig(flow="unified", format="fp8-block")
    plain = QuantLinear(300, 200, bias=True)
    plain.configure(**s.linear_settings())
    fp8 = QuantLinear(300, 200, bias=True)
    fp8.load_state_dict(plain.state_dict())
    s.quantized_backward = True
    fp8.configure(**s.linear_settings())
    assert fp8.quantized_backward and not plain.quantized_backward
    x = torch.randn(2, 7, 300)
    y = fp8(x)
    assert y.shape == (2, 7, 200)
    assert torch.equal(y, plain(x))
    fp8.set_rollout(True)
    with torch.no_grad():
        assert torch.equal(fp8(x), y)  # rollout and training compute the same function
    assert torch.equal(fp8_block_linear(x, fp8.weight, fp8.bias), y)
    qw = quantized_weight(fp8.weight, x.dtype)
    assert torch.equal(block_matmul(x.reshape(-1, 300), qw, fp8.bias), y.reshape(-1, 200))


def test_configuration_errors_say_what_to_use():
    with pytest.raises(ValueError, match="flow=unified with precision.format=fp8-block"):
        PrecisionConfig(flow="split", format="fp8-block", quantized_backward=True).validate()
    with pytest.raises(ValueError, match="format='fp8'"):
        PrecisionConfig(flow="unified", format="fp8", quantized_backward=True).validate()
    layer = QuantLinear(64, 32)
    with pytest.raises(ValueError, match="train_format='fp8-block'"):
        layer.configure(rollout_format="int8", train_format="int8", quantized_backward=True)


@pytest.mark.gpu
def test_cuda_fp8_training_gemms_match_the_float64_products():
    """On a GPU the forward and input gradient run on FP8 kernels, the weight gradient on dequantized bf16
    operands: each equals the float64 product of the same quantized values within bf16 output rounding."""
    m, n, k = 257, 384, 512
    x = (torch.randn(m, k) * 2).to(torch.bfloat16)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    g = torch.randn(m, n).to(torch.bfloat16)
    xc, wc = x.cuda().requires_grad_(True), w.cuda().requires_grad_(True)
    y = FP8BlockLinear.apply(xc, wc, None)
    y.backward(g.cuda())
    assert y.dtype == xc.grad.dtype == wc.grad.dtype == torch.bfloat16
    assert_product_close(y.detach().cpu(), q_rows(x), q_tiles(w), torch.bfloat16)
    assert_product_close(xc.grad.cpu(), q_rows(g), q_tiles(w.t()), torch.bfloat16)
    assert_product_close(wc.grad.cpu(), q_rows(g.t()), q_rows(x.t()), torch.bfloat16)


_WGRAD_GEMM_CHECK = """
import torch
from quarl.formats import quantize
from quarl.kernels.tuning import Cfg
from quarl.kernels.w8a8_gemm import X_PREQUANT, w8a8_matmul
torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
for m, n, k in [(200, 96, 80), (128, 130, 64), (300, 64, 200)]:
    g = torch.randn(m, n).half()
    x = (torch.randn(m, k) * torch.rand(1, k) * 4).half()
    gq = quantize(g.t().contiguous(), "fp8-block", "activation")
    xq = quantize(x.t().contiguous(), "fp8-block", "activation")
    out = w8a8_matmul(g.t(), xq, None, Cfg(64, 64, 128, warps=4, stages=1), X_PREQUANT, xq=(gq.data, gq.scale))
    ref = gq.dequantize(torch.float64) @ xq.dequantize(torch.float64).T
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert out.shape == (n, k) and err < 2e-3, (m, n, k, err)
print("ok")
"""


def test_weight_gradient_gemm_scales_each_row_group_in_the_interpreter():
    """The weight-gradient GEMM's second operand is an activation-role fp8-block tensor (x^T, 1x128 groups of
    each row): the W8A8 kernel must scale each 128-token partial product by that row's group scale, not by a
    128x128 tile's. Run by Triton's CPU interpreter on reference codes (exact fp16 products of the codes), M not
    a multiple of 128: within fp16 output rounding (2e-3 of the largest value) of the float64 product."""
    from interpreter import INTERPRETER_PATCH, run_in_interpreter

    run_in_interpreter(INTERPRETER_PATCH + _WGRAD_GEMM_CHECK)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(257, 384, 528), (300, 400, 272), (257, 384, 520), (1, 96, 208)])
def test_cuda_fp8_weight_gradient_kernel_matches_the_float64_product(m, n, k):
    """With `FastPaths.fp8_weight_grad_kernel` the weight gradient runs on the FP8 tensor cores
    (`training_gemm.fp8_block_weight_grad`: cuBLAS 1x128 x 1x128 where N and K are multiples of 16, the Triton
    kernel otherwise, both taken here; with M <= 128 cuBLAS sees the rowwise recipe): it equals the float64
    product of the same rounded operands within bf16 output rounding, M not a multiple of 128 (a partial last
    group), and agrees with the bf16-GEMM path to 2^-7."""
    x = (torch.randn(m, k) * 2).to(torch.bfloat16)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    g = (torch.randn(m, n) * torch.rand(1, n) * 3).to(torch.bfloat16)
    grads = {}
    for on in (False, True):
        paths = FastPaths(fp8_weight_grad_kernel=on)
        xc, wc = x.cuda().requires_grad_(True), w.cuda().requires_grad_(True)
        FP8BlockLinear.apply(xc, wc, None, None, paths).backward(g.cuda())
        grads[on] = wc.grad.cpu()
    assert_product_close(grads[True], q_rows(g.t()), q_rows(x.t()), torch.bfloat16)
    scale = float(grads[False].float().abs().max())
    assert float((grads[True].float() - grads[False].float()).abs().max()) <= 2.0**-7 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(257, 200), (128, 64), (5, 3)])
def test_cuda_transposed_column_quantizer_equals_the_reference(m, n):
    """`act_quant.quantize_columns_transposed(x)` writes the codes and scales of
    `quantize(x.t(), "fp8-block", "activation")` bit for bit (codes [N, MP] with zero codes past M, scales
    [MP/128, N]), including a zero column (scale 1), a huge value and partial groups in both directions."""
    from quarl.formats.registry import quantize_unchecked
    from quarl.kernels.act_quant import quantize_columns_transposed

    x = torch.randn(m, n) * torch.rand(1, n) * 4
    x[:, 0] = 0.0
    x[m // 2, n - 1] = 3.0e4
    x = x.to(torch.bfloat16)
    codes, scales = quantize_columns_transposed(x.cuda())
    ref = quantize_unchecked(x.t().contiguous().cuda(), "fp8-block", "activation")  # torch's CUDA rounding
    mp = -(-m // 128) * 128
    assert codes.shape == (n, mp) and scales.shape == (mp // 128, n)
    assert torch.equal(codes.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(scales.t(), ref.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("m,c,cp", [(257, 200, None), (128, 128, 512), (1040, 768, 1024), (16, 3584, None)])
def test_cuda_both_ways_quantizer_equals_the_two_one_way_quantizers(m, c, cp):
    """`act_quant.quantize_rows_and_columns` (one pass) writes exactly what `quantize_activation` (rows in 1x128
    groups, scales column-major, padded to cp columns with zero codes) and `quantize_columns_transposed`
    (columns in 128-row groups) write, a zero column and a huge value included."""
    from quarl.kernels.act_quant import quantize_activation, quantize_columns_transposed, quantize_rows_and_columns

    x = torch.randn(m, c, device="cuda") * torch.rand(1, c, device="cuda") * 4
    x[:, 1] = 0.0
    x[m // 2, c - 1] = 3.0e4
    x = x.to(torch.bfloat16)
    rows, row_scales, cols, col_scales = quantize_rows_and_columns(x, cp)
    ref_rows, ref_row_scales = quantize_activation(x, "fp8-block", cp or -(-c // 128) * 128, scales_column_major=True)
    ref_cols, ref_col_scales = quantize_columns_transposed(x)
    assert torch.equal(rows.view(torch.uint8), ref_rows.view(torch.uint8))
    assert row_scales.shape == ref_row_scales.shape and row_scales.stride() == ref_row_scales.stride()
    assert torch.equal(row_scales, ref_row_scales)
    assert torch.equal(cols.view(torch.uint8), ref_cols.view(torch.uint8))
    assert torch.equal(col_scales, ref_col_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1024, 512, 512), (1040, 256, 768), (2048, 384, 1280)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_cublas_linear_matches_the_float64_products(monkeypatch, m, n, k, dtype):
    """Where `training_gemm_ok` holds, FP8BlockLinear runs all three GEMMs on cuBLAS: y, dx and dW each equal the
    float64 product of their rounded operands (x and g in 1x128 groups, W and W^T in 128x128 tiles of W rounded
    to x's dtype; dW's operands in groups along M) within output rounding, K = 768 and 1280 (and N = 384 for dx)
    padded to a multiple of 4 scale groups. Where N and K are multiples of 512, y and dx equal the unfused
    path's bit for bit (the same cuBLAS calls). A frozen weight gets no gradient and its x keeps no codes."""
    from quarl.kernels import training_gemm
    from quarl.model import fp8_training

    x = (torch.randn(m, k) * 2).to(dtype).cuda()
    w = (torch.randn(n, k) * 0.05).cuda()
    b = torch.randn(n).cuda()
    g = (torch.randn(m, n) * torch.rand(1, n) * 3).to(dtype).cuda()
    assert fp8_training.training_gemm_ok(x, n)
    calls = []
    real_forward = training_gemm.linear_forward
    monkeypatch.setattr(training_gemm, "linear_forward", lambda *a, **kw: calls.append(kw) or real_forward(*a, **kw))
    out = {}
    for fused in (True, False):
        paths = FastPaths(fused_cublas_path=fused)
        xc, wc, bc = x.clone().requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        y = FP8BlockLinear.apply(xc, wc, bc, None, paths)
        y.backward(g)
        out[fused] = (y, xc.grad, wc.grad, bc.grad)
    assert calls == [{"keep_x_codes": True, "qweight": None, "share": None}]
    (y, dx, dw, db), (y0, dx0, _, db0) = out[True], out[False]
    w_c = w.to(dtype).cpu()
    assert_product_close(y.cpu(), q_rows(x.cpu()), q_tiles(w_c), torch.bfloat16, bias=b.cpu().to(dtype))
    assert_product_close(dx.cpu(), q_rows(g.cpu()), q_tiles(w_c.t()), torch.bfloat16)
    assert dw.dtype == w.dtype and torch.equal(db, db0)
    assert_product_close(dw.cpu(), q_rows(g.cpu().t()), q_rows(x.cpu().t()), torch.bfloat16)
    if n % 512 == 0 and k % 512 == 0:
        assert torch.equal(y, y0) and torch.equal(dx, dx0)
    xc = x.clone().requires_grad_(True)
    FP8BlockLinear.apply(xc, w, None).backward(g)  # frozen weight: input gradient only (default paths: fused)
    assert calls[-1] == {"keep_x_codes": False, "qweight": None, "share": None} and torch.equal(xc.grad, dx)
    # ... and with its codes quantized once (FrozenWeightCodes, as a LoRA-frozen base passes them): the same
    # cuBLAS calls on the same codes, so the same values bit for bit.
    codes = fp8_training.FrozenWeightCodes(quantized_weight(w, dtype), quantized_weight(w, dtype, transpose=True))
    xc = x.clone().requires_grad_(True)
    y_frozen = FP8BlockLinear.apply(xc, w, None, codes)
    y_frozen.backward(g)
    assert calls[-1]["qweight"] is codes.padded("forward") and not calls[-1]["keep_x_codes"]
    assert torch.equal(xc.grad, dx) and torch.equal(y_frozen, FP8BlockLinear.apply(x, w, None))


@pytest.mark.parametrize("k,multiple,groups", [(768, 4, 8), (1000, 4, 8), (512, 4, 4), (130, 3, 3)])
def test_block_group_padding_adds_zero_codes_that_change_no_product(k, multiple, groups):
    """`pad_block_groups` (the cuBLAS blockwise K padding) appends zero codes with scale 1 up to a multiple of
    `multiple` 128-wide groups: the padded weight times zero-padded activations is the same product, and an
    already aligned weight is returned as is."""
    from quarl.formats.fp8 import pad_block_groups

    from quarl.formats.registry import quantize_unchecked

    qw = quantize_unchecked((torch.randn(200, k) * 0.1), "fp8-block", "weight")
    padded = pad_block_groups(qw, multiple)
    assert padded.data.shape == (200, 128 * groups) and padded.scale.shape == (2, groups)
    if padded is qw:
        assert qw.data.shape[1] // 128 % multiple == 0
        return
    kp = qw.data.shape[1]
    assert torch.equal(padded.data[:, :kp].view(torch.uint8), qw.data.view(torch.uint8))
    assert not padded.data[:, kp:].view(torch.uint8).any() and torch.equal(padded.scale[:, kp // 128:],
                                                                           torch.ones(2, groups - kp // 128))
    x = torch.randn(3, kp, dtype=torch.float64)
    x_padded = torch.cat([x, torch.randn(3, 128 * groups - kp, dtype=torch.float64)], dim=1)  # any values
    from quarl.formats.fp8 import dequantize_fp8_block

    # float64 sums of the same nonzero terms (BLAS may block the two lengths differently: 1e-12, not bit for bit)
    torch.testing.assert_close(x_padded @ dequantize_fp8_block(padded).double().T,
                               x @ dequantize_fp8_block(qw).double().T, rtol=1e-12, atol=1e-12)


def test_fused_training_gemms_are_not_taken_off_the_gpu():
    """On a CPU tensor the all-cuBLAS training path says no (and imports no Triton): FP8BlockLinear keeps the
    reference path there."""
    from quarl.model.fp8_training import training_gemm_ok

    assert not training_gemm_ok(torch.randn(1024, 256), 256)


def _reference_training_kernels(monkeypatch):
    """Stand-ins for the GPU pieces of `kernels.training_gemm` with the same layouts, from `quarl.formats`
    (codes) and float64 products (the cuBLAS GEMMs), so its plumbing runs on a CPU."""
    from quarl.formats.fp8 import dequantize_fp8_block
    from quarl.formats.registry import quantize_unchecked
    from quarl.kernels import dispatch, training_gemm, weight_quant

    def rows(x, cp, scales_column_major=True):  # codes [M, cp], scales [M, cp/128] column-major
        q = quantize_unchecked(torch.nn.functional.pad(x.float(), (0, cp - x.shape[1])), "fp8-block", "activation")
        return q.data, q.scale.t().contiguous().t()

    def cols(x):  # codes of x^T [C, MP], scales [MP/128, C]
        q = quantize_unchecked(x.t().contiguous().float(), "fp8-block", "activation")
        return q.data, q.scale.t().contiguous()

    def deq(codes, scales):  # scales [R, groups]
        return codes.double() * scales.double().repeat_interleave(128, dim=1)[:, :codes.shape[1]]

    def scaled_mm_codes(codes, sx, qw, bias, dtype):
        assert sx.stride(0) == 1 and codes.shape[1] == qw.data.shape[1] and qw.data.shape[1] // 128 % 4 == 0
        y = deq(codes, sx) @ dequantize_fp8_block(qw).double().T
        return (y + (0 if bias is None else bias.double())).to(dtype)

    monkeypatch.setattr(training_gemm, "quantize_rows_and_columns", lambda x, cp=None: (*rows(x, cp), *cols(x)))
    monkeypatch.setattr(training_gemm, "quantize_activation",
                        lambda x, fmt, kp, scales_column_major, num_warps=4: rows(x, kp))
    monkeypatch.setattr(training_gemm, "quantize_columns_transposed", cols)
    monkeypatch.setattr(training_gemm, "weight_grad_from_codes",
                        lambda gc, gs, xc, xs, dtype: (deq(gc, gs.t()) @ deq(xc, xs.t()).T).to(dtype))
    monkeypatch.setattr(dispatch, "scaled_mm_codes", scaled_mm_codes)
    monkeypatch.setattr(weight_quant, "quantize_fp8_block_weight", lambda w, transpose=False: quantize_unchecked(
        (w.t() if transpose else w).contiguous().float(), "fp8-block", "weight"))


@pytest.mark.parametrize("m,n,k", [(256, 384, 768), (128, 512, 512)])
def test_training_gemm_plumbing_on_reference_pieces(monkeypatch, m, n, k):
    """`training_gemm.linear_forward` / `linear_backward` with their kernels replaced by reference pieces of the
    same layouts (Triton must import; no GPU needed): y, dx and dW equal the float64 products of the rounded
    operands within bf16 output rounding, for K and N padded to 4 scale groups (768, 384) and not; each
    gradient alone equals the one computed with both; a frozen weight's forward keeps no codes."""
    pytest.importorskip("triton")
    _reference_training_kernels(monkeypatch)
    from quarl.kernels import training_gemm

    x, w = (torch.randn(m, k) * 2).to(torch.bfloat16), torch.randn(n, k) * 0.05
    b, g = torch.randn(n).to(torch.bfloat16), (torch.randn(m, n) * torch.rand(1, n) * 3).to(torch.bfloat16)
    y, x_codes = training_gemm.linear_forward(x, w, b, keep_x_codes=True)
    dx, dw = training_gemm.linear_backward(g, w, x_codes, True, True)
    wb = w.to(torch.bfloat16)
    assert_product_close(y, q_rows(x), q_tiles(wb), torch.bfloat16, bias=b)
    assert_product_close(dx, q_rows(g), q_tiles(wb.t()), torch.bfloat16)
    assert_product_close(dw, q_rows(g.t()), q_rows(x.t()), torch.bfloat16)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    dx_only, none = training_gemm.linear_backward(g, w, None, True, False)
    none2, dw_only = training_gemm.linear_backward(g, w, x_codes, False, True)
    assert none is None and none2 is None and torch.equal(dx_only, dx) and torch.equal(dw_only, dw)
    y_frozen, no_codes = training_gemm.linear_forward(x, w, b, keep_x_codes=False)
    assert no_codes is None and torch.equal(y_frozen, y)
    # Codes passed in (a frozen weight's, quantized once) are used instead of quantizing W again.
    from quarl.kernels import weight_quant

    qw, qwt = weight_quant.quantize_fp8_block_weight(wb), weight_quant.quantize_fp8_block_weight(wb, transpose=True)
    monkeypatch.setattr(weight_quant, "quantize_fp8_block_weight", None)  # any call now fails
    y_given, _ = training_gemm.linear_forward(x, w, b, keep_x_codes=False, qweight=qw)
    dx_given, _ = training_gemm.linear_backward(g, w, None, True, False, qweight_t=qwt)
    assert torch.equal(y_given, y) and torch.equal(dx_given, dx)


def _frozen_lora_layer(k: int = 300, n: int = 200) -> QuantLinear:
    """A unified fp8-block quantized_backward layer with a LoRA adapter (so its base weight is frozen), B != 0."""
    layer = QuantLinear(k, n, bias=True)
    s = PrecisionConfig(flow="unified", format="fp8-block", quantized_backward=True)
    s.lora.rank = 4
    layer.configure(**s.linear_settings())
    with torch.no_grad():
        layer.lora_B.normal_()
    assert not layer.weight.requires_grad and layer.lora_A.requires_grad
    return layer


def _reference_frozen_lora(layer: QuantLinear, x: torch.Tensor, g: torch.Tensor):
    """(y, dx, dA, dB) of the same layer with the base quantized on every call (FP8BlockLinear, frozen=None)."""
    xr = x.clone().requires_grad_(True)
    a, b = layer.lora_A, layer.lora_B
    a.grad = b.grad = None
    y = layer.add_lora(FP8BlockLinear.apply(xr, layer.weight, layer.bias), xr)  # the layer's own LoRA term
    y.backward(g)
    return y.detach(), xr.grad, a.grad.clone(), b.grad.clone()


def test_frozen_lora_base_is_quantized_once_with_the_same_values(monkeypatch):
    """quantized_backward under LoRA: the frozen base's FP8 codes are built once (Q(W) is the rollout copy itself,
    Q(W^T) kept on the module) and reused by every forward and backward; outputs and all gradients equal the
    per-call quantization bit for bit; an in-place change of the weight, or refresh(), rebuilds them."""
    from quarl.model import fp8_training

    layer = _frozen_lora_layer()
    quantized = []
    real = fp8_training.quantized_weight
    monkeypatch.setattr(fp8_training, "quantized_weight", lambda *a, **kw: quantized.append(kw) or real(*a, **kw))

    def step():
        x, g = torch.randn(3, 5, 300), torch.randn(3, 5, 200)
        xc = x.clone().requires_grad_(True)
        layer.lora_A.grad = layer.lora_B.grad = None
        y = layer(xc)
        y.backward(g)
        got = (y.detach(), xc.grad, layer.lora_A.grad.clone(), layer.lora_B.grad.clone())
        calls = len(quantized)
        for a, b in zip(got, _reference_frozen_lora(layer, x.reshape(-1, 300), g.reshape(-1, 200))):
            assert torch.equal(a.reshape(b.shape), b)
        del quantized[calls:]  # the reference's own quantizations are not the layer's

    for _ in range(3):
        step()
    assert quantized == [{"transpose": True}]  # Q(W^T) once; Q(W) is the rollout copy
    assert layer._frozen_codes.forward.data.data_ptr() == layer.qweight_data.data_ptr()
    with torch.no_grad():
        layer.weight.mul_(1.5)  # the rollout copy is now stale: both codes are quantized from the new weight
    step()
    assert quantized[1:] == [{}, {"transpose": True}]
    layer.refresh()  # the sync: the rollout copy is current again and is used
    step()
    assert quantized[3:] == [{"transpose": True}]
    assert layer._frozen_codes.forward.data.data_ptr() == layer.qweight_data.data_ptr()


def test_frozen_codes_for_a_trained_weight_are_refused():
    from quarl.model.fp8_training import FrozenWeightCodes

    w = torch.randn(200, 300, requires_grad=True)
    codes = FrozenWeightCodes(quantized_weight(w, torch.float32), quantized_weight(w, torch.float32, transpose=True))
    with pytest.raises(ValueError, match="frozen=None for a trained weight"):
        FP8BlockLinear.apply(torch.randn(4, 300), w, None, codes)


def test_a_replaced_frozen_weight_gets_fresh_codes_and_sync():
    """A weight replaced by another tensor (load_state_dict(assign=True): a new tensor whose version counter may
    equal the old one's) is neither served from the old FP8 codes nor skipped by the sync."""
    layer = _frozen_lora_layer()
    x = torch.randn(4, 300)
    y_old = layer(x)
    new_weight = layer.weight.detach() * 3
    while new_weight._version < layer.weight._version:  # the same version number as the old tensor
        new_weight.add_(0.0)
    assert new_weight._version == layer.weight._version
    layer.load_state_dict({**layer.state_dict(), "weight": new_weight}, assign=True)
    layer.weight.requires_grad_(False)
    ref = FP8BlockLinear.apply(x, layer.weight, layer.bias) + layer.add_lora(torch.zeros(4, 200), x)
    y_new = layer(x)
    assert not torch.equal(y_new, y_old) and torch.equal(y_new, ref)
    layer.refresh(only_if_changed=True)  # the sync must re-quantize the new weight into the rollout copy
    expected = quantized_weight(layer.weight, torch.float32)
    assert torch.equal(layer.qweight.data.view(torch.uint8), expected.data.view(torch.uint8))


@pytest.mark.parametrize("k", [768, 512])
def test_fused_path_takes_frozen_codes_padded_once(monkeypatch, k):
    """FP8BlockLinear's fused path (on the reference pieces of `_reference_training_kernels`, so it runs on a CPU)
    with FrozenWeightCodes: the padded codes are built once and reused by later calls, and y and dx equal the
    fused path that quantizes W itself (K = 768 needs padding to 8 groups, 512 none)."""
    pytest.importorskip("triton")
    _reference_training_kernels(monkeypatch)
    from quarl.formats import fp8 as fp8_format
    from quarl.model import fp8_training
    from quarl.model.fp8_training import FrozenWeightCodes

    monkeypatch.setattr(fp8_training, "training_gemm_ok", lambda x, n: True)
    m, n = 256, 384
    x = (torch.randn(m, k) * 2).to(torch.bfloat16)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    g = torch.randn(m, n).to(torch.bfloat16)
    codes = FrozenWeightCodes(quantized_weight(w, torch.bfloat16), quantized_weight(w, torch.bfloat16, True))
    copies = []  # (source, padded copy) of every call that had to copy

    def counting_pad(q, mult, real_pad=fp8_format.pad_block_groups):
        out = real_pad(q, mult)
        if out is not q:
            copies.append(q)
        return out

    monkeypatch.setattr(fp8_format, "pad_block_groups", counting_pad)
    results = []
    for frozen in (None, codes, codes):
        xc = x.clone().requires_grad_(True)
        y = FP8BlockLinear.apply(xc, w, None, frozen)
        y.backward(g)
        results.append((y, xc.grad))
    # Each of the frozen operands is copied at most once (only where its group count needs padding), not again in
    # the third call; the per-call path (frozen=None) pads its own fresh codes.
    frozen_copies = [q for q in copies if q is codes.forward or q is codes.transposed]
    assert len(frozen_copies) == len({id(q) for q in frozen_copies}) == (2 if k == 768 else 1)
    for y, dx in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(dx, results[0][1])


def _jet_rl_lora_model(cfg, rank: int, device: str = "cpu", dtype=torch.float32):
    """A random-weight model of cfg in the Jet-RL setting (unified fp8-block, quantized_backward) with LoRA of
    `rank` whose B matrices are nonzero, so the adapters act (rank 0: no LoRA, the weights trained)."""
    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.precision_apply import apply_precision
    from quarl.precision import LoraConfig

    model = QuarlForCausalLM(cfg).to(device, dtype)
    apply_precision(model, PrecisionConfig(flow="unified", format="fp8-block", quantized_backward=True,
                                           lora=LoraConfig(rank=rank)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("rank", [4, 0])
def test_sibling_linears_quantize_their_shared_input_once(monkeypatch, rank):
    """q/k/v and gate/up read one input: on the fused FP8 path (its reference pieces, so it runs on a CPU) that
    input is quantized once per group instead of once per linear (3 quantizations fewer per layer forward), and
    the logits and every trained parameter's gradient are bit for bit those of the linears quantizing it one by
    one: with LoRA (frozen base), and with the weights trained (rank 0; the siblings share x's transposed codes
    for their weight gradients too)."""
    pytest.importorskip("triton")
    _reference_training_kernels(monkeypatch)
    from quarl.model import fp8_training
    from quarl.model.tiny import tiny_config

    monkeypatch.setattr(fp8_training, "training_gemm_ok", lambda x, n: True)
    cfg = tiny_config("qwen2", hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128, intermediate_size=384,
                      num_layers=2)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = _jet_rl_lora_model(cfg, rank=rank)
    _check_shared_input_codes(monkeypatch, model, torch.randint(0, cfg.vocab_size, (2, 9)), trained_base=not rank)


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [8, 0])
def test_cuda_sibling_linears_quantize_their_shared_input_once(monkeypatch, rank):
    """As above on the GPU's kernels (bf16, cuBLAS blockwise: 16 x 64 tokens, N and K multiples of 128)."""
    from quarl.model.tiny import tiny_config

    cfg = tiny_config("qwen2", hidden_size=512, num_heads=4, num_kv_heads=1, head_dim=128, intermediate_size=1024,
                      num_layers=2)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = _jet_rl_lora_model(cfg, rank=rank, device="cuda", dtype=torch.bfloat16)
    _check_shared_input_codes(monkeypatch, model, torch.randint(0, cfg.vocab_size, (16, 64), device="cuda"),
                              trained_base=not rank)


def _check_shared_input_codes(monkeypatch, model, ids, trained_base=False):
    """Forward + backward of mean(logits^2) with the model's `FastPaths.share_input_codes` on and off (set as a
    run sets it, `model.set_fast_paths`): 3 input quantizations fewer per layer with it on, the same logits and gradients (LoRA's, or every parameter's with trained_base) bit for
    bit."""
    from quarl.kernels import training_gemm
    from quarl.model import fp8_training

    num_layers = model.config.num_layers
    calls = []
    real_quantize = training_gemm._quantize_input
    monkeypatch.setattr(training_gemm, "_quantize_input",
                        lambda x, kp, keep: calls.append(x.shape) or real_quantize(x, kp, keep))
    out = {}
    for share in (True, False):
        model.set_fast_paths(FastPaths(share_input_codes=share))
        calls.clear()
        model.zero_grad()
        logits = model(ids)
        logits.square().mean().backward()
        out[share] = len(calls), [logits.detach()] + [p.grad.clone() for n, p in model.named_parameters()
                                                      if p.requires_grad and (trained_base or "lora_" in n)]
        assert fp8_training.shared_input() is None  # dropped when each block ends
    assert out[False][0] >= 7 * num_layers and out[True][0] == out[False][0] - 3 * num_layers
    if not trained_base:
        assert len(out[True][1]) == 1 + 14 * num_layers
    assert all(g.abs().max() > 0 for g in out[True][1][1:5])  # gradients reach the first parameters
    for a, b in zip(out[True][1], out[False][1]):
        assert torch.equal(a, b)


def test_shared_input_codes_block_is_scoped():
    """The sharing dict exists only inside a block, per thread; a nested block has its own and the outer one's is
    back after it; every block's dict is dropped when it ends, also by an exception; none opens when disabled
    (`FastPaths.share_input_codes` off)."""
    import threading

    from quarl.model import fp8_training

    with fp8_training.shared_input_codes():
        outer = fp8_training.shared_input()
        assert outer == {}
        with fp8_training.shared_input_codes():
            assert fp8_training.shared_input() == {} and fp8_training.shared_input() is not outer
        assert fp8_training.shared_input() is outer
        seen = []
        worker = threading.Thread(target=lambda: seen.append(fp8_training.shared_input()))
        worker.start()
        worker.join()
        assert seen == [None]  # another thread is outside any block
    assert fp8_training.shared_input() is None
    with pytest.raises(RuntimeError, match="boom"), fp8_training.shared_input_codes():
        raise RuntimeError("boom")
    assert fp8_training.shared_input() is None
    with fp8_training.shared_input_codes(False):
        assert fp8_training.shared_input() is None


def test_shared_codes_are_keyed_by_the_input_and_its_version(monkeypatch):
    """linear_forward with a share dict (reference pieces, on a CPU): the same x is quantized once for two
    weights; after an in-place write to x, or for another tensor with x's values, it is quantized again; each
    entry keeps its input alive."""
    pytest.importorskip("triton")
    _reference_training_kernels(monkeypatch)
    from quarl.kernels import training_gemm

    calls = []
    real_quantize = training_gemm._quantize_input
    monkeypatch.setattr(training_gemm, "_quantize_input",
                        lambda x, kp, keep: calls.append(1) or real_quantize(x, kp, keep))
    x = torch.randn(32, 256).to(torch.bfloat16)
    w1, w2 = (torch.randn(n, 256).to(torch.bfloat16) * 0.1 for n in (128, 256))
    share = {}
    y1, _ = training_gemm.linear_forward(x, w1, None, False, share=share)
    training_gemm.linear_forward(x, w2, None, False, share=share)
    assert len(calls) == 1 and len(share) == 1 and next(iter(share.values()))[0] is x
    x.mul_(2.0)
    y1_doubled, _ = training_gemm.linear_forward(x, w1, None, False, share=share)
    assert len(calls) == 2 and not torch.equal(y1_doubled, y1)
    training_gemm.linear_forward(x.clone(), w1, None, False, share=share)
    assert len(calls) == 3
