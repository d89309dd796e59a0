"""The command line: eval on a saved model, plot and export of a finished run, generate."""

import json
import sys
from pathlib import Path

import pytest
import torch

from quarl.cli import main
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.loading import save_pretrained
from quarl.model.tiny import tiny_config, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import make_cfg, make_trainer  # noqa: E402


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """`quarl eval` saves its result under ./runs/eval by default: keep that out of the source tree."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny") / "model"
    save_pretrained(QuarlForCausalLM(tiny_config("qwen2")), tiny_tokenizer(), out)
    return out


def test_eval_reports_accuracy_avg_and_pass(tiny_dir, capsys):
    rc = main(["eval", "--model", str(tiny_dir), "--data", "arithmetic", "--limit", "4", "--n", "2",
               "--temperature", "1.0", "--max-new-tokens", "4", "--precision", "int8", "--device", "cpu"])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])
    assert result["num_examples"] == 4.0 and result["precision"] == "int8"
    for key in ("accuracy", "avg@2", "pass@2"):
        assert 0.0 <= result[key] <= 1.0
    assert result["pass@2"] >= result["avg@2"]


@pytest.mark.parametrize("engine,kv", [("fast", "auto"), ("auto", "fp8-token")])
def test_eval_on_the_fast_engine_and_an_fp8_kv_cache(tiny_dir, capsys, engine, kv):
    rc = main(["eval", "--model", str(tiny_dir), "--data", "arithmetic", "--limit", "3", "--n", "2",
               "--temperature", "1.0", "--max-new-tokens", "4", "--device", "cpu", "--engine", engine,
               "--kv-cache", kv])
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])
    assert result["engine"] == "FastRolloutEngine" and result["kv_cache"] == kv and result["num_examples"] == 3.0


def test_an_fp8_kv_cache_needs_the_fast_engine(tiny_dir, capsys):
    rc = main(["eval", "--model", str(tiny_dir), "--data", "arithmetic", "--limit", "2", "--device", "cpu",
               "--engine", "reference", "--kv-cache", "fp8"])
    assert rc == 2 and "--engine fast" in capsys.readouterr().err


def test_eval_rejects_greedy_with_several_samples(tiny_dir, capsys):
    rc = main(["eval", "--model", str(tiny_dir), "--data", "arithmetic", "--limit", "2", "--n", "3",
               "--device", "cpu"])
    assert rc == 2 and "temperature > 0" in capsys.readouterr().err


def test_plot_and_export_of_a_lora_run(tmp_path):
    pytest.importorskip("matplotlib")
    from transformers import AutoModelForCausalLM

    cfg = make_cfg(tmp_path, "lora.rank=4")
    trainer = make_trainer(cfg)
    trainer.train()
    run = tmp_path / "run"
    assert main(["plot", str(run)]) == 0
    assert (run / "plots" / "overview.png").stat().st_size > 10_000
    assert "mean reward" in (run / "plots" / "summary.md").read_text()
    # export rebuilds the model from the run's config + checkpoint: use the tiny model through a saved base
    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    save_pretrained(QuarlForCausalLM(tiny_config("llama")), tiny_tokenizer(), base_dir)
    cfg_path = run / "config.yaml"
    cfg_path.write_text(cfg_path.read_text().replace("smollm2-135m-instruct", str(base_dir)))
    assert main(["export", str(run), "--dtype", "float32"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(run / "export" / "hf", dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 9))
    trainer.model.eval()
    torch.testing.assert_close(hf(input_ids=ids).logits, trainer.model(ids).float(), atol=2e-4, rtol=1e-4)
    assert (run / "export" / "adapter" / "adapter_config.json").is_file()


def test_plot_needs_a_run_dir(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_eval_takes_the_fast_engines_sampler(tiny_dir, capsys):
    """--sampler reaches the fast engine and is reported; the reference engine refuses it with the way out."""
    rc = main(["eval", "--model", str(tiny_dir), "--data", "arithmetic", "--limit", "2", "--n", "2",
               "--temperature", "1.0", "--max-new-tokens", "3", "--device", "cpu", "--engine", "fast",
               "--sampler", "gumbel"])
    assert rc == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["sampler"] == "gumbel"
    rc = main(["eval", "--model", str(tiny_dir), "--data", "arithmetic", "--limit", "2", "--device", "cpu",
               "--engine", "reference", "--sampler", "inverse-cdf"])
    assert rc == 2 and "--engine fast" in capsys.readouterr().err


def test_an_override_in_the_config_place_is_an_override():
    from quarl.config import config_and_overrides

    assert config_and_overrides("train.steps=3", ["seed=1"]) == (None, ["train.steps=3", "seed=1"])
    assert config_and_overrides("configs/demo.yaml", ["train.steps=3"]) == ("configs/demo.yaml", ["train.steps=3"])
    assert config_and_overrides("a=b.yaml", []) == ("a=b.yaml", [])  # a YAML file whose name holds "="
    assert config_and_overrides(None, []) == (None, [])
