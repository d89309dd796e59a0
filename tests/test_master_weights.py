"""Float32 master weights under bf16 compute: small updates accumulate, checkpoints keep the masters exactly."""

import pytest
import torch

from quarl.rl.master_weights import MasterWeightAdamW
from test_trainer import make_cfg, make_trainer


def _steps(opt, param, grads):
    for g in grads:
        opt.zero_grad()
        param.grad = None
        (param * g.to(param.dtype)).sum().backward()
        opt.step()


@pytest.mark.parametrize("shape", [(576, 192), (64, 48)])
def test_masters_follow_float32_adamw_and_round_into_bf16(shape):
    """Same bf16-representable gradients: the masters equal AdamW on a float32 copy (tolerance 1e-6 relative to the
    weight scale), the bf16 weights are the masters rounded to nearest, and plain AdamW on bf16 weights at this
    learning rate leaves most weights where they were."""
    torch.manual_seed(0)
    init = torch.randn(shape) * 0.05
    grads = [torch.randn(shape).to(torch.bfloat16).float() for _ in range(5)]
    lr = 1e-6

    ref = init.to(torch.bfloat16).double().clone().requires_grad_(True)
    ref_opt = torch.optim.AdamW([ref], lr=lr)
    _steps(ref_opt, ref, grads)

    ours = init.to(torch.bfloat16).clone().requires_grad_(True)
    opt = MasterWeightAdamW([ours], lr=lr)
    _steps(opt, ours, grads)
    master = opt.masters[0]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master.double(), ref.detach(), rtol=0, atol=1e-6 * 0.05)
    assert torch.equal(ours.detach(), master.to(torch.bfloat16))

    plain = init.to(torch.bfloat16).clone().requires_grad_(True)
    plain_opt = torch.optim.AdamW([plain], lr=lr)
    _steps(plain_opt, plain, grads)
    start = init.to(torch.bfloat16)
    moved_plain = (plain.detach() != start).float().mean().item()
    moved_master = (master != start.float()).float().mean().item()
    assert moved_master > 0.99  # every weight moved in float32 (but where updates of opposite sign cancel)
    assert moved_plain < 0.2, moved_plain  # the failure the masters exist for


def test_micro_batch_gradients_accumulate_in_float32():
    """Two backward passes before a step: the master's gradient is the float32 sum of the two bf16 gradients."""
    torch.manual_seed(1)
    p = torch.randn(40, 30).to(torch.bfloat16).requires_grad_(True)
    opt = MasterWeightAdamW([p], lr=1e-3)
    g1, g2 = torch.randn(40, 30), torch.randn(40, 30)
    (p * g1.to(torch.bfloat16)).sum().backward()
    (p * g2.to(torch.bfloat16)).sum().backward()
    assert p.grad is None  # moved into the master
    expected = g1.to(torch.bfloat16).float() + g2.to(torch.bfloat16).float()
    torch.testing.assert_close(opt.masters[0].grad, expected, rtol=0, atol=0)


def test_float32_parameters_are_their_own_masters():
    p = torch.randn(8, 4, requires_grad=True)
    opt = MasterWeightAdamW([p], lr=1e-2)
    assert opt.masters[0] is p and not opt.has_half_params
    before = p.detach().clone()
    p.sum().backward()
    opt.step()
    assert not torch.equal(p.detach(), before)


def test_bf16_full_fine_tuning_moves_weights_like_float32(tmp_path):
    """The trainer with bf16 compute on the CPU: one RL step at lr 1e-5 moves (almost) every weight, by about as
    much as the float32 run (AdamW's first step is ~lr per weight whatever the gradient's precision); plain AdamW
    on the bf16 weights would move almost none of them."""
    deltas = {}
    for dtype in ("float32", "bfloat16"):
        cfg = make_cfg(tmp_path, f"precision.compute_dtype={dtype}", "train.lr=1e-5", "train.steps=1",
                       name=f"run-{dtype}")
        trainer = make_trainer(cfg)
        names = [n for n, p in trainer.model.named_parameters() if p.requires_grad and p.dim() == 2]
        before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if n in names}
        trainer.train()
        masters = dict(zip([n for n, p in trainer.model.named_parameters() if p.requires_grad],
                           trainer.optimizer.masters))
        deltas[dtype] = torch.cat([(masters[n].detach().float() - before[n]).flatten() for n in names])
        if dtype == "bfloat16":
            assert trainer.optimizer.has_half_params
            bf16_moved = torch.cat([(p.detach().float() != before[n]).flatten()
                                    for n, p in trainer.model.named_parameters() if n in names]).float().mean()
    moved = {k: (d != 0).float().mean().item() for k, d in deltas.items()}
    assert moved["bfloat16"] > 0.95 * moved["float32"] > 0.5, moved  # unused embedding rows get no gradient
    ratio = deltas["bfloat16"].norm() / deltas["float32"].norm()
    assert 0.7 < ratio < 1.3, ratio
    # the bf16 weights themselves move where lr exceeds half an ulp (small weights), not nowhere
    assert bf16_moved > 0.05, bf16_moved


def test_resume_restores_float32_masters_exactly(tmp_path):
    cfg = make_cfg(tmp_path, "precision.compute_dtype=bfloat16", "train.lr=1e-5", "train.steps=2",
                   "output.checkpoint_every=1")
    trainer = make_trainer(cfg)
    trainer.train()
    masters = [m.detach().clone() for m in trainer.optimizer.masters]
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)  # not bf16 values
    resumed = make_trainer(make_cfg(tmp_path, "precision.compute_dtype=bfloat16", "train.lr=1e-5",
                                    "train.steps=2", "output.checkpoint_every=1", f"resume={cfg.output.dir}"))
    resumed.prepare_run_dir()
    for a, b in zip(masters, resumed.optimizer.masters):
        assert torch.equal(a, b.detach())
    for p, m in zip(resumed.optimizer.params, resumed.optimizer.masters):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))


def test_a_state_without_masters_starts_them_from_the_loaded_weights():
    """A float32 run resumed in bf16: the state holds no masters, so each master must start from the weight as
    loaded from the checkpoint, not from the weight the optimizer was built with."""
    torch.manual_seed(2)
    trained = torch.randn(16, 8)
    f32 = trained.clone().requires_grad_(True)
    state = MasterWeightAdamW([f32], lr=1e-3).state_dict()
    assert state["masters"] == {}
    p = torch.zeros(16, 8, dtype=torch.bfloat16, requires_grad=True)  # built before the checkpoint's weights load
    opt = MasterWeightAdamW([p], lr=1e-3)
    with torch.no_grad():
        p.copy_(trained)  # the checkpoint's weights, as load_checkpoint writes them
    opt.load_state_dict(state)
    assert torch.equal(opt.masters[0], trained.to(torch.bfloat16).float())
    assert torch.equal(p.detach(), trained.to(torch.bfloat16))
