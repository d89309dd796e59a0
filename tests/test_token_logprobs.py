"""The fused log-prob kernel (`quarl.kernels.token_logprobs`): log-probabilities of the targets, the rows'
entropy and the gradient wrt the logits against float64 (softmax of logits / temperature). Tolerances: the
forward is float32 arithmetic over up to V terms (3e-5 of the logsumexp's magnitude, at least 3e-5); the
gradient is rounded to the logits' dtype (one rounding: 2^-10 relative for fp16, near zero two subnormal
spacings), on top of the float32 softmax's relative error (the same 3e-5 bound). The
interpreter runs fp16 and float32; the GPU tests bf16 and the trainer's answer_logprobs with the kernel."""

import textwrap

import pytest
import torch

from interpreter import INTERPRETER_PATCH, run_in_interpreter


def check_token_logprobs(n, v, dtype, temperature, device="cpu"):
    from quarl.kernels.token_logprobs import token_logprobs

    logits = (torch.randn(n, v, device=device) * 4).to(dtype)
    logits[0, : v // 3] = float("-inf")  # masked vocabulary entries (e.g. a filtered sampler)
    targets = torch.randint(v // 3, v, (n,), device=device)
    g = torch.randn(n, device=device)
    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs(x, targets, temperature, with_entropy=True)
    lp.backward(g)
    x64 = logits.double().requires_grad_(True)
    logp64 = torch.log_softmax(x64 / temperature, dim=-1)
    lp64 = logp64.gather(-1, targets[:, None]).squeeze(-1)
    lp64.backward(g.double())
    p64 = logp64.exp()
    ent64 = -(p64 * torch.where(p64 > 0, logp64, torch.zeros_like(logp64))).sum(-1)
    assert lp.dtype == ent.dtype == torch.float32 and x.grad.dtype == dtype
    # float32 sums of up to V terms and a float32 log: a few 2^-24 of the logsumexp's magnitude, with margin
    tol = 3e-5 * max(1.0, float(torch.logsumexp(x64.detach() / temperature, -1).abs().max()))
    torch.testing.assert_close(lp.double(), lp64.detach(), rtol=0, atol=tol)
    torch.testing.assert_close(ent.double(), ent64.detach(), rtol=0, atol=tol)
    # One rounding to the dtype (ulp: its spacing relative to the value; near zero the subnormal spacing), on top
    # of the float32 softmax, whose relative error follows the logsumexp's (tol).
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-22}[dtype]
    subnormal = torch.finfo(dtype).smallest_normal * ulp
    err = (x.grad.double() - x64.grad).abs()
    bound = (ulp + tol) * x64.grad.abs() + 2 * subnormal + 1e-12
    assert bool((err <= bound).all()), float((err / bound).max())
    lp_only, none = token_logprobs(logits, targets, temperature)
    assert none is None and torch.equal(lp_only, lp.detach())


_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    from test_token_logprobs import check_token_logprobs
    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    print("seed", seed)
    for n, v, dtype, t in [(3, 5000, torch.float16, 0.7), (2, 2048, torch.float32, 1.0), (4, 300, torch.float16, 1.3)]:
        check_token_logprobs(n, v, dtype, t)
    print("ok")
""")


def test_token_logprob_kernels_in_the_interpreter():
    """A vocabulary that is not a multiple of the block, exactly one block, and shorter than one; -inf logits."""
    run_in_interpreter(_CHECK)


def test_token_logprobs_refuses_bad_arguments():
    pytest.importorskip("triton")
    from quarl.kernels.token_logprobs import token_logprobs

    with pytest.raises(ValueError, match="temperature > 0"):
        token_logprobs(torch.randn(2, 10), torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="unit column stride"):
        token_logprobs(torch.randn(10, 2).t(), torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_token_logprobs_match_float64(dtype):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    for n, v, t in [(37, 152064, 1.0), (5, 3000, 0.6)]:
        check_token_logprobs(n, v, dtype, t, device="cuda")


@pytest.mark.gpu
def test_cuda_answer_logprobs_with_the_kernel_equal_the_torch_path(monkeypatch):
    """answer_logprobs with `FastPaths.fused_logprobs` on (the kernel runs): log-probs, entropy and a weight
    gradient as with it off (the kernel does not run), within float32 summation order (1e-4) and bf16 gradient
    rounding."""
    from quarl.fast_paths import FastPaths
    from quarl.kernels import token_logprobs as kernel
    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.tiny import tiny_config
    from quarl.rl import batch

    from quarl import kernels

    model = QuarlForCausalLM(tiny_config("qwen2")).cuda().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (3, 20), device="cuda")
    # the kernel's first-use self-check (per device as answer_logprobs names it: cuda:0) calls it too: run that
    # check before counting calls
    assert kernels.training_kernel_ok("token_logprobs", ids.device, torch.bfloat16)
    calls = []
    real = kernel.token_logprobs
    monkeypatch.setattr(kernel, "token_logprobs", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    out = {}
    for fused in (False, True):
        model.set_fast_paths(FastPaths(fused_logprobs=fused))
        model.zero_grad()
        calls.clear()
        lp, ent = batch.answer_logprobs(model, ids, mask, 0.8, 8, with_entropy=True)
        lp.sum().backward()
        assert len(calls) == int(fused)
        out[fused] = (lp.detach(), ent, model.lm_head.weight.grad.float().clone())
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-4)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=1e-4)
    g0 = out[False][2]
    torch.testing.assert_close(out[True][2], g0, rtol=2**-6, atol=2**-6 * float(g0.abs().max()))
