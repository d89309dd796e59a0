"""mismatch_metrics and entropy_from_logits against float64 references on fresh random inputs."""

import math

import pytest
import torch

from quarl.rl.mismatch import MISMATCH_KEYS, entropy_from_logits, mismatch_metrics


def test_mismatch_metrics_match_float64_reference():
    prox = torch.log_softmax(torch.randn(6, 10, 50), -1)[..., 0]  # realistic log-probs
    beh = prox + torch.randn(6, 10) * 0.05
    mask = torch.rand(6, 10) > 0.3
    mask[0] = False
    got = mismatch_metrics(beh, prox, mask)
    assert set(got) == set(MISMATCH_KEYS) and all(isinstance(v, float) for v in got.values())
    d = [b - p for b, p, m in zip(beh.double().flatten().tolist(), prox.double().flatten().tolist(),
                                  mask.flatten().tolist()) if m]
    pairs = [(math.exp(b), math.exp(p)) for b, p, m in zip(beh.double().flatten().tolist(),
                                                             prox.double().flatten().tolist(),
                                                             mask.flatten().tolist()) if m]
    n = len(d)
    assert got["mismatch/kl"] == pytest.approx(sum(d) / n, rel=1e-9, abs=1e-12)
    assert got["mismatch/k3_kl"] == pytest.approx(sum(math.exp(-x) + x - 1 for x in d) / n, rel=1e-7)
    assert got["mismatch/max_abs_logp_diff"] == pytest.approx(max(abs(x) for x in d), rel=1e-12)
    assert got["mismatch/prob_diff_mean"] == pytest.approx(sum(abs(a - b) for a, b in pairs) / n, rel=1e-9)


def test_k3_keeps_its_digits_for_tiny_differences():
    # d = 1e-4 everywhere: k3 = exp(−d) + d − 1 ≈ d²/2 = 5e-9 (float32 arithmetic would return ~0 or noise)
    prox = torch.full((2, 3), -1.0, dtype=torch.float64)
    beh = prox + 1e-4
    got = mismatch_metrics(beh, prox, torch.ones(2, 3, dtype=torch.bool))
    assert got["mismatch/k3_kl"] == pytest.approx(math.expm1(-1e-4) + 1e-4, rel=1e-9)
    assert got["mismatch/kl"] == pytest.approx(1e-4, rel=1e-9)


def test_mismatch_ignores_padding_and_handles_empty_mask():
    prox = torch.tensor([[-1.0, float("nan")]])
    beh = torch.tensor([[-1.5, float("-inf")]])
    got = mismatch_metrics(beh, prox, torch.tensor([[1.0, 0.0]]))
    assert got["mismatch/kl"] == pytest.approx(-0.5) and got["mismatch/max_abs_logp_diff"] == pytest.approx(0.5)
    assert mismatch_metrics(beh, prox, torch.zeros(1, 2)) == {k: 0.0 for k in MISMATCH_KEYS}
    with pytest.raises(ValueError, match="share one shape"):
        mismatch_metrics(beh, prox, torch.zeros(1, 3))


def _reference_entropy(logits):
    out = []
    for row in logits.double().reshape(-1, logits.shape[-1]).tolist():
        finite = [x for x in row if x != float("-inf")]
        mx = max(finite)
        z = sum(math.exp(x - mx) for x in finite)
        ps = [math.exp(x - mx) / z for x in finite]
        out.append(-sum(p * math.log(p) for p in ps if p > 0))
    return torch.tensor(out, dtype=torch.float64).reshape(logits.shape[:-1])


def test_entropy_matches_float64_reference():
    logits = torch.randn(3, 4, 37) * 4
    logits[0, 0, 5:] = float("-inf")  # top-k style
    logits[1, 1] += 1e4  # large logits must not overflow
    got = entropy_from_logits(logits)
    assert got.shape == (3, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference_entropy(logits), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy_from_logits(logits.bfloat16()).double(),
                               _reference_entropy(logits.bfloat16().float()), rtol=1e-5, atol=1e-5)
    # uniform over V → log V; one-hot → 0
    assert entropy_from_logits(torch.zeros(10)).item() == pytest.approx(math.log(10), rel=1e-6)
    one_hot = torch.full((10,), float("-inf"))
    one_hot[3] = 0.0
    assert entropy_from_logits(one_hot).item() == 0.0


def test_entropy_gradient_matches_float64_autograd_and_is_finite_with_masked_vocab():
    logits = torch.randn(5, 11, dtype=torch.float64)
    logits[0, 4:] = float("-inf")
    x = logits.clone().requires_grad_(True)
    entropy_from_logits(x).sum().backward()
    # reference: H = logsumexp(x) − Σ p·x over the finite entries only
    y = logits.clone().requires_grad_(True)
    finite = torch.isfinite(y)
    ys = torch.where(finite, y, torch.full_like(y, -1e300))
    p = torch.softmax(ys, -1)
    h = torch.logsumexp(ys, -1) - (p * torch.where(finite, y, torch.zeros_like(y))).sum(-1)
    h.sum().backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad, torch.where(finite, y.grad, torch.zeros_like(y.grad)), rtol=1e-9, atol=1e-12)


def test_entropy_rejects_empty_vocab():
    with pytest.raises(ValueError, match="V > 0"):
        entropy_from_logits(torch.zeros(2, 0))


@pytest.mark.gpu
def test_cuda_matches_float64_reference():
    prox = torch.log_softmax(torch.randn(16, 40, 30), -1)[..., 0]
    beh = prox + torch.randn(16, 40) * 0.02
    mask = torch.rand(16, 40) > 0.3
    want = mismatch_metrics(beh.double(), prox.double(), mask)
    got = mismatch_metrics(beh.cuda(), prox.cuda(), mask.cuda())
    for k in MISMATCH_KEYS:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-12), k
    logits = torch.randn(4, 8, 1000) * 3
    logits[0, 0, 10:] = float("-inf")
    x = logits.cuda().bfloat16().requires_grad_(True)
    h = entropy_from_logits(x)
    h.sum().backward()
    assert h.dtype == torch.float32 and torch.isfinite(x.grad.float()).all()
    torch.testing.assert_close(h.double().cpu(), _reference_entropy(logits.bfloat16().float()), rtol=1e-4, atol=1e-4)
