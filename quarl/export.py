"""Export a trained model: a Hugging Face directory (LoRA merged) and, with LoRA, adapters in PEFT's format."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from quarl.model.qlinear import QuantLinear


def lora_layers(model: torch.nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, QuantLinear) and getattr(m, "lora_A", None) is not None}


def export_peft_adapters(model: torch.nn.Module, lora_cfg, base_model: str, out_dir: str | Path) -> Path:
    """Write adapter_config.json + adapter_model.safetensors so `peft.PeftModel.from_pretrained` loads them.

    Keys follow PEFT's layout: base_model.model.<module path>.lora_A.weight [r, in] / lora_B.weight [out, r].
    With the qlora flow the adapters were trained against the quantized base; apply them to a base dequantized the
    same way for identical outputs (the merged Hugging Face export already contains that base).
    """
    from safetensors.torch import save_file

    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters to export (lora.rank is 0)")
    if lora_cfg.train_norms:
        raise ValueError(
            "lora.train_norms=true trained the RMSNorm weights too, which PEFT LoRA adapters cannot carry; "
            "use the merged Hugging Face export (RUN_DIR/export/hf) instead"
        )
    tensors = {}
    for name, layer in layers.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = layer.lora_A.detach().float().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = layer.lora_B.detach().float().cpu().contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora_cfg.rank,
        "lora_alpha": lora_cfg.alpha if lora_cfg.alpha is not None else lora_cfg.rank,
        "lora_dropout": lora_cfg.dropout,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in layers}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    out = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None, prefix=".adapter-"))
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def export_run(model, tokenizer, cfg, out_dir: str | Path) -> Path:
    """RUN_DIR/export/hf (merged model) and, with LoRA, RUN_DIR/export/adapter (PEFT)."""
    from quarl.model.loading import save_pretrained

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, tokenizer, out / "hf")
    if cfg.lora.enabled and not cfg.lora.train_norms:  # trained norms live only in the merged export
        export_peft_adapters(model, cfg.lora, cfg.model.name, out / "adapter")
    return out


def export_from_run(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Rebuild a run's model from its config (model, UAQ, precision) and latest checkpoint, then export it.
    Needs neither the training data nor a rollout engine."""
    from quarl.config import load_config
    from quarl.devices import resolve_device
    from quarl.model.loading import load_model
    from quarl.model.precision_apply import apply_precision
    from quarl.rl.checkpoint import latest_checkpoint, load_checkpoint
    from quarl.rl.uaq import apply_uaq

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {run_dir}/checkpoints to export")
    device = resolve_device(cfg.model.device)
    model, tokenizer = load_model(cfg.model.name, device=str(device), dtype=cfg.precision.torch_dtype(device),
                                  gguf_file=cfg.model.gguf_file, revision=cfg.model.revision)
    if cfg.uaq.scale != 1.0:
        apply_uaq(model, cfg.uaq.scale)
    apply_precision(model, cfg.precision)
    load_checkpoint(ckpt, model)  # weights only: no optimizer, RNG untouched
    return export_run(model, tokenizer, cfg, out_dir or run_dir / "export")
