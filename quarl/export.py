"""Export a trained model: a Hugging Face directory (LoRA merged) and, with LoRA, adapters in PEFT's format.

Layout of OUT (default RUN_DIR/export):
  OUT/hf       the merged model: config.json, model.safetensors, generation_config.json, tokenizer files;
  OUT/adapter  (LoRA) adapter_config.json + adapter_model.safetensors for `peft.PeftModel.from_pretrained`;
  OUT/base     (LoRA, when the base is not a Hugging Face checkpoint PEFT can load by itself: a GGUF file, a
               built-in model, or a qlora base quantized during training) the base the adapters apply to.
The adapter's base_model_name_or_path is a path or hub id that transformers loads: the original Hugging Face
directory (absolute path) or hub id, or OUT/base (absolute path).

Weights are written in bfloat16 unless another dtype is asked for (`quarl export --dtype float32`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from quarl.model.qlinear import QuantLinear

EXPORT_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def export_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """The torch dtype of an export dtype name (bf16 | fp16 | fp32 and their long names); None -> bfloat16."""
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in EXPORT_DTYPES.values():
        return dtype
    found = EXPORT_DTYPES.get(str(dtype).lower().replace("torch.", ""))
    if found is None:
        raise ValueError(f"export dtype {dtype!r} is not supported; choose bfloat16 (default), float16 or float32")
    return found


def _say(verbose: bool, message: str) -> None:
    if verbose:
        print(f"[quarl] {message}", file=sys.stderr, flush=True)


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


def hf_state_dict(model: torch.nn.Module, dtype: torch.dtype, merged: bool = True) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors of `model` in `dtype`: LoRA merged, or (merged=False) the base the adapters apply
    to (the master weight, or the dequantized quantized base of a qlora layer)."""
    from quarl.model.loading import export_state_dict

    tensors = export_state_dict(model)
    if not merged:
        for name, layer in lora_layers(model).items():
            if f"{name}.weight" in tensors:
                tensors[f"{name}.weight"] = layer.base_weight(torch.float32).detach().cpu()
    return {k: v.to(dtype).contiguous() for k, v in tensors.items()}


def generation_config(model_config, tokenizer, source: str | None = None) -> dict:
    """generation_config.json of an export: the source checkpoint's own file when it has one (its sampling
    defaults), else the special tokens of the model and tokenizer (so that `generate` stops at the end of a turn)."""
    if source and os.path.isfile(os.path.join(source, "generation_config.json")):
        with open(os.path.join(source, "generation_config.json")) as f:
            return json.load(f)
    eos = list(model_config.eos_token_ids or [])
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int) and tok_eos not in eos:
        eos.append(tok_eos)
    config: dict = {"_from_model_config": True}
    if model_config.bos_token_id is not None:
        config["bos_token_id"] = model_config.bos_token_id
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = getattr(tokenizer, "pad_token_id", None)
    if isinstance(pad, int):
        config["pad_token_id"] = pad
    return config


