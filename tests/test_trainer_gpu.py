"""The trainer on a GPU (bf16, fast engine with CUDA graphs): every precision flow runs end to end."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import FLOWS, make_cfg, read_metrics

pytestmark = pytest.mark.gpu


# The FP8 KV caches need the fast engine, which the CPU flow tests do not use.
GPU_FLOWS = FLOWS + [("unified-kv-fp8-token", ["precision.flow=unified", "precision.kv_cache=fp8-token"]),
                     ("split-fp8-kv-fp8", ["precision.flow=split", "precision.format=fp8", "precision.kv_cache=fp8"]),
                     # tiny models take bf16 GEMMs by default (precision.kernel_forward null): the 8-bit kernels too
                     ("unified-int8-kernels", ["precision.flow=unified", "precision.format=int8",
                                               "precision.kernel_forward=true"]),
                     # rollout and training on the batch-invariant kernels: the same log-probs to float32 rounding
                     ("bf16-invariant", ["precision.batch_invariant=true"]),
                     ("unified-invariant", ["precision.flow=unified", "precision.batch_invariant=true"])]


@pytest.mark.parametrize("name,overrides", GPU_FLOWS, ids=[f[0] for f in GPU_FLOWS])
def test_each_flow_on_cuda_with_the_fast_engine(tmp_path, name, overrides):
    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.tiny import tiny_config, tiny_tokenizer
    from quarl.rl.trainer import Trainer
    from quarl.rollout.fast_engine import FastRolloutEngine

    cfg = make_cfg(tmp_path, *overrides, "model.device=cuda", "rollout.engine=fast", "train.steps=2")
    torch.manual_seed(0)
    trainer = Trainer(cfg, model=QuarlForCausalLM(tiny_config("llama")), tokenizer=tiny_tokenizer())
    assert isinstance(trainer.engine, FastRolloutEngine)
    assert next(trainer.model.parameters()).device.type == "cuda"
    trainer.train()
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward/mean", "mismatch/kl", "train/loss", "time/rollout_s"):
        assert records[-1][key] is not None and math.isfinite(records[-1][key]), key
    if name == "bf16":  # same weights, same kernels family: the mismatch stays small
        assert records[0]["mismatch/max_abs_logp_diff"] < 0.5
    if name.endswith("-invariant"):  # the same logits; only the two log-softmax kernels' float32 sums differ
        assert trainer.model.batch_invariant and trainer.engine.batch_invariant
        assert all(r["mismatch/max_abs_logp_diff"] < 1e-4 for r in records), records
