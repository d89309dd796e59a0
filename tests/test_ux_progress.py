"""Loading says what it loads and how long it took, on stderr, unless asked to be quiet."""

import torch

from quarl.model.decoder import QuarlForCausalLM
from quarl.model.loading import load_model, save_pretrained
from quarl.model.tiny import tiny_config, tiny_tokenizer


def test_load_model_says_what_it_loads(tmp_path, capsys):
    torch.manual_seed(0)
    save_pretrained(QuarlForCausalLM(tiny_config("qwen2")), tiny_tokenizer(), tmp_path / "m")
    capsys.readouterr()
    model, _ = load_model(str(tmp_path / "m"), dtype="bfloat16")
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert out.out == "" and len(lines) == 2
    assert lines[0] == f"[quarl] loading {tmp_path / 'm'} (Hugging Face checkpoint) on cpu in bfloat16 ..."
    params = sum(p.numel() for p in model.parameters())
    assert lines[1].startswith(f"[quarl] loaded {tmp_path / 'm'} ({params / 1e6:.2g}M parameters) in ")
    assert lines[1].endswith(" s")
    load_model(str(tmp_path / "m"), progress=False)
    assert capsys.readouterr().err == ""
