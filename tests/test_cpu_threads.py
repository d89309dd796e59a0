"""A CPU run sizes torch's thread pool to the cores it may use (affinity, container quota) unless OMP_NUM_THREADS
says otherwise."""

import os

import pytest
import torch

from quarl import devices
from quarl.config import load_config
from quarl.devices import available_cpus, set_cpu_threads


@pytest.fixture
def restore_threads(monkeypatch):
    n = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(devices, "CGROUP_CPU_MAX", "/nonexistent/cpu.max")
    monkeypatch.setattr(devices, "CGROUP_V1_CPU", "/nonexistent/cpu")
    yield
    torch.set_num_threads(n)


def cores(monkeypatch, n):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


def test_threads_follow_the_cores_this_process_may_use(monkeypatch, restore_threads):
    cores(monkeypatch, 1)
    torch.set_num_threads(2)
    assert set_cpu_threads(torch.device("cpu")) == 1 and torch.get_num_threads() == 1
    torch.set_num_threads(4)
    cores(monkeypatch, 2)
    assert set_cpu_threads("cpu") == 2 and torch.get_num_threads() == 2
    cores(monkeypatch, 8)  # more logical CPUs (hyperthreads) than torch's threads: never raised
    assert set_cpu_threads("cpu") == 2 and torch.get_num_threads() == 2


def test_omp_num_threads_and_gpu_runs_are_left_alone(monkeypatch, restore_threads):
    cores(monkeypatch, 1)
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert set_cpu_threads(torch.device("cpu")) is None and torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert set_cpu_threads(torch.device("cuda")) is None and torch.get_num_threads() == 2


@pytest.mark.parametrize("v2,v1,expected", [
    ("150000 100000\n", None, 2),   # --cpus=1.5: two threads, the second partly idle
    ("max 100000\n", None, 4),      # no quota: the affinity mask
    ("50000 100000\n", None, 1),
    (None, ("300000", "100000"), 3),
    (None, ("-1", "100000"), 4),
])
def test_a_container_cpu_quota_caps_the_count(tmp_path, monkeypatch, restore_threads, v2, v1, expected):
    cores(monkeypatch, 4)
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
        monkeypatch.setattr(devices, "CGROUP_CPU_MAX", str(tmp_path / "cpu.max"))
    if v1 is not None:
        (tmp_path / "cpu.cfs_quota_us").write_text(v1[0])
        (tmp_path / "cpu.cfs_period_us").write_text(v1[1])
        monkeypatch.setattr(devices, "CGROUP_V1_CPU", str(tmp_path))
    assert available_cpus() == expected


def test_the_trainer_sets_them_on_a_cpu_run(tmp_path, monkeypatch, restore_threads):
    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.tiny import tiny_config, tiny_tokenizer
    from quarl.rl.trainer import Trainer

    cores(monkeypatch, 1)
    torch.set_num_threads(2)
    cfg = load_config(None, ["model.device=cpu", f"output.dir={tmp_path / 'run'}", "data.num_train=8",
                             "data.num_eval=2"])
    Trainer(cfg, model=QuarlForCausalLM(tiny_config("llama")), tokenizer=tiny_tokenizer())
    assert torch.get_num_threads() == 1
