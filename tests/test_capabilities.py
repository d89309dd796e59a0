"""The registry of the kernels' first-use self-checks (`quarl.kernels.capabilities`): one probe per (name, key),
a failing probe reported once and remembered, a precondition that skips the probe, clear() and results()."""

import subprocess
import sys
import warnings

import pytest
import torch

import quarl.fallbacks as fallbacks
from quarl import kernels
from quarl.kernels import capabilities
from quarl.kernels.capabilities import CapabilityRegistry


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch):
    monkeypatch.setattr(fallbacks, "_reported", {})


def _counting(verdict, calls: list, tag):
    def probe():
        calls.append(tag)
        return verdict

    return probe


def test_a_probe_runs_once_per_key():
    reg, calls = CapabilityRegistry(), []
    for _ in range(3):
        assert reg.check("k", ("cpu", torch.bfloat16), _counting(True, calls, "bf16"))
        assert reg.check("k", ("cpu", torch.float16), _counting(True, calls, "fp16"))
    assert calls == ["bf16", "fp16"]
    assert reg.check("other", ("cpu", torch.bfloat16), _counting(True, calls, "other"))  # a name keys apart too
    assert calls == ["bf16", "fp16", "other"]


def test_a_raising_probe_gives_false_with_one_fallback_report():
    reg, calls = CapabilityRegistry(), []

    def crash():
        calls.append(1)
        raise RuntimeError("no compiler here\nmore traceback")

    with pytest.warns(UserWarning, match="the probe kernel: failed its check \\(RuntimeError: no compiler here\\)"):
        assert reg.check("probe", "cpu", crash, what="the probe kernel") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the cached verdict neither probes nor warns again
        assert reg.check("probe", "cpu", crash, what="the probe kernel") is False
    assert calls == [1]
    assert list(fallbacks.reported_fallbacks()) == ["the probe kernel"]


def test_a_disagreeing_probe_is_reported_under_its_name_without_what():
    reg = CapabilityRegistry()
    with pytest.warns(UserWarning, match="wrong: disagrees with its torch definition"):
        assert not reg.check("wrong", "cpu", lambda: False)
    assert fallbacks.reported_fallbacks() == {"wrong": "disagrees with its torch definition; using torch"}


def test_an_unmet_precondition_gives_false_without_probe_or_report():
    reg, calls, asked = CapabilityRegistry(), [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert not reg.check("k", "cpu", _counting(True, calls, "probe"), requires=lambda: asked.append(1))
    assert calls == [] and asked == [1]  # the precondition is part of the cached verdict
    assert fallbacks.reported_fallbacks() == {}
    assert reg.check("k", "cuda:0", _counting(True, calls, "probe"), requires=lambda: True)
    assert calls == ["probe"]


def test_clear_and_results():
    reg, calls = CapabilityRegistry(), []
    reg.check("a", 1, _counting(True, calls, "a1"))
    reg.check("a", 2, _counting(True, calls, "a2"))
    with pytest.warns(UserWarning, match="b: disagrees"):
        reg.check("b", 1, _counting(False, calls, "b1"))
    assert reg.results() == {("a", 1): True, ("a", 2): True, ("b", 1): False}
    reg.results()[("a", 1)] = False  # a copy: the registry is unchanged
    assert reg.check("a", 1, _counting(False, calls, "again")) is True
    reg.clear("a")
    assert reg.results() == {("b", 1): False}
    with pytest.warns(UserWarning, match="a: disagrees"):
        assert reg.check("a", 1, _counting(False, calls, "a1 again")) is False  # probed afresh
    reg.clear()
    assert reg.results() == {}
    assert reg.check("b", 1, _counting(True, calls, "b1 again"))
    assert calls == ["a1", "a2", "b1", "a1 again", "b1 again"]


def test_the_kernel_checks_share_the_one_registry(monkeypatch):
    """The fused decode, training and sampling gates all record their verdicts in `CAPABILITIES` (on the CPU: no
    kernels, False without a probe)."""
    from quarl.rollout import fast_step

    monkeypatch.setattr(capabilities, "CAPABILITIES", CapabilityRegistry())
    cpu = torch.device("cpu")
    assert not kernels.decode_fused_ok(cpu, torch.bfloat16)
    assert not kernels.decode_fused_group_ok(cpu)
    assert not kernels.decode_fused_scaled_ok(cpu, torch.bfloat16)
    assert not kernels.training_kernel_ok("rope", cpu, torch.bfloat16)
    assert not fast_step._sampling_kernel_ok(cpu, torch.float32)
    assert not fast_step._cdf_kernel_ok(cpu, torch.float32)
    assert capabilities.CAPABILITIES.results() == {
        ("decode_fused", ("cpu", torch.bfloat16)): False, ("decode_fused_group", "cpu"): False,
        ("decode_fused_scaled", ("cpu", torch.bfloat16)): False,
        ("training_kernel", ("rope", "cpu", torch.bfloat16)): False,
        ("sampling", ("cpu", torch.float32)): False, ("sampling_cdf", ("cpu", torch.float32)): False}


def test_the_sampler_probe_gets_seeded_logits_once(monkeypatch):
    """`fast_step._sampler_ok` hands its check seeded logits [64, 3001] in the asked dtype and uniforms [64, 3001],
    once per (device, dtype)."""
    from quarl.rollout import fast_step

    monkeypatch.setattr(capabilities, "CAPABILITIES", CapabilityRegistry())
    monkeypatch.setattr(kernels, "kernels_available", lambda device=None: True)
    seen = []

    def check(logits, uniforms):
        seen.append((logits, uniforms))
        return True

    for _ in range(2):
        assert fast_step._sampler_ok("sampling", torch.device("cpu"), torch.bfloat16, "the sampler", check)
    assert fast_step._sampler_ok("sampling", torch.device("cpu"), torch.float32, "the sampler", check)
    assert [(x.shape, x.dtype, u.shape, u.dtype) for x, u in seen] == [
        ((64, 3001), torch.bfloat16, (64, 3001), torch.float32), ((64, 3001), torch.float32, (64, 3001), torch.float32)]
    (bf16, u0), (f32, u1) = seen
    assert torch.equal(bf16, f32.bfloat16()) and torch.equal(u0, u1)  # the same seeded draws


def test_importing_the_kernels_never_imports_triton():
    code = ("import sys; import quarl.kernels, quarl.rollout.fast_step, quarl.rollout.fused_decode; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_device_capability_is_asked_once_per_device_and_again_when_patched(monkeypatch):
    from quarl.kernels import availability

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    for _ in range(3):
        assert availability.capability(torch.device("cuda", 0)) == (9, 0)
    assert asked == [torch.device("cuda", 0)]  # cached per device index
    availability.capability(None)
    availability.capability("cuda")
    assert len(asked) == 3  # the current device is asked every time
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert availability.capability("cuda:0") == (8, 0)  # a patched torch function gets its own answers
