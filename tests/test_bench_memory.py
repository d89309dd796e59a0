"""`quarl bench memory` (B4): size list, parameter counts, outcome classification, and one tiny run end to end
(a real subprocess running `quarl bench step` in the qlora flow on the CPU)."""

import argparse

import pytest
import torch

from quarl.bench.memory import add_bench_memory_arguments, classify, parse_sizes, run_bench_memory, step_command
from quarl.bench.rollout import MODEL_SIZES, model_config, parameter_count
from quarl.model.decoder import QuarlForCausalLM

TINY = ["--sizes", "tiny", "--device", "cpu", "--prompts", "2", "--samples", "2", "--prompt-len", "6",
        "--max-new-tokens", "5", "--lora-rank", "4", "--micro-batch-size", "2"]


def parse(*extra):
    parser = argparse.ArgumentParser()
    add_bench_memory_arguments(parser)
    return parser.parse_args([*TINY, *extra])


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_parameter_count_equals_the_built_architecture(size, monkeypatch):
    if MODEL_SIZES[size].get("num_experts"):  # 48 layers x 128 experts take ~10 s to build even on meta: the same
        # shapes with 3 layers (the middle one dense) and 16 experts exercise every term of the count
        monkeypatch.setitem(MODEL_SIZES, size, {**MODEL_SIZES[size], "num_layers": 3, "num_experts": 16,
                                                "mlp_only_layers": [1]})
    with torch.device("meta"):  # shapes only, no memory
        model = QuarlForCausalLM(model_config(size), init_std=None)
    assert parameter_count(size) == sum(p.numel() for p in model.parameters())  # a tied weight counts once


def test_sizes_and_the_step_command():
    assert parse_sizes("72b, 32b,tiny") == ["72b", "32b", "tiny"]
    assert parse_sizes("tiny,7b,72b,7b") == ["72b", "7b", "tiny"]  # largest first, once each
    with pytest.raises(ValueError, match="choose from"):
        parse_sizes("70b")
    cmd = step_command(parse("--set", "train.lr=1e-5"), "32b", "/tmp/x.json")
    text = " ".join(cmd)
    assert "--model-size 32b" in text and "--settings qlora:nvfp4" in text and "--json /tmp/x.json" in text
    assert "train.gradient_checkpointing=true" in text and "train.micro_batch_size=2" in text
    assert cmd.index("train.lr=1e-5") > cmd.index("train.micro_batch_size=2")  # the user's override wins
    assert "train.gradient_checkpointing=false" in " ".join(step_command(parse("--no-gradient-checkpointing"),
                                                                           "7b", "/tmp/x.json"))


def test_outcomes_are_classified():
    assert classify(0, [dict(step_s=3.0, peak_gib=50.0)], "")[0] == "ok"
    oom = dict(error="error: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert classify(0, [oom], "")[0] == "out of memory"
    assert classify(1, [], "torch.OutOfMemoryError: CUDA out of memory.\n")[0] == "out of memory"
    assert classify(None, [], "still running")[0] == "error: stopped at the time budget"
    outcome, _ = classify(1, [], "Traceback ...\nRuntimeError: boom\n")
    assert outcome == "error: RuntimeError: boom"
    assert classify(0, [dict(error="error: RuntimeError: boom")], "tail\n")[0] == "error: RuntimeError: boom"


@pytest.mark.parametrize("script,timeout,expected", [
    ("import time; time.sleep(30)", 1.0, "error: stopped at the time budget"),  # silent: stopped anyway
    ("import sys; print('working', flush=True); sys.exit('RuntimeError: boom')", 20.0, "error: RuntimeError: boom"),
])
def test_a_child_is_stopped_at_the_budget_and_its_own_error_is_kept(monkeypatch, script, timeout, expected):
    import sys
    import time

    import quarl.bench.memory as memory

    monkeypatch.setattr(memory, "step_command", lambda args, size, path: [sys.executable, "-c", script])
    t0 = time.perf_counter()
    row = memory.run_size(parse(), "tiny", timeout)
    assert row["outcome"] == expected
    assert time.perf_counter() - t0 < 15


@pytest.mark.usefixtures("one_thread")
def test_tiny_qlora_step_runs_in_a_subprocess_and_is_recorded(tmp_path, capsys):
    out = tmp_path / "memory.md"
    assert run_bench_memory(parse("--out", str(out))) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| tiny |"))
    assert "| ok |" in row, printed[-3000:]
    text = out.read_text()
    assert text.startswith("# B4") and "| tiny |" in text and "qlora flow, nvfp4 frozen base" in text
    assert "largest model whose qlora step ran: tiny" in text
