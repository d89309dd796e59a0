"""Export a trained model: a Hugging Face directory (LoRA merged) and, with LoRA, adapters in PEFT's format."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from quarl.model.qlinear import QuantLinear


def normal_modes(path: str | Path) -> None:
    """Give an export tree ordinary modes: 0o755 folders, 0o644 files (narrowed by the umask), not the 0o700 /
    0o600 that tempfile's mkdtemp/mkstemp leave."""
    from quarl.rl.checkpoint import current_umask

    umask = current_umask()
    root = Path(path)
    if not root.exists() or root.is_symlink():
        return
    if root.is_file():
        os.chmod(root, 0o644 & ~umask)
        return
    os.chmod(root, 0o755 & ~umask)
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            p = os.path.join(folder, d)
            if not os.path.islink(p):
                os.chmod(p, 0o755 & ~umask)
        for f in files:
            p = os.path.join(folder, f)
            if not os.path.islink(p):
                os.chmod(p, 0o644 & ~umask)


def check_export_target(out_dir: str | Path, overwrite: bool = False) -> Path:
    """Refuse (one-line ValueError) to export into an existing non-empty folder unless `overwrite`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export target {out} exists and is not a folder")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise ValueError(f"export target {out} is not empty: pass --overwrite to replace the export in it "
                         "(or choose another --out)")
    return out


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
    normal_modes(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def export_run(model, tokenizer, cfg, out_dir: str | Path, overwrite: bool = True) -> Path:
    """OUT/hf (merged model) and, with LoRA, OUT/adapter (PEFT).

    An existing non-empty OUT is refused unless `overwrite`, which replaces OUT/hf and OUT/adapter (other files in
    OUT are left alone). The default is True because the trainer re-exports into its own RUN_DIR/export (a fresh
    run moves an earlier run's folder aside); `quarl export` goes through `export_from_run`, whose default is False.
    """
    from quarl.model.loading import save_pretrained

    out = check_export_target(out_dir, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, tokenizer, out / "hf")
    normal_modes(out / "hf")
    if cfg.lora.enabled and not cfg.lora.train_norms:  # trained norms live only in the merged export
        export_peft_adapters(model, cfg.lora, cfg.model.name, out / "adapter")
    return out


def export_from_run(run_dir: str | Path, out_dir: str | Path | None = None, overwrite: bool = False) -> Path:
    """Rebuild a run's model from its config (model, UAQ, precision) and newest intact checkpoint, then export it
    to `out_dir` (default RUN_DIR/export). Needs neither the training data nor a rollout engine.

    A non-empty `out_dir` is refused (ValueError, before anything is loaded) unless `overwrite` (`--overwrite`),
    which replaces OUT/hf and OUT/adapter."""
    from quarl.config import load_config
    from quarl.devices import resolve_device
    from quarl.model.loading import load_model
    from quarl.model.precision_apply import apply_precision
    from quarl.rl.checkpoint import checkpoint_files, load_latest_intact
    from quarl.rl.uaq import apply_uaq

    run_dir = Path(run_dir)
    out = check_export_target(out_dir or run_dir / "export", overwrite)
    cfg = load_config(run_dir / "config.yaml")
    if not checkpoint_files(run_dir / "checkpoints"):
        raise FileNotFoundError(f"no checkpoint in {run_dir}/checkpoints to export")
    device = resolve_device(cfg.model.device)
    model, tokenizer = load_model(cfg.model.name, device=str(device), dtype=cfg.precision.torch_dtype(device),
                                  gguf_file=cfg.model.gguf_file, revision=cfg.model.revision)
    if cfg.uaq.scale != 1.0:
        apply_uaq(model, cfg.uaq.scale)
    apply_precision(model, cfg.precision)
    load_latest_intact(run_dir, model)  # weights only: no optimizer, RNG untouched
    return export_run(model, tokenizer, cfg, out, overwrite=overwrite)
