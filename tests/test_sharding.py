"""The rollout copy of a sharded run and its layer-by-layer sync, in one process (no process group: the gathers are
the tensors themselves): after any update the copy holds exactly the rollout weights one process would quantize,
and its rollout forward gives the same logits, while its quantized linears hold no bf16/float32 weight."""

import copy

import pytest
import torch

from quarl.model.precision_apply import apply_precision, refresh_rollout_weights, rollout_mode
from quarl.model.qlinear import QuantLinear
from quarl.precision import LoraConfig, PrecisionConfig
from quarl.rl.sharding import ShardedRolloutSync, make_rollout_copy
from tiny_models import make_model

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {
    "split-int8": PrecisionConfig(flow="split", format="int8"),
    "unified-fp8": PrecisionConfig(flow="unified", format="fp8", weight_only=False),  # W8A8 (the default here: W8A16)
    "split-nvfp4-lora": PrecisionConfig(flow="split", format="nvfp4", lora=LoraConfig(rank=4)),
    "qlora-nvfp4": PrecisionConfig(flow="qlora", format="nvfp4", lora=LoraConfig(rank=4)),
    "bf16": PrecisionConfig(flow="bf16"),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_synced_rollout_copy_equals_the_single_process_rollout_weights(name, dtype):
    torch.manual_seed(0)
    trained = make_model("llama", hidden_size=96, intermediate_size=160)  # float32 masters, as when sharded
    apply_precision(trained, CASES[name])
    rollout = make_rollout_copy(trained, dtype)
    sync = ShardedRolloutSync(trained, rollout)
    quantized = [m for m in rollout.modules() if isinstance(m, QuantLinear) and m.rollout_format is not None]
    assert all(m.weight is None for m in quantized)  # codes and scales only
    for a, b in zip(rollout.modules(), trained.modules()):  # a frozen qlora base is shared, not copied
        if isinstance(a, QuantLinear) and b.frozen_base:
            assert a.qweight_data.data_ptr() == b.qweight_data.data_ptr()
    assert all(p.dtype == torch.float32 for n, p in rollout.named_parameters() if "lora_" in n)
    # the copy multiplies as the trained model's training forward does: on bf16 GEMMs here (a tiny unified or qlora
    # model), with its dequantized cache, never on the quantized kernels
    for a, b in zip(rollout.modules(), trained.modules()):
        if isinstance(a, QuantLinear) and a.rollout_format is not None:
            assert a.rollout_avoids_kernel() == b.rollout_avoids_kernel() == (CASES[name].flow in ("unified", "qlora"))
            assert not a.rollout_avoids_kernel() or (a.weight_dequant is not None and a.weight_dequant.dtype == dtype)
            if b.frozen_base and b.weight_dequant is not None:  # a qlora base's copy is shared, not copied
                assert a.weight_dequant.data_ptr() == b.weight_dequant.data_ptr()
    ids = torch.randint(0, trained.config.vocab_size, (3, 11))
    for _ in range(2):  # two "optimizer steps": every trained tensor moves (LoRA B too, so adapters count)
        with torch.no_grad():
            for p in trained.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
        sync()
        # one process: the model itself in the compute dtype, its rollout copy re-quantized in place
        single = copy.deepcopy(trained)
        single.to(dtype)
        for m in single.modules():
            if isinstance(m, QuantLinear) and m.lora_rank:
                m.lora_A.data, m.lora_B.data = m.lora_A.data.float(), m.lora_B.data.float()
        refresh_rollout_weights(single)
        for (n, a), b in zip(rollout.named_modules(), single.modules()):
            if isinstance(a, QuantLinear) and a.rollout_format is not None:
                assert torch.equal(a.qweight_data, b.qweight_data), n
                assert torch.equal(a.qweight_scale, b.qweight_scale), n
        with torch.no_grad(), rollout_mode(rollout), rollout_mode(single):
            torch.testing.assert_close(rollout(ids), single(ids), atol=0, rtol=0)


def test_a_bf16_rollout_copy_takes_aqn_noise_in_float32():
    from quarl.model.layers import RMSNorm
    from quarl.rl.aqn import set_aqn_noise

    torch.manual_seed(0)
    trained = make_model("llama", hidden_size=96, intermediate_size=160)
    apply_precision(trained, PrecisionConfig(flow="split", format="int8"))
    rollout = make_rollout_copy(trained, torch.bfloat16)
    norms = [m for m in rollout.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.weight.dtype == torch.bfloat16 and m.rollout_noise.dtype == torch.float32 for m in norms)
    set_aqn_noise(rollout, 1e-3, generator=torch.Generator().manual_seed(1))
    noise = torch.cat([m.rollout_noise for m in norms])
    assert noise.dtype == torch.float32 and 0.5e-3 < noise.std().item() < 2e-3  # drawn, not rounded away


def test_a_plain_resume_or_export_of_a_torchrun_run_says_what_to_do(tmp_path):
    import yaml

    from quarl.config import config_to_dict, load_config
    from quarl.export import export_from_run
    from quarl.rl.checkpoint import load_latest_intact

    (tmp_path / "checkpoints" / "step_000002.dcp").mkdir(parents=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_to_dict(load_config(None, ["model.device=cpu"]))))
    with pytest.raises(FileNotFoundError, match="only sharded checkpoints.*--nproc"):
        load_latest_intact(tmp_path, make_model("llama"))
    with pytest.raises(FileNotFoundError, match="only sharded checkpoints.*export_hf=true"):
        export_from_run(tmp_path, verbose=False)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_without_some_optimizer_state_loads_with_a_fresh_state_for_those(tmp_path):
    """A sharded run saves no AdamW state for a parameter that never had a gradient (an expert no token reached).
    Loading into one rank's MasterWeightAdamW (bf16 parameters, float32 masters) skips what the checkpoint lacks,
    gives those parameters a fresh state, and loads everything else exactly: masters, moments and step counts."""
    import torch.distributed.checkpoint as dcp

    from quarl.rl.master_weights import MasterWeightAdamW
    from quarl.rl.sharded_checkpoint import _drop_absent_optimizer_state, _master_state

    def trained(seed):
        torch.manual_seed(seed)
        model = make_model("llama", dtype=torch.bfloat16)
        opt = MasterWeightAdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(torch.randint(0, 300, (2, 5))).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = trained(0)
    state = _master_state(model, opt)
    skipped = "model.layers.1.mlp.down_proj.weight"
    saved = {"model": state["model"], "optim": {"state": {k: v for k, v in state["optim"]["state"].items()
                                                          if k != skipped}}}
    dcp.save(saved, checkpoint_id=str(tmp_path / "ckpt"))
    fresh_model, fresh_opt = trained(1)  # other weights, other moments: everything must be overwritten
    target = _master_state(fresh_model, fresh_opt)
    del target["optim"]["param_groups"]
    _drop_absent_optimizer_state(target, str(tmp_path / "ckpt"))
    assert skipped not in target["optim"]["state"]
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    fresh_opt.masters_to_params()
    for name, value in state["model"].items():
        assert torch.equal(target["model"][name], value), name
    names = dict(zip((n for n, _ in fresh_model.named_parameters()), fresh_opt.masters))
    for name, master in names.items():
        got, want = fresh_opt.optimizer.state[master], opt.optimizer.state[dict(zip(
            (n for n, _ in model.named_parameters()), opt.masters))[name]]
        if name == skipped:
            assert float(got["step"]) == 0 and not got["exp_avg"].any() and not got["exp_avg_sq"].any()
        else:
            assert float(got["step"]) == 2 and torch.equal(got["exp_avg"], want["exp_avg"]), name
    assert torch.equal(fresh_model.lm_head.weight, model.lm_head.weight)  # bf16 parameters := rounded masters