def write_hf_directory(model, tokenizer, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                       merged: bool = True, source: str | None = None) -> Path:
    """A Hugging Face checkpoint of `model` in `dtype` (config.json, model.safetensors, generation_config.json,
    tokenizer files), written under a temporary name and renamed into place (an existing folder is replaced), with
    ordinary file modes. `source`: the original checkpoint directory, whose generation_config.json is kept."""
    from safetensors.torch import save_file

    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        dtype_name = str(dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(model.config.to_hf_dict(torch_dtype=dtype_name), indent=2))
        save_file(hf_state_dict(model, dtype, merged), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "generation_config.json").write_text(
            json.dumps(generation_config(model.config, tokenizer, source), indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        normal_modes(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def loadable_base(cfg) -> str | None:
    """The checkpoint PEFT should load as the adapters' base, when the run's model is one transformers loads by
    itself and training left it unchanged: a local Hugging Face directory (absolute path) or a hub id. None when the
    base must be exported: a GGUF file, a built-in model, a qlora base (the adapters were trained against its
    quantized weights), a UAQ-rescaled one."""
    from quarl.model.loading import SMOLLM2_NAME, TINY_RANDOM_MODELS, _looks_like_path

    name = str(cfg.model.name)
    if cfg.precision.flow == "qlora" or getattr(cfg.uaq, "scale", 1.0) != 1.0 or cfg.model.gguf_file:
        return None
    if name.lower() == SMOLLM2_NAME or name.lower() in TINY_RANDOM_MODELS:
        return None
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return os.path.abspath(path) if os.path.isfile(os.path.join(path, "config.json")) else None
    if os.path.exists(path) or _looks_like_path(name):
        return None
    return name  # a hub id


def export_peft_adapters(model: torch.nn.Module, lora_cfg, base_model: str, out_dir: str | Path,
                         revision: str | None = None) -> Path:
    """Write adapter_config.json + adapter_model.safetensors so `peft.PeftModel.from_pretrained` loads them.

    Keys follow PEFT's layout: base_model.model.<module path>.lora_A.weight [r, in] / lora_B.weight [out, r].
    `base_model` is written as base_model_name_or_path: a directory or hub id that transformers loads (see
    `export_run`). With the qlora flow the adapters were trained against the quantized base; apply them to that
    base dequantized (what `export_run` writes to OUT/base) for identical outputs.
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
        "revision": revision,
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


def export_run(model, tokenizer, cfg, out_dir: str | Path, overwrite: bool = True,
               dtype: torch.dtype | str | None = None, verbose: bool = True) -> Path:
    """OUT/hf (merged model) and, with LoRA, OUT/adapter (PEFT) plus OUT/base when the base needs exporting (see
    `loadable_base`). Weights in `dtype` (default bfloat16); progress lines on stderr unless not `verbose`.

    An existing non-empty OUT is refused unless `overwrite`, which replaces OUT/hf, OUT/adapter and OUT/base (other
    files in OUT are left alone). The default is True because the trainer re-exports into its own RUN_DIR/export (a
    fresh run moves an earlier run's folder aside); `quarl export` goes through `export_from_run`, whose default is
    False.
    """
    dtype = export_dtype(dtype)
    dtype_name = str(dtype).replace("torch.", "")
    out = check_export_target(out_dir, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    source = loadable_base(cfg)
    source_dir = source if source is not None and os.path.isdir(source) else None
    _say(verbose, f"writing the merged model to {out / 'hf'} ({dtype_name})")
    write_hf_directory(model, tokenizer, out / "hf", dtype, merged=True, source=source_dir)
    if cfg.lora.enabled and not cfg.lora.train_norms:  # trained norms live only in the merged export
        if source is None:
            _say(verbose, f"writing the adapters' base model to {out / 'base'} ({dtype_name})")
            source = str(write_hf_directory(model, tokenizer, out / "base", dtype, merged=False))
        elif (out / "base").exists():
            shutil.rmtree(out / "base")  # an earlier export's base; the adapters now name `source`
        _say(verbose, f"writing the PEFT adapters to {out / 'adapter'} (base: {source})")
        export_peft_adapters(model, cfg.lora, source, out / "adapter",
                             revision=cfg.model.revision if not os.path.isdir(source) else None)
    return out


def export_from_run(run_dir: str | Path, out_dir: str | Path | None = None, overwrite: bool = False,
                    dtype: torch.dtype | str | None = None, verbose: bool = True) -> Path:
    """Rebuild a run's model from its config (model, UAQ, precision) and newest intact checkpoint, then export it
    to `out_dir` (default RUN_DIR/export) in `dtype` (default bfloat16). Needs neither the training data nor a
    rollout engine. Says what it is doing on stderr unless not `verbose`.

    A non-empty `out_dir` is refused (ValueError, before anything is loaded) unless `overwrite` (`--overwrite`),
    which replaces OUT/hf, OUT/adapter and OUT/base."""
    from quarl.config import load_config
    from quarl.devices import resolve_device, set_cpu_threads
    from quarl.model.gptq import load_run_base
    from quarl.model.loading import load_model
    from quarl.model.precision_apply import apply_precision
    from quarl.rl.checkpoint import checkpoint_files, load_latest_intact
    from quarl.rl.uaq import apply_uaq

    run_dir = Path(run_dir)
    dtype = export_dtype(dtype)
    out = check_export_target(out_dir or run_dir / "export", overwrite)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}/config.yaml not found: is {run_dir} a quarl run directory?")
    cfg = load_config(run_dir / "config.yaml")
    if not checkpoint_files(run_dir / "checkpoints"):
        if any((run_dir / "checkpoints").glob("step_*.dcp")):
            raise FileNotFoundError(
                f"{run_dir}/checkpoints holds only sharded checkpoints (a torchrun run), which `quarl export` does not "
                "read: resume the run under torchrun with output.export_hf=true (`quarl train --nproc N CONFIG "
                "resume=RUN_DIR output.export_hf=true`), which gathers the weights into RUN_DIR/export")
        raise FileNotFoundError(f"no checkpoint in {run_dir}/checkpoints to export")
    device = resolve_device(cfg.model.device)
    set_cpu_threads(device)
    model, tokenizer = load_model(cfg.model.name, device=str(device), dtype=cfg.precision.torch_dtype(device),
                                  gguf_file=cfg.model.gguf_file, revision=cfg.model.revision, progress=verbose)
    if cfg.uaq.scale != 1.0:
        apply_uaq(model, cfg.uaq.scale)
    # the run's linears as trained; batch invariance only changes which kernels multiply, and export multiplies none
    apply_precision(model, replace(cfg.precision, batch_invariant=False))
    load_run_base(model, run_dir)  # a qlora run's GPTQ base, which its adapters were trained against
    _say(verbose, f"loading the newest intact checkpoint of {run_dir}")
    state, ckpt = load_latest_intact(run_dir, model)  # weights only: no optimizer, RNG untouched
    _say(verbose, f"exporting {ckpt} (step {state.get('step', '?')})")
    return export_run(model, tokenizer, cfg, out, overwrite=overwrite, dtype=dtype, verbose=verbose)
