"""The decoder and the rollout engine on CUDA: tiny models in bf16 against transformers, cached decoding, loading.

bf16 tolerance: our bf16 logits must be within 3x transformers' own bf16 error (both measured against a float32
forward of the same weights on the GPU, TF32 off; random weights of std 0.25 give bf16 errors of ~10% of the logit
range in both) and within 25% of the logit range. float32 on the GPU: 1e-3.
"""

import pytest
import torch

from quarl.model.config import ModelConfig
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.tiny import LLAMA3_ROPE_SCALING, tiny_hf_config, tiny_tokenizer
from quarl.rollout.engine import RolloutEngine

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama3-rope-tied": ("llama", dict(tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE_SCALING, rope_theta=5e5)),
}


def hf_and_ours(case):
    """(transformers model, our model), same fresh random weights with O(1) logits, float32, on the device."""
    from transformers import AutoModelForCausalLM

    arch, overrides = CASES[case]
    hf = AutoModelForCausalLM.from_config(tiny_hf_config(arch, **overrides))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.25 * torch.randn_like(p))
    ours = QuarlForCausalLM(ModelConfig.from_hf(hf.config))
    ours.load_state_dict(hf.state_dict())
    return hf.to(DEVICE).eval(), ours.to(DEVICE).eval()


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_logits_match_transformers(case):
    hf, ours = hf_and_ours(case)
    ids = torch.randint(0, 320, (4, 64), device=DEVICE)
    with torch.no_grad():
        ref32 = hf(ids).logits.float()
        ours32 = ours(ids)
        hf16 = hf.to(torch.bfloat16)(ids).logits.float()
        ours16 = ours.to(torch.bfloat16)(ids)
    assert ours16.dtype == torch.float32 and ours16.device.type == DEVICE
    torch.testing.assert_close(ours32, ref32, atol=1e-3, rtol=0)
    err_ours = (ours16 - ref32).abs().max().item()
    err_hf = (hf16 - ref32).abs().max().item()
    assert err_ours <= 3 * err_hf + 1e-3, (err_ours, err_hf)
    assert err_ours <= 0.25 * ref32.abs().max().item()


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_engine_behaviour_logprobs_greedy_and_bf16(case):
    hf, ours = hf_and_ours(case)
    tok = tiny_tokenizer()
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 12, 8)]
    engine = RolloutEngine(ours, tok)
    outs = engine.generate(prompts, n=4, max_new_tokens=16, temperature=0.8, seed=3)
    again = engine.generate(prompts, n=4, max_new_tokens=16, temperature=0.8, seed=3)
    assert [c.token_ids for o in outs for c in o.completions] == [c.token_ids for o in again for c in o.completions]
    for p, o in zip(prompts, outs):
        for c in o.completions:
            ids = torch.tensor([p + c.token_ids], device=DEVICE)
            with torch.no_grad():
                ref = ours.token_logprobs(ids, temperature=0.8)[0, len(p) - 1:]
            torch.testing.assert_close(torch.tensor(c.logprobs, device=DEVICE), ref, atol=1e-3, rtol=0)
    greedy = engine.generate(prompts, max_new_tokens=12, temperature=0.0)
    for p, o in zip(prompts, greedy):
        ref = hf.generate(torch.tensor([p], device=DEVICE), attention_mask=torch.ones(1, len(p), device=DEVICE,
                          dtype=torch.long), max_new_tokens=12, do_sample=False, pad_token_id=258,
                          eos_token_id=257)[0, len(p):].tolist()
        assert o.completions[0].token_ids == ref
    ours.to(torch.bfloat16)
    outs = engine.generate(prompts, n=2, max_new_tokens=8, temperature=1.0, seed=0)
    for p, o in zip(prompts, outs):
        for c in o.completions:
            ids = torch.tensor([p + c.token_ids], device=DEVICE)
            with torch.no_grad():
                ref = ours.token_logprobs(ids)[0, len(p) - 1:]
            # bf16: cached decode and full forward round differently; log-probs of O(1-10) agree to ~0.1
            torch.testing.assert_close(torch.tensor(c.logprobs, device=DEVICE), ref, atol=0.15, rtol=0.05)


def test_load_model_to_device_in_bf16(tmp_path):
    from quarl.model.loading import load_model, save_pretrained

    _, ours = hf_and_ours("qwen2")
    save_pretrained(ours, tiny_tokenizer(), tmp_path / "m")
    model, _ = load_model(str(tmp_path / "m"), device=DEVICE, dtype=torch.bfloat16)
    assert model.device.type == DEVICE and model.dtype == torch.bfloat16
    ids = torch.randint(0, 320, (2, 10), device=DEVICE)
    assert model.model.rotary_emb.inv_freq(ids.device).dtype == torch.float32
    with torch.no_grad():
        got, ref = model(ids), ours.to(torch.bfloat16)(ids)  # the same bf16-rounded weights
    torch.testing.assert_close(got, ref, atol=1e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,dim", [(7, 3584), (300, 128)])
def test_cuda_rms_norm_matches_float64_forward_and_gradients(dtype, rows, dim):
    """RMSNorm on CUDA in bf16/fp16 (torch's fused kernel): the output and the gradients of x and the weight equal
    the float64 math within the dtype's rounding (output: one rounding, 2^-8 / 2^-11 relative to |y| plus a
    float32-reduction term; gradients: bf16/fp16 results of float32 sums, checked at 2^-7 / 2^-10 of the
    largest magnitude)."""
    from quarl.model.layers import RMSNorm

    norm = RMSNorm(dim, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(rows, dim) * torch.rand(rows, 1) * 4).to(dtype).to(DEVICE).requires_grad_(True)
    g = torch.randn(rows, dim).to(dtype).to(DEVICE)
    y = norm(x)
    y.backward(g)
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    y64.backward(g.double())
    eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert bool(((y.double() - y64).abs() <= eps * y64.abs() + 1e-3 * eps).all())
    for got, want in [(x.grad, x64.grad), (norm.weight.grad, w64.grad)]:
        err = float((got.double() - want).abs().max())
        assert err <= 2 * eps * float(want.abs().max()), (err, float(want.abs().max()))
