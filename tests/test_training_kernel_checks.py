"""First-use self-checks of the training kernels (`quarl.kernels.training_kernel_ok`): each kernel's probe passes
against its PyTorch definition (in the Triton interpreter, in fp16), fails for a wrong kernel, and
a failing or crashing probe makes the gate warn and keep the PyTorch path."""

import textwrap

import pytest
import torch

import quarl.kernels as kernels
from quarl.kernels import availability, capabilities
from interpreter import INTERPRETER_PATCH, run_in_interpreter

_CHECK = INTERPRETER_PATCH + textwrap.dedent("""
    import importlib
    from quarl.kernels import TRAINING_KERNELS
    for name, module in TRAINING_KERNELS.items():
        mod = importlib.import_module(module)
        assert mod.self_check(torch.device("cpu"), torch.float16), name
    # A wrong kernel fails its probe: the SiLU·mul backward without the silu derivative's second term.
    import quarl.kernels.silu_mul_train as sm
    real = sm.SiluMul.backward
    def wrong(ctx, dh):
        dgate, dup = real(ctx, dh)
        return dgate * 1.01, dup
    sm.SiluMul.backward = staticmethod(wrong)
    assert not sm.self_check(torch.device("cpu"), torch.float16)
    print("ok")
""")


def test_training_kernel_probes_pass_and_catch_a_wrong_kernel():
    run_in_interpreter(_CHECK)


def test_a_failing_probe_warns_and_keeps_torch(monkeypatch):
    pytest.importorskip("triton")
    import quarl.fallbacks
    import quarl.kernels.silu_mul_train

    monkeypatch.setattr(availability, "kernels_available", lambda device=None: True)
    monkeypatch.setattr(capabilities, "CAPABILITIES", capabilities.CapabilityRegistry())
    monkeypatch.setattr(quarl.fallbacks, "_reported", {})  # reported once per process: start afresh
    probes = []

    def crash(device, dtype):
        probes.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(quarl.kernels.silu_mul_train, "self_check", crash)
    with pytest.warns(UserWarning, match="training kernel silu_mul: failed its check"):
        assert not kernels.training_kernel_ok("silu_mul", torch.device("cpu"), torch.bfloat16)
    assert not kernels.training_kernel_ok("silu_mul", torch.device("cpu"), torch.bfloat16)
    assert probes == [1]  # the verdict is cached: one probe per kernel, device and dtype
    assert capabilities.CAPABILITIES.results() == {("training_kernel", ("silu_mul", "cpu", torch.bfloat16)): False}


def test_training_kernels_are_not_used_off_the_gpu(monkeypatch):
    monkeypatch.setattr(capabilities, "CAPABILITIES", capabilities.CapabilityRegistry())
    assert not kernels.training_kernel_ok("rope", torch.device("cpu"), torch.bfloat16)
