"""The training SiLU·mul kernel (`quarl.kernels.silu_mul_train`): forward and backward against PyTorch's
`F.silu(gate) * up` in the same dtype (within two spacings of the dtype: the kernels round where PyTorch rounds,
and only the float32 exp may differ in its last bit, which can round silu(gate) one spacing apart and move the
product rounded from it by up to two) and against float64 (within four spacings of the dtype relative to
the float64 magnitudes, plus two subnormal spacings: the kernels round up to three times on the way)."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

from interpreter import INTERPRETER_PATCH, run_in_interpreter


def check_against_torch_and_float64(gate, up, dh, fn):
    """fn(gate, up) -> h with autograd; compares h, dgate, dup with torch and with float64."""
    g1, u1 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    h = fn(g1, u1)
    h.backward(dh)
    g2, u2 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    h_ref = F.silu(g2) * u2
    h_ref.backward(dh)
    g64, u64 = gate.double().requires_grad_(True), up.double().requires_grad_(True)
    h64 = F.silu(g64) * u64
    h64.backward(dh.double())
    ulp = 2.0**-7 if gate.dtype == torch.bfloat16 else 2.0**-10  # one spacing, relative to the value
    for got, want, exact in [(h, h_ref, h64), (g1.grad, g2.grad, g64.grad), (u1.grad, u2.grad, u64.grad)]:
        assert got.dtype == gate.dtype and got.shape == gate.shape
        tiny = torch.finfo(gate.dtype).smallest_normal * ulp  # the subnormal spacing
        one = (got.double() - want.double()).abs() <= 2 * ulp * want.double().abs() + 2 * tiny
        assert float(one.float().mean()) == 1.0, float((got.double() - want.double()).abs().max())
        mag = exact.abs() + (dh.double().abs() * (g64.detach().abs() + 1) * (u64.detach().abs() + 1))
        # + the subnormal spacing: a result below the dtype's normal range is rounded to that absolute step
        # (e.g. dh 1.8e-7 times silu(-3.7) = 1.6e-8 is 0 in fp16, whose smallest step is 6e-8)
        assert bool(((got.double() - exact).abs() <= 4 * ulp * mag + 2 * tiny).all())


_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    from test_silu_mul import check_against_torch_and_float64
    from quarl.kernels.silu_mul_train import silu_mul
    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    print("seed", seed)  # shown with the traceback when a check fails
    # fp16 here; the GPU test covers bf16
    for shape, dtype in [((3, 5, 200), torch.float16), ((4100,), torch.float16), ((1, 2048), torch.float16)]:
        gate = (torch.randn(shape) * 4).to(dtype)
        gate.view(-1)[:3] = torch.tensor([-60.0, 0.0, 60.0])  # saturated sigmoid both ways, and zero
        up = torch.randn(shape).to(dtype)
        dh = torch.randn(shape).to(dtype)
        check_against_torch_and_float64(gate, up, dh, silu_mul)
    print("ok")
""")


def test_silu_mul_kernels_in_the_interpreter():
    """Forward and backward kernels on the CPU through Triton's interpreter (a partial last block included)."""
    run_in_interpreter(_CHECK)


def test_silu_mul_refuses_mismatched_inputs():
    pytest.importorskip("triton")
    from quarl.kernels.silu_mul_train import silu_mul

    with pytest.raises(ValueError, match="contiguous gate and up of one shape, dtype and device"):
        silu_mul(torch.randn(4, 6), torch.randn(6, 4).t())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_silu_mul_matches_torch_and_float64(dtype):
    from quarl.kernels.silu_mul_train import silu_mul

    for shape in [(7, 18944), (2, 3, 1000), (1,)]:
        gate = (torch.randn(shape, device="cuda") * 4).to(dtype)
        up = torch.randn(shape, device="cuda").to(dtype)
        dh = torch.randn(shape, device="cuda").to(dtype)
        check_against_torch_and_float64(gate, up, dh, silu_mul)


@pytest.mark.gpu
def test_cuda_mlp_takes_the_kernel_and_keeps_its_gradients():
    """MLP.forward on CUDA bf16 runs `SiluMul` (its autograd node is in the graph) and its output and input
    gradient equal the F.silu(gate) * up version's within one rounding per value."""
    from quarl.model.layers import MLP
    from quarl.model.tiny import tiny_config

    mlp = MLP(tiny_config("qwen2")).cuda().to(torch.bfloat16)
    x = torch.randn(2, 9, mlp.gate_proj.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = mlp(x)
    assert "SiluMul" in type(y.grad_fn.next_functions[0][0]).__name__ or _graph_has(y.grad_fn, "SiluMul")
    y.float().square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = mlp.down_proj(F.silu(mlp.gate_proj(x2)) * mlp.up_proj(x2))
    y2.float().square().sum().backward()
    torch.testing.assert_close(y, y2, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(x.grad, x2.grad, rtol=2**-6, atol=2**-6 * float(x2.grad.abs().max()))


def _graph_has(fn, name: str, depth: int = 6) -> bool:
    if fn is None or depth == 0:
        return False
    if name in type(fn).__name__:
        return True
    return any(_graph_has(f, name, depth - 1) for f, _ in fn.next_functions)
