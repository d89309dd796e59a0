"""The training rotary-embedding kernel (`quarl.kernels.rope_train`): forward and backward equal PyTorch's
`apply_rope` (x * cos + rotate_half(x) * sin and its autograd) in the same dtype. The kernel rounds each product
and then the sum, as PyTorch's elementwise ops do (its launch turns off floating-point contraction), so results
are equal bit for bit in every dtype. The interpreter runs fp16 and float32; the GPU tests
run bf16, fp16 and float32."""

import textwrap

import pytest
import torch

from interpreter import INTERPRETER_PATCH, run_in_interpreter
from tiny_models import logits_and_grads


def check_rope_against_torch(B, Bc, T, H, D, dtype, device="cpu"):
    """Random x [B, T, H, D] and positions; cos/sin with batch Bc (1: shared by the rows)."""
    from quarl.kernels.rope_train import rope
    from quarl.model.layers import apply_rope

    x = (torch.randn(B, T, H, D, device=device) * 3).to(dtype)
    # Independent random values in each half (RotaryEmbedding repeats one half; distinct halves catch a kernel that
    # reads cos/sin from the wrong half), [Bc, 1, T, D] as RotaryEmbedding returns them.
    cos, sin = ((torch.rand(Bc, 1, T, D, device=device) * 2 - 1).to(dtype) for _ in range(2))
    g = torch.randn(B, T, H, D, device=device).to(dtype)
    x1 = x.clone().requires_grad_(True)
    y = rope(x1, cos, sin)
    y.backward(g)
    x2 = x.clone().requires_grad_(True)
    y_ref = apply_rope(x2.transpose(1, 2), cos, sin).transpose(1, 2)
    y_ref.backward(g)
    assert y.shape == (B, T, H, D) and y.dtype == dtype and x1.grad.dtype == dtype
    assert torch.equal(y, y_ref), float((y.float() - y_ref.float()).abs().max())
    assert torch.equal(x1.grad, x2.grad), float((x1.grad.float() - x2.grad.float()).abs().max())


_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    from test_rope_train import check_rope_against_torch
    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    print("seed", seed)
    for B, Bc, T, H, D, dtype in [(2, 2, 5, 3, 16, torch.float16), (3, 1, 4, 5, 32, torch.float16),
                                  (1, 1, 7, 2, 8, torch.float32), (2, 2, 3, 40, 128, torch.float16)]:
        check_rope_against_torch(B, Bc, T, H, D, dtype)
    print("ok")
""")


def test_rope_kernels_in_the_interpreter():
    """Forward and backward kernels on the CPU through Triton's interpreter: heads not a power of two, a block of
    heads with masked rows (40 heads of 128), cos/sin shared by the batch or per row."""
    run_in_interpreter(_CHECK)


def test_rope_refuses_layouts_it_cannot_serve():
    pytest.importorskip("triton")
    from quarl.kernels.rope_train import rope

    cos = torch.randn(1, 1, 4, 12)
    with pytest.raises(ValueError, match="D a power of two"):
        rope(torch.randn(2, 4, 3, 12), cos, cos)  # D = 12
    cos = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="contiguous heads"):
        rope(torch.randn(2, 3, 4, 16).transpose(1, 2), cos, cos)  # heads not contiguous per token


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_rope_matches_torch_bit_for_bit(dtype):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    for B, Bc, T, H, D in [(2, 2, 33, 28, 128), (3, 1, 5, 4, 128), (1, 1, 9, 12, 64)]:
        check_rope_against_torch(B, Bc, T, H, D, dtype, device="cuda")


@pytest.mark.gpu
def test_cuda_attention_with_fused_rope_equals_the_torch_rope(monkeypatch):
    """A bf16 model with `FastPaths.fused_rope` on (the kernel runs) gives the logits and q_proj weight gradient
    of it off (the kernel does not run) within bf16 rounding (the rotated q/k are equal bit for bit, but attention
    may pick another kernel for their layout)."""
    from quarl.fast_paths import FastPaths
    from quarl.kernels import rope_train
    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.tiny import tiny_config

    calls = []
    real = rope_train.rope
    monkeypatch.setattr(rope_train, "rope", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    model = QuarlForCausalLM(tiny_config("qwen2")).cuda().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), device="cuda")
    out = {}
    for fused in (False, True):
        model.set_fast_paths(FastPaths(fused_rope=fused))
        calls.clear()
        logits, (grad,) = logits_and_grads(model, ids, [model.model.layers[0].self_attn.q_proj.weight])
        assert bool(calls) == fused
        out[fused] = (logits, grad)
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-6 * float(b.float().abs().max()))
