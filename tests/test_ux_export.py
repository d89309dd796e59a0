"""`quarl export`: bf16 by default (float32 on request), generation_config.json, ordinary file modes, and PEFT
adapters whose base_model_name_or_path is a checkpoint that transformers and PEFT load."""

import json
import os
import shutil
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


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished two-step LoRA run of the tiny llama, and a saved Hugging Face copy of its base."""
    root = tmp_path_factory.mktemp("export")
    trainer = make_trainer(make_cfg(root, "lora.rank=4", "lora.alpha=8"))
    trainer.train()
    base = root / "base"
    torch.manual_seed(0)  # the base make_trainer built
    save_pretrained(QuarlForCausalLM(tiny_config("llama")), tiny_tokenizer(), base)
    return root / "run", base


def _run_on(lora_run, tmp_path, model_name: str) -> Path:
    """A copy of the run whose config names `model_name` as its model."""
    run, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("export", ".quarl.lock"))
    cfg = copy / "config.yaml"
    cfg.write_text(cfg.read_text().replace("smollm2-135m-instruct", model_name))
    return copy


def _peft_vs_merged(export: Path, dtype=torch.float32):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_cfg = json.loads((export / "adapter" / "adapter_config.json").read_text())
    base_path = adapter_cfg["base_model_name_or_path"]
    assert Path(base_path).is_dir() and (Path(base_path) / "config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits  # before PEFT injects the adapters into `base`
        peft = PeftModel.from_pretrained(base, str(export / "adapter"))
        merged = AutoModelForCausalLM.from_pretrained(export / "hf", dtype=dtype)
        return peft(input_ids=ids).logits, merged(input_ids=ids).logits, base_path, base_logits


def test_default_export_is_bf16_with_generation_config_and_loads(lora_run, tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    run = _run_on(lora_run, tmp_path, str(lora_run[1]))
    assert main(["export", str(run)]) == 0
    err = capsys.readouterr().err
    assert "[quarl] loading" in err and "writing the merged model" in err and "(bfloat16)" in err
    hf = run / "export" / "hf"
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.dtype == torch.bfloat16
    gen = GenerationConfig.from_pretrained(hf)
    eos = tiny_tokenizer().eos_token_id
    assert gen.eos_token_id == eos or eos in gen.eos_token_id
    # a local Hugging Face base is referenced, not copied
    adapter_cfg = json.loads((run / "export" / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(lora_run[1].absolute())
    assert not (run / "export" / "base").exists()


def test_float32_export_peft_on_the_referenced_base_equals_the_merged_model(lora_run, tmp_path):
    run = _run_on(lora_run, tmp_path, str(lora_run[1]))
    assert main(["export", str(run), "--dtype", "float32", "--quiet"]) == 0
    peft_logits, merged_logits, base_path, base_logits = _peft_vs_merged(run / "export")
    assert base_path == str(lora_run[1].absolute())
    torch.testing.assert_close(peft_logits, merged_logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(base_logits, merged_logits, atol=1e-4)  # the adapters change the outputs


def test_a_built_in_base_is_exported_beside_the_adapters(lora_run, tmp_path):
    run = _run_on(lora_run, tmp_path, "tiny-random-llama")
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--dtype", "float32", "--quiet"]) == 0
    peft_logits, merged_logits, base_path, _ = _peft_vs_merged(out)
    assert base_path == str((out / "base").absolute())
    torch.testing.assert_close(peft_logits, merged_logits, atol=1e-4, rtol=1e-4)
    # re-exporting onto a local base removes the now unneeded copy
    run2 = _run_on(lora_run, tmp_path / "again", str(lora_run[1]))
    assert main(["export", str(run2), "--out", str(out), "--overwrite", "--quiet"]) == 0
    assert not (out / "base").exists()


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_export_has_ordinary_modes(lora_run, tmp_path, umask, file_mode, dir_mode):
    run = _run_on(lora_run, tmp_path, "tiny-random-llama")
    old = os.umask(umask)
    try:
        assert main(["export", str(run), "--quiet"]) == 0
    finally:
        os.umask(old)
    export = run / "export"
    paths = [p for p in export.rglob("*")]
    assert {"model.safetensors", "adapter_model.safetensors", "generation_config.json"} <= {p.name for p in paths}
    for p in [export, *paths]:
        mode = p.stat().st_mode & 0o777
        assert mode == (dir_mode if p.is_dir() else file_mode), f"{p} has mode {oct(mode)}"


def test_bad_dtype_and_missing_run_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path), "--dtype", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "config.yaml not found" in err and len(err.strip().splitlines()) == 1
