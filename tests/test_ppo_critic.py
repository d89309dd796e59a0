"""PPO with a critic inside the trainer (loss.advantage_estimator=gae): the wired loss and its gradients against an
independent float64 computation, `quarl train` end to end for both critic placements, warm-up, resume, bad config."""

import math

import pytest
import torch

from quarl.config import ConfigError, load_config
from quarl.rl.batch import build_batch
from quarl.rl.checkpoint import read_checkpoint
from tests.test_trainer import make_cfg, make_trainer, read_metrics

GAE = ["loss.advantage_estimator=gae", "critic.lr=1e-2"]


def varied_reward(completion: str, example: dict) -> float:
    """A reward that varies across a random model's answers (so returns, and the critic's targets, do)."""
    return (sum(map(ord, completion)) % 7) / 7


# ------------------------------------------------------------------------------------------------ float64 reference

def _reference(trainer, rows, behaviour, rewards, counts, prox0, v_old, gamma, lam, cap, eps, eps_v, vf_coef, temp):
    """The PPO + GAE loss of the batch at the trainer's current weights, in float64, written from the formulas:
    per-row unpadded forwards, GAE by its closed form per answer, whitening over the counted tokens, token-level TIS
    times the clipped surrogate, the clipped value loss; token-mean over the counted tokens."""
    actor, critic = trainer.model, trainer.critic
    w, b = critic.head.proj.weight[0], critic.head.proj.bias[0]
    adv_raw, ret, logp, values, tokens = [], [], [], [], []
    for i, (prompt, answer) in enumerate(rows):
        if not counts[i]:
            continue
        ids = torch.tensor(prompt + answer)
        h = actor.hidden_states(ids.unsqueeze(0))[0][len(prompt) - 1: len(ids) - 1]  # [A, H]
        logits = actor.lm_head(h) / temp
        logp.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(answer)[:, None])[:, 0])
        hc = h if critic.shared else critic.trunk.hidden_states(ids.unsqueeze(0))[0][len(prompt) - 1: len(ids) - 1]
        values.append(hc @ w + b)
        vo = v_old[i] + [0.0]
        r = [0.0] * (len(answer) - 1) + [rewards[i]]
        delta = [r[k] + gamma * vo[k + 1] - vo[k] for k in range(len(answer))]
        a = [sum((gamma * lam) ** l * delta[k + l] for l in range(len(answer) - k)) for k in range(len(answer))]
        adv_raw += a
        ret += [a[k] + vo[k] for k in range(len(answer))]
        tokens += [(i, k) for k in range(len(answer))]
    adv_raw = torch.tensor(adv_raw, dtype=torch.float64)
    adv = (adv_raw - adv_raw.mean()) / (adv_raw.std(unbiased=False) + 1e-6)
    ret = torch.tensor(ret, dtype=torch.float64)
    logp, values = torch.cat(logp), torch.cat(values)
    p0 = torch.tensor([prox0[i][k] for i, k in tokens], dtype=torch.float64)
    mu = torch.tensor([behaviour[i][k] for i, k in tokens], dtype=torch.float64)
    vo = torch.tensor([v_old[i][k] for i, k in tokens], dtype=torch.float64)
    ratio = torch.exp(logp - p0)
    weight = torch.clamp(torch.exp(p0 - mu), max=cap)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    v_clip = vo + torch.clamp(values - vo, -eps_v, eps_v)
    value = 0.5 * torch.maximum((values - ret) ** 2, (v_clip - ret) ** 2)
    n = len(tokens)
    return (-(weight * surrogate).sum() + vf_coef * value.sum()) / n, adv, ret, tokens


