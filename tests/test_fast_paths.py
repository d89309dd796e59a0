"""The `fast_paths` config section (`quarl.fast_paths.FastPaths`): parsed and saved with a run, and passed to every
piece of code that reads one of its switches (spied on here, on the CPU, where the GPU paths themselves never
run: what is checked is the value each reader receives)."""

import dataclasses

import pytest
import torch
import yaml

from quarl.config import ConfigError, config_to_dict, load_config
from quarl.fast_paths import FastPaths
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.tiny import tiny_config, tiny_tokenizer
from quarl.rl.trainer import Trainer

FLIPPED = FastPaths(**{f.name: not f.default for f in dataclasses.fields(FastPaths)})


def _overrides(paths: FastPaths) -> list[str]:
    return [f"fast_paths.{name}={str(on).lower()}" for name, on in dataclasses.asdict(paths).items()]


def test_fast_paths_parse_validate_and_keep_their_defaults():
    """Defaults are the fields' defaults; dotted overrides set each switch; a misspelt key or a non-boolean value is
    refused with the key named; config_to_dict carries the section with every field."""
    assert load_config(None).fast_paths == FastPaths()
    assert load_config(None, _overrides(FLIPPED)).fast_paths == FLIPPED
    assert FLIPPED != FastPaths() and all(getattr(FLIPPED, f.name) != f.default for f in dataclasses.fields(FastPaths))
    assert config_to_dict(load_config(None, ["fast_paths.fused_rope=false"]))["fast_paths"] == {
        **dataclasses.asdict(FastPaths()), "fused_rope": False}
    # a removed key in an older run's config.yaml loads (resume) with a warning and is ignored
    with pytest.warns(UserWarning, match="fast_paths.stack_lora is ignored: training LoRA stacking was removed"):
        assert load_config(None, ["fast_paths.stack_lora=true"]).fast_paths == FastPaths()
    with pytest.raises(ConfigError, match="did you mean fast_paths.fused_rope"):
        load_config(None, ["fast_paths.fused_rop=false"])
    with pytest.raises(ConfigError, match="fast_paths.fused_logprobs must be true or false"):
        load_config(None, ["fast_paths.fused_logprobs=maybe"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        FastPaths().fused_rope = False  # a captured CUDA graph keeps its paths: a change is a new object


def _config(tmp_path, paths: FastPaths):
    return load_config(None, [
        "data.train=arithmetic", "data.max_operand=9", "data.num_train=8", "data.num_eval=2",
        "rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=4",
        "train.steps=1", "train.micro_batch_size=4", "train.seed=0",
        "eval.before=false", "eval.after=false", "output.tensorboard=false", "output.progress=false",
        f"output.dir={tmp_path / 'run'}", "model.device=cpu",
        # every reader in play: FP8 training linears with the shared input, LoRA on q/k/v and gate/up, the fast
        # engine (an FP8 KV cache) with the fused decode
        "precision.flow=unified", "precision.format=fp8-block", "precision.quantized_backward=true",
        "precision.kv_cache=fp8", "lora.rank=4", *_overrides(paths),
    ])


def _spy(monkeypatch, module, name, record, pick):
    real = getattr(module, name)

    def spy(*args, **kwargs):
        record.setdefault(name, set()).add(pick(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("paths", [FastPaths(), FLIPPED], ids=["defaults", "flipped"])
def test_a_runs_fast_paths_reach_every_reader_and_its_saved_config(tmp_path, monkeypatch, paths):
    """A run configured with `paths` (the defaults, or every switch flipped): one training step hands exactly
    those values to each function that reads a switch (the training RoPE, the shared input codes, the stacked
    training LoRA, the FP8 training linear, the answer log-probs, the fused decode's codes handoff), the model's
    modules and the fast engine's decoder hold them, the engine's CUDA-graph key contains them, and the run's
    config.yaml records them."""
    from quarl.model import decoder, fp8_training, layers, qlinear
    from quarl.rl import batch
    from quarl.rollout import fused_decode
    from quarl.rollout.sampling import SamplingParams

    seen: dict[str, set] = {}
    _spy(monkeypatch, layers, "_fused_rope_ok", seen, lambda x, enabled: ("fused_rope", enabled))
    _spy(monkeypatch, decoder, "prepare_training_kernels", seen, lambda device, dtype, fp: fp)
    _spy(monkeypatch, fp8_training, "shared_input_codes", seen, lambda enabled: ("share_input_codes", enabled))
    _spy(monkeypatch, qlinear, "fp8_block_linear", seen, lambda x, w, b, frozen, fp: fp)
    _spy(monkeypatch, batch, "_fused_logprobs_ok", seen, lambda m, ids, enabled: ("fused_logprobs", enabled))
    _spy(monkeypatch, fused_decode, "linear_codes_handoff", seen, lambda linear, m, fp: fp)

    cfg = _config(tmp_path, paths)
    torch.manual_seed(0)
    trainer = Trainer(cfg, model=QuarlForCausalLM(tiny_config("llama")), tokenizer=tiny_tokenizer())
    trainer.prepare_run_dir()
    try:
        trainer.step(0)
    finally:
        trainer.close()

    assert seen == {
        "_fused_rope_ok": {("fused_rope", paths.fused_rope)},
        "prepare_training_kernels": {paths},
        "shared_input_codes": {("share_input_codes", paths.share_input_codes)},
        "fp8_block_linear": {paths},  # carries fused_cublas_path and fp8_weight_grad_kernel to FP8BlockLinear
        "_fused_logprobs_ok": {("fused_logprobs", paths.fused_logprobs)},
        "linear_codes_handoff": {paths},
    }
    model, engine = trainer.model, trainer.engine
    holders = [model] + [m for m in model.modules() if isinstance(m, (layers.Attention, layers.MLP,
                                                                       qlinear.QuantLinear))]
    assert all(m.fast_paths is paths or m.fast_paths == paths for m in holders)
    assert engine.fast_paths == paths and engine._decoder is not None and engine._decoder.fast_paths == paths
    assert all(p.fast_paths == paths for p in engine._decoder.qkv + engine._decoder.gate_up)
    params = SamplingParams(1.0, 1.0, 0)
    assert paths in engine._graph_key(8, 256, params)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["fast_paths"] == dataclasses.asdict(paths)
    assert load_config(str(tmp_path / "run" / "config.yaml")).fast_paths == paths


def test_the_engines_graph_key_changes_with_its_fast_paths():
    """Graphs are keyed by the engine's paths: another `FastPaths` is another key (so a graph captured with one
    adapter path is never replayed for the other), and an engine without its own takes the model's."""
    from quarl.rollout.fast_engine import FastRolloutEngine
    from quarl.rollout.sampling import SamplingParams

    model = QuarlForCausalLM(tiny_config("llama"), fast_paths=FastPaths(stack_rollout_lora=False))
    engine = FastRolloutEngine(model, None, max_batch_size=4, fused_decode=True)
    assert engine.fast_paths == model.fast_paths == FastPaths(stack_rollout_lora=False)
    params = SamplingParams(1.0, 1.0, 0)
    key = engine._graph_key(4, 256, params)
    engine.fast_paths = FastPaths()
    assert engine._graph_key(4, 256, params) != key
    with pytest.raises(TypeError, match="FastPaths"):
        FastRolloutEngine(model, None, max_batch_size=4, fast_paths={"stack_rollout_lora": False})
    with pytest.raises(TypeError, match="FastPaths"):
        model.set_fast_paths({"fused_rope": False})


@pytest.mark.parametrize("kernel", [False, True])
def test_fp8_block_linear_hands_the_weight_grad_switch_to_its_backward(monkeypatch, kernel):
    """`FastPaths.fp8_weight_grad_kernel` given to FP8BlockLinear reaches the weight-gradient GEMM's choice in the
    backward (on the CPU both choices take the reference product: the same gradient)."""
    from quarl.model import fp8_training

    seen = []
    real = fp8_training._weight_grad
    monkeypatch.setattr(fp8_training, "_weight_grad", lambda g, x, k=False: seen.append(k) or real(g, x, k))
    x = torch.randn(4, 128, requires_grad=True)
    w = torch.randn(128, 128, requires_grad=True)
    fp8_training.fp8_block_linear(x, w, None, None, FastPaths(fp8_weight_grad_kernel=kernel)).sum().backward()
    assert seen == [kernel]
    reference = w.grad.clone()
    w.grad = None
    fp8_training.fp8_block_linear(x, w, None).sum().backward()  # the defaults
    assert seen == [kernel, False] and torch.equal(w.grad, reference)