@pytest.mark.parametrize("placement", ["shared", "separate"])
def test_wired_loss_and_gradients_match_float64(tmp_path, placement):
    gamma, lam, cap, eps, eps_v, vf_coef, temp = 0.97, 0.9, 1.3, 0.2, 0.05, 0.7, 0.7
    cfg = make_cfg(tmp_path, "precision.compute_dtype=float64", "loss.advantage_estimator=gae",
                   "loss.aggregation=token-mean", f"loss.is_cap={cap}", f"loss.epsilon_low={eps}",
                   f"critic.placement={placement}", f"critic.gamma={gamma}", f"critic.lam={lam}",
                   f"critic.value_clip={eps_v}", f"critic.vf_coef={vf_coef}", f"rollout.temperature={temp}",
                   "train.max_grad_norm=1e9", "train.micro_batch_size=2")
    trainer = make_trainer(cfg)
    critic = trainer.critic
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    with torch.no_grad():  # a critic that predicts something: random head
        critic.head.proj.weight.normal_(0, 0.5, generator=g)
        critic.head.proj.bias.fill_(0.1)
    lengths = [(3, 4), (5, 1), (2, 6), (4, 3), (3, 5)]
    rows = [(torch.randint(0, 256, (p,), generator=g).tolist(), torch.randint(0, 256, (a,), generator=g).tolist())
            for p, a in lengths]
    counts = [True, True, True, False, True]  # row 3 overlong-masked: no reward, no loss, not in the whitening
    rewards = torch.randn(len(rows), generator=g)
    zeros = [[0.0] * len(a) for _, a in rows]
    batch = build_batch([p for p, _ in rows], [a for _, a in rows], zeros, counts, torch.zeros(len(rows)), rewards,
                        list(range(len(rows))), pad_id=0)
    prox, _ = trainer.score(trainer.model, batch, with_entropy=False)
    # μ: π_prox off by noise, so ρ = π_prox/μ spreads on both sides of the cap
    noise = torch.randn(prox.shape, generator=g, dtype=prox.dtype) * 0.4
    batch.behaviour_logprobs = torch.where(batch.answer_mask.bool(), prox + noise, torch.zeros_like(prox))
    behaviour = [batch.behaviour_logprobs[i, -len(a):].tolist() for i, (_, a) in enumerate(rows)]
    prox0 = [prox[i, -len(a):].tolist() for i, (_, a) in enumerate(rows)]
    with torch.no_grad():  # V_old by its own forward, row by row
        w, b = critic.head.proj.weight[0], critic.head.proj.bias[0]
        trunk = trainer.model if placement == "shared" else critic.trunk
        v_old = [(trunk.hidden_states(torch.tensor(p + a)[None])[0][len(p) - 1: len(p) + len(a) - 1] @ w + b).tolist()
                 for p, a in rows]

    prepared, metrics = critic.prepare(batch, 2, trainer.device)
    # perturb every weight: the update then sees R ≠ 1 and V ≠ V_old, so both clips and ρ's cap bind somewhere
    with torch.no_grad():
        for p in list(trainer.model.parameters()) + list(critic.parts.parameters()):
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.03)
    want_loss, want_adv, want_ret, tokens = _reference(trainer, rows, behaviour, batch.rewards.tolist(), counts, prox0,
                                                       v_old, gamma, lam, cap, eps, eps_v, vf_coef, temp)
    params = [p for p in trainer.optimizer.params] + [p for p in critic.optimizer.params]
    want_grads = torch.autograd.grad(want_loss, params)

    width = prepared.advantages.shape[1]
    col = lambda i, k: width - len(rows[i][1]) + k  # noqa: E731  (answer token k of row i, left-padded layout)
    got_adv = torch.stack([prepared.advantages[i, col(i, k)] for i, k in tokens]).double()
    got_ret = torch.stack([prepared.returns[i, col(i, k)] for i, k in tokens]).double()
    torch.testing.assert_close(got_adv, want_adv, rtol=1e-5, atol=1e-6)  # batch tensors are float32
    torch.testing.assert_close(got_ret, want_ret, rtol=1e-6, atol=1e-6)
    assert prepared.advantages[3].abs().max() == 0 and prepared.returns[3].abs().max() == 0
    assert metrics["critic/value_mean"] == pytest.approx(sum(sum(v) for i, v in enumerate(v_old) if counts[i])
                                                         / len(tokens), rel=1e-6)

    seen = {}

    def spy(name, optimizer):
        def step():  # the gradients this optimizer step would apply (float64 parameters are their own masters)
            seen[name] = [p.grad.clone() for p in optimizer.params]
        return step

    trainer.optimizer.step = spy("actor", trainer.optimizer)
    critic.optimizer.step = spy("critic", critic.optimizer)
    out = trainer.update(prepared, prox.to(torch.float64), None, step=0)
    assert out["train/optimizer_steps"] == 1
    # the loss as 3 micro-batches of 2, 2, 1 rows, each with its value loss: they sum to the whole-batch loss
    assert out["train/loss"] == pytest.approx(want_loss.item(), rel=1e-9, abs=1e-12)
    got_grads = seen["actor"] + seen["critic"]
    assert len(got_grads) == len(want_grads)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-11)
    assert 0 < out["critic/vf_clipfrac"] < 1 and 0 < out["clip/frac_low"] + out["clip/frac_high"]
    assert 0 < out["is/truncated_frac"] < 1


# ------------------------------------------------------------------------------------------------ end to end

@pytest.mark.parametrize("placement", ["shared", "separate"])
def test_quarl_train_ppo_gae_end_to_end(tmp_path, placement):
    from quarl.cli import main
    from quarl.model.loading import tiny_random_model

    run = tmp_path / placement
    rc = main(["train", "model.name=tiny-random-llama", "model.device=cpu", "precision.flow=split",
               "precision.format=int8", "data.train=arithmetic", "data.num_train=20", "data.num_eval=2",
               "reward.function=tests.test_ppo_critic:varied_reward", "rollout.prompts_per_step=2",
               "rollout.num_generations=2", "rollout.max_new_tokens=6", "train.steps=2", "train.lr=1e-3",
               "train.micro_batch_size=2", "eval.before=false", "eval.after=false", "output.tensorboard=false",
               "output.progress=false", f"output.dir={run}", f"critic.placement={placement}",
               "output.export_hf=" + ("true" if placement == "shared" else "false"), *GAE])
    assert rc == 0
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    for key in ("critic/value_mean", "critic/vf_loss", "critic/vf_clipfrac", "critic/explained_variance",
                "critic/returns_mean", "critic/grad_norm", "train/loss", "mismatch/kl", "is/weight_mean"):
        assert all(key in r and math.isfinite(r[key]) for r in records), key
    assert records[0]["critic/value_mean"] == 0  # a fresh head predicts 0
    assert records[1]["critic/value_mean"] != 0  # ... and has learned by step 2
    state = read_checkpoint(run / "checkpoints" / "step_000002.pt")
    head = state["critic"]["weights"]["head.proj.weight"]
    assert head.abs().max() > 0 and state["critic"]["optimizer"]["optimizer"]["state"]
    initial = tiny_random_model("tiny-random-llama")
    if placement == "separate":  # the critic's own decoder trained too, starting from the actor's weights
        trunk = {k[len("trunk."):]: v for k, v in state["critic"]["weights"].items() if k.startswith("trunk.")}
        start = dict(initial.model.named_parameters())
        assert set(trunk) == set(start)
        assert any(not torch.equal(v, start[k]) for k, v in trunk.items())
    else:  # the export holds the actor only
        assert set(_safetensor_names(run / "export")) == {n for n, _ in initial.named_parameters()}
    actor = state["model"]
    assert any(not torch.equal(v, dict(initial.named_parameters())[k]) for k, v in actor.items())


def _safetensor_names(folder):
    from safetensors import safe_open

    names = []
    for f in folder.rglob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names += list(st.keys())
    return names


@pytest.mark.parametrize("placement", ["shared", "separate"])
def test_critic_warmup_leaves_the_actor_alone(tmp_path, placement):
    cfg = make_cfg(tmp_path, *GAE, f"critic.placement={placement}", "critic.warmup_steps=1", "train.steps=2",
                   "rollout.num_generations=1")  # PPO needs no group: one answer per prompt trains
    trainer = make_trainer(cfg)
    actor = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    critic = {n: p.detach().clone() for n, p in trainer.critic.parts.named_parameters()}
    trainer.cfg.train.steps = 1  # stop after the warm-up step
    trainer.train()
    assert all(torch.equal(p, actor[n]) for n, p in trainer.model.named_parameters())
    assert any(not torch.equal(p, critic[n]) for n, p in trainer.critic.parts.named_parameters())
    assert read_metrics(tmp_path / "run")[-1]["critic/vf_loss"] > 0


def test_resume_restores_the_critic_exactly(tmp_path):
    extra = [*GAE, "critic.placement=separate", "train.steps=3", "output.checkpoint_every=1"]
    full = make_trainer(make_cfg(tmp_path, *extra, name="full"))
    full.train()
    part = make_trainer(make_cfg(tmp_path, *extra, name="part"))
    part.cfg.train.steps = 2  # stop early, as if killed after step 2's checkpoint
    part.train()
    saved = part.critic.state_dict()
    cfg = make_cfg(tmp_path, *extra, name="part")
    cfg.resume = str(tmp_path / "part")
    resumed = make_trainer(cfg)
    fresh = resumed.critic.state_dict()
    resumed.prepare_run_dir()
    restored = resumed.critic.state_dict()
    resumed.close()
    assert any(not torch.equal(v, fresh["weights"][k]) for k, v in saved["weights"].items())
    for k, v in saved["weights"].items():
        assert torch.equal(restored["weights"][k], v), k
    moments_saved, moments = saved["optimizer"]["optimizer"]["state"], restored["optimizer"]["optimizer"]["state"]
    assert moments_saved.keys() == moments.keys()
    for i in moments_saved:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(moments[i][name], moments_saved[i][name]), (i, name)
    cfg = make_cfg(tmp_path, *extra, name="part")
    cfg.resume = str(tmp_path / "part")
    make_trainer(cfg).train()
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in ("critic/vf_loss", "critic/value_mean", "train/loss"):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-5, abs=1e-7), key


def test_resume_of_a_run_without_critic_says_so(tmp_path):
    plain = make_trainer(make_cfg(tmp_path, "train.steps=1"))
    plain.train()
    cfg = make_cfg(tmp_path, *GAE, "train.steps=2")
    cfg.resume = str(tmp_path / "run")
    trainer = make_trainer(cfg)
    with pytest.raises(ValueError, match="holds no critic"):
        trainer.prepare_run_dir()
    trainer.close()


# ------------------------------------------------------------------------------------------------ bad config

@pytest.mark.parametrize("override,match", [
    ("loss.advantage_estimator=td", r"loss.advantage_estimator='td' is unknown"),
    ("critic.placement=middle", r"critic.placement='middle' is unknown"),
    ("critic.lr=0", r"critic.lr=0.0 must be a finite number > 0"),
    ("critic.value_clip=0", r"critic.value_clip=0.0 must be a finite number > 0"),
    ("critic.vf_coef=-1", r"critic.vf_coef=-1.0 must be"),
    ("critic.gamma=1.5", r"critic.gamma=1.5 must lie in \[0, 1\]"),
    ("critic.lam=-0.1", r"critic.lam=-0.1 must lie in \[0, 1\]"),
    ("critic.warmup_steps=-1", r"critic.warmup_steps=-1 must be an int >= 0"),
    ("critic.warmup_steps=5", r"critic.warmup_steps=5 >= train.steps=5: the actor would never train"),
    ("critic.model=tiny-random-qwen2", r"critic.model='tiny-random-qwen2' is for critic.placement=separate"),
])
def test_bad_critic_config_fails_in_one_line(override, match):
    extra = ["critic.placement=shared"] if override.startswith("critic.model") else []
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, ["loss.advantage_estimator=gae", "train.steps=5", *extra, override])
    assert "\n" not in str(e.value)


def test_critic_keys_without_gae_warn_and_one_answer_needs_gae():
    with pytest.warns(UserWarning, match=r"critic.placement, critic.lr set, but loss.advantage_estimator=group"):
        load_config(None, ["critic.placement=shared", "critic.lr=1e-4"])
    with pytest.raises(ConfigError, match="num_generations must be >= 2"):
        load_config(None, ["rollout.num_generations=1"])
    assert load_config(None, ["rollout.num_generations=1", "loss.advantage_estimator=gae"]).rollout.num_generations == 1


def test_separate_critic_model_that_does_not_exist_fails_clearly(tmp_path):
    cfg = make_cfg(tmp_path, *GAE, f"critic.model={tmp_path / 'no-such-model'}")
    with pytest.raises((FileNotFoundError, ValueError), match="no-such-model"):
        make_trainer(cfg)


def test_critic_keeps_float32_masters_on_a_16bit_trunk_and_never_checkpoints_nan(tmp_path):
    from quarl.rl.trainer import NonFiniteError

    cfg = make_cfg(tmp_path, *GAE, "precision.compute_dtype=bfloat16", "train.steps=1")
    trainer = make_trainer(cfg)
    critic = trainer.critic
    trunk = [p for n, p in critic.parts.named_parameters() if n.startswith("trunk.")]
    assert trunk and all(p.dtype == torch.bfloat16 for p in trunk)
    assert critic.head.proj.weight.dtype == torch.float32
    assert all(m.dtype == torch.float32 for m in critic.optimizer.masters)
    start = [m.detach().clone() for m in critic.optimizer.masters]
    trainer.train()
    assert any(not torch.equal(m, s) for m, s in zip(critic.optimizer.masters, start))
    for p, m in zip(critic.optimizer.params, critic.optimizer.masters):  # bf16 weights = their masters, rounded
        assert torch.equal(p, m.to(p.dtype))
    with torch.no_grad():
        critic.head.proj.weight[0, 3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"critic.head.proj.weight"):
        trainer.checkpoint(1)


def test_a_critic_under_torchrun_is_refused_before_any_process_group(monkeypatch):
    import quarl.distributed as qdist
    from quarl.rl.trainer import Trainer

    monkeypatch.setattr(qdist, "launched_by_torchrun", lambda: True)
    cfg = load_config(None, ["model.name=tiny-random-llama", "model.device=cpu", "loss.advantage_estimator=gae"])
    with pytest.raises(ValueError, match="runs on one process"):
        Trainer(cfg)
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


@pytest.mark.parametrize("replay", [False, True])
def test_a_shared_moe_critic_sees_the_experts_its_update_will_use(tmp_path, replay):
    """V_old and the update's V come from the same weights at a batch's only optimizer step, so no value can
    leave even a tiny clip band: with router replay V_old must replay the rollout's experts as the update does."""
    from quarl.cli import main

    run = tmp_path / f"replay-{replay}"
    rc = main(["train", "model.name=tiny-random-qwen3-moe", "model.device=cpu", "precision.flow=split",
               "precision.format=int8", "data.train=arithmetic", "data.num_train=20", "data.num_eval=2",
               "reward.function=tests.test_ppo_critic:varied_reward", "rollout.prompts_per_step=2",
               "rollout.num_generations=2", "rollout.max_new_tokens=6", "train.steps=3", "train.lr=1e-3",
               "train.micro_batch_size=2", "eval.before=false", "eval.after=false", "output.tensorboard=false",
               "output.progress=false", f"output.dir={run}", "critic.placement=shared", "critic.value_clip=1e-6",
               f"rollout.router_replay={str(replay).lower()}", *GAE])
    assert rc == 0
    records = read_metrics(run)
    assert len(records) == 3 and all(r["critic/vf_clipfrac"] == 0 for r in records)


def test_dynamic_sampling_with_one_answer_per_prompt_is_refused():
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        load_config(None, ["loss.advantage_estimator=gae", "rollout.num_generations=1", "train.dynamic_sampling=true"])
    load_config(None, ["loss.advantage_estimator=gae", "rollout.num_generations=1"])  # without it: fine
