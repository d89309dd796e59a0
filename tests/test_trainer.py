"""End-to-end RL runs on a tiny random model: every precision flow, resume, Ctrl-C, export to transformers/PEFT."""

import json
import math
import os
import signal

import pytest
import torch

from quarl.config import load_config
from quarl.model.decoder import QuarlForCausalLM
from quarl.model.tiny import tiny_config, tiny_tokenizer
from quarl.rl.trainer import Trainer, lr_factor


def digit_reward(completion: str, example: dict) -> float:
    """A dense reward a random byte-level model can move: the fraction of digits among the first characters."""
    head = completion[:8]
    return sum(ch.isdigit() for ch in head) / 8.0


INTERRUPT_AT_CALL = {"n": None, "calls": 0}


def interrupting_reward(completion: str, example: dict) -> float:
    INTERRUPT_AT_CALL["calls"] += 1
    if INTERRUPT_AT_CALL["calls"] == INTERRUPT_AT_CALL["n"]:
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C in the middle of a step
    return digit_reward(completion, example)


def make_cfg(tmp_path, *extra, name="run"):
    return load_config(None, [
        "data.train=arithmetic", "data.max_operand=9", "data.num_train=40", "data.num_eval=4",
        f"reward.function={__name__}:digit_reward",
        "rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_new_tokens=6",
        "train.steps=2", "train.lr=1e-3", "train.micro_batch_size=3", "train.seed=3",
        "eval.before=false", "eval.after=false", "output.tensorboard=false", "output.progress=false",
        f"output.dir={tmp_path / name}", "model.device=cpu", *extra,
    ])


def make_trainer(cfg, arch="llama"):
    torch.manual_seed(0)
    model = QuarlForCausalLM(tiny_config(arch))
    return Trainer(cfg, model=model, tokenizer=tiny_tokenizer())


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


FLOWS = [
    ("bf16", []),
    ("split-int8", ["precision.flow=split", "precision.format=int8"]),
    ("split-nvfp4-mis", ["precision.flow=split", "precision.format=nvfp4", "loss.correction=mis"]),
    ("unified-fp8-block-dapo", ["precision.flow=unified", "loss.correction=decoupled", "loss.loss_type=dapo",
                                "train.dynamic_sampling=true", "train.overlong_buffer=2",
                                "rollout.max_new_tokens=8"]),
    ("unified-fp8-block-quantized-backward", ["precision.flow=unified", "precision.quantized_backward=true"]),
    ("qlora-nvfp4", ["precision.flow=qlora", "lora.rank=4", "loss.loss_type=dr_grpo", "loss.correction=acr"]),
]


@pytest.mark.parametrize("name,overrides", FLOWS, ids=[f[0] for f in FLOWS])
def test_each_flow_trains_end_to_end(tmp_path, name, overrides):
    cfg = make_cfg(tmp_path, *overrides, "loss.kl_coef=0.01" if name == "bf16" else "train.epochs=2")
    trainer = make_trainer(cfg, arch="qwen2" if "qlora" in name else "llama")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    summary = trainer.train()
    assert summary["step"] == 2
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward/mean", "mismatch/kl", "mismatch/k3_kl", "mismatch/max_abs_logp_diff", "is/weight_mean",
                "clip/frac_low", "clip/frac_high", "policy/entropy", "time/sync_s", "time/rollout_s",
                "time/train_s", "rollout/tokens_per_s", "train/loss"):
        assert key in records[-1] and records[-1][key] is not None and math.isfinite(records[-1][key]), key
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "no trainable parameter changed"
    if name == "bf16":
        # bf16 flow: rollout and training run the same computation, so the measured mismatch is ~0.
        assert records[0]["mismatch/max_abs_logp_diff"] < 1e-4
        assert "policy/kl_ref" in records[-1]
    if name.startswith("unified"):
        # rollout and training forward compute the same quantized function (the backward does not matter here)
        assert records[0]["mismatch/max_abs_logp_diff"] < 1e-4
        assert all(trainer.model.get_submodule(n).quantized_backward == ("quantized-backward" in name)
                   for n in trainer.quantized_linears)
    if name.startswith("split-int8"):
        assert records[0]["mismatch/max_abs_logp_diff"] > 1e-4  # quantized rollout really differs
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = make_trainer(make_cfg(tmp_path, "train.steps=4", name="full"))
    full.train()
    part = make_trainer(make_cfg(tmp_path, "train.steps=4", "output.checkpoint_every=2", name="part"))
    part.cfg.train.steps = 2  # stop early, as if the job had been killed after step 2's checkpoint
    part.train()
    cfg = make_cfg(tmp_path, "train.steps=4", "output.checkpoint_every=2", name="part")
    cfg.resume = str(tmp_path / "part")
    make_trainer(cfg).train()
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "train/loss", "mismatch/kl", "train/grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def test_ctrl_c_saves_a_checkpoint_and_stops(tmp_path):
    INTERRUPT_AT_CALL.update(n=3, calls=0)  # during step 1's rollout scoring
    cfg = make_cfg(tmp_path, "train.steps=5", "output.checkpoint_every=100",
                   f"reward.function={__name__}:interrupting_reward")
    summary = make_trainer(cfg).train()
    assert summary.get("interrupted") and summary["step"] == 1
    assert (tmp_path / "run" / "checkpoints" / "step_000001.pt").is_file()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]


def test_lora_adapters_export_to_peft(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from quarl.export import export_peft_adapters
    from quarl.model.loading import save_pretrained

    cfg = make_cfg(tmp_path, "lora.rank=4", "lora.alpha=8", "train.lr=1e-2")
    trainer = make_trainer(cfg)
    save_pretrained(trainer.model, trainer.tokenizer, tmp_path / "base")  # adapters are still zero: the base
    trainer.train()
    export_peft_adapters(trainer.model, cfg.lora, str(tmp_path / "base"), tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 10))
    base_logits = base(input_ids=ids).logits  # before PEFT injects the adapters into `base` in place
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    trainer.model.eval()
    ours = trainer.model(ids)
    theirs = with_adapter(input_ids=ids).logits
    effect = (ours - base_logits).abs().max().item()
    assert effect > 1e-4  # the trained adapters change the output ...
    assert (theirs - ours).abs().max().item() < effect / 100  # ... and PEFT reproduces that change (float32)


def test_lr_schedule():
    assert lr_factor(0, 10, 2, "constant") == 0.5 and lr_factor(1, 10, 2, "constant") == 1.0
    assert lr_factor(2, 10, 2, "cosine") == pytest.approx(1.0)
    assert lr_factor(10, 10, 2, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(6, 10, 2, "linear") == pytest.approx(0.5)


def test_cli_reports_config_errors(tmp_path, capsys):
    from quarl.cli import main

    assert main(["train", "train.stepz=3"]) == 2
    assert "did you mean train.steps" in capsys.readouterr().err


class ScriptedEngine:
    """A stand-in engine that returns scripted answer texts (one list of groups per generate call); answers of
    8 characters count as cut at max_new_tokens. Under digit_reward, a group of letters only has equal rewards."""

    def __init__(self, scripts):
        self.scripts = list(scripts)  # one list of per-prompt answer texts per generate() call
        self.calls = 0

    def generate(self, prompts, n, **kw):
        from quarl.rollout.engine import Completion, RequestOutput

        texts = self.scripts[self.calls]
        self.calls += 1
        outs = []
        for prompt, group in zip(prompts, texts):
            comps = [Completion(token_ids=[ord(ch) for ch in t], text=t, logprobs=[-0.5] * len(t),
                                finish_reason="length" if len(t) >= 8 else "eos") for t in group]
            outs.append(RequestOutput(prompt=prompt, prompt_token_ids=[65, 66], completions=comps))
        return outs


def test_dynamic_sampling_refills_and_overlong_filter_masks(tmp_path):
    cfg = make_cfg(tmp_path, "train.dynamic_sampling=true", "train.max_refills=2", "train.overlong_filter=true",
                   "rollout.max_new_tokens=8", "loss.loss_type=dapo")
    trainer = make_trainer(cfg)
    same, mixed, long_mixed = ["aaaa"] * 4, ["11111111", "a", "1a", "aa"], ["1" * 8, "a" * 8, "1b", "b"]
    # call 1: one informative group of two; refill 1: still nothing; refill 2: one more informative group
    trainer.engine = ScriptedEngine([[same, mixed], [same], [long_mixed]])
    examples, outputs, rewards, sampled, tokens, rounds = trainer.rollout(step=0)
    assert rounds == 3 and len(examples) == 2 and trainer.engine.calls == 3
    assert [o.completions[0].text for o in outputs] == ["11111111", "1" * 8]
    assert len(sampled) == 4 * 4  # reward/mean covers every sampled answer, dropped groups included
    batch, stats = trainer.assemble(outputs, rewards)
    # rows cut at max_new_tokens ("length") are dropped from the loss; the others count
    counted = batch.answer_mask.sum(1).tolist()
    assert counted == [0.0, 1.0, 2.0, 2.0, 0.0, 0.0, 2.0, 1.0]
    assert stats["rollout/truncated_frac"] == pytest.approx(3 / 8)
    torch.testing.assert_close(batch.advantages[:4].sum(), torch.tensor(0.0), atol=1e-5, rtol=0)


def test_a_fresh_run_moves_an_earlier_run_aside(tmp_path):
    make_trainer(make_cfg(tmp_path, "train.steps=1")).train()
    (tmp_path / "run" / "marker.txt").write_text("earlier run")
    make_trainer(make_cfg(tmp_path, "train.steps=1")).train()
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.prev-")]
    assert len(moved) == 1 and (moved[0] / "marker.txt").read_text() == "earlier run"
    assert (moved[0] / "checkpoints" / "step_000001.pt").is_file()  # nothing of the earlier run was deleted
    assert not (tmp_path / "run" / "marker.txt").exists()


def test_proximal_scoring_has_no_lora_dropout(tmp_path):
    # bf16 flow: rollout and training compute the same function, so any mismatch would come from dropout noise
    cfg = make_cfg(tmp_path, "lora.rank=4", "lora.dropout=0.5", "train.lr=5e-2", "train.steps=3")
    make_trainer(cfg).train()
    for record in read_metrics(tmp_path / "run"):
        assert record["mismatch/max_abs_logp_diff"] < 1e-4, record["step"]


def test_evaluation_uses_fresh_weights_without_noise(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, "precision.flow=split", "precision.format=int8", "aqn.sigma_start=0.05",
                   "aqn.sigma_end=0.01", "aqn.stages=2", "eval.after=true")
    trainer = make_trainer(cfg)
    seen = {}

    def spy_evaluate(engine, task, examples, **kw):
        if trainer.model.model.layers[0].self_attn.q_proj.rollout_format is None:
            seen["full_precision_evals"] = seen.get("full_precision_evals", 0) + 1  # eval.full_precision
            return {"accuracy": 0.0}
        norms = [m.rollout_noise for m in trainer.model.modules() if hasattr(m, "rollout_noise")]
        seen["noise"] = max(float(n.abs().max()) for n in norms)
        layer = trainer.model.model.layers[0].self_attn.q_proj
        from quarl.formats import quantize

        w = layer.weight.detach()  # times the SmoothQuant factors, int8 W8A8's default
        fresh = quantize(w if layer.rollout_smoothing is None else w * layer.rollout_smoothing, "int8")
        seen["stale"] = float((layer.qweight.dequantize() - fresh.dequantize()).abs().max())
        return {"accuracy": 0.0}

    monkeypatch.setattr("quarl.rl.trainer.evaluate", spy_evaluate)
    trainer.train()
    assert seen == {"noise": 0.0, "stale": 0.0, "full_precision_evals": 1}


def test_local_training_file_needs_a_held_out_source(tmp_path):
    from quarl.config import DataSection, RewardSection
    from quarl.tasks.task import load_task

    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n')
    with pytest.raises(ValueError, match="data.eval"):
        load_task(DataSection(train=str(path)), RewardSection(), tiny_tokenizer())
    task = load_task(DataSection(train=str(path), eval=str(path)), RewardSection(), tiny_tokenizer())
    assert len(task.train_examples) == 1 and task.correct("the answer is 2", task.eval_examples[0])


@pytest.mark.parametrize("flow", [[], ["precision.flow=split", "precision.format=int8"],
                                  ["precision.flow=unified", "precision.format=fp8-block"]])
def test_proximal_from_the_update_equals_a_separate_scoring_pass(tmp_path, flow):
    """One optimizer step per batch: π_prox read off the update's forward gives the same metrics, losses and
    weights as scoring it in a separate forward (train.recompute_proximal=true)."""
    runs = {}
    for recompute in (False, True):
        name = f"r{int(recompute)}"
        trainer = make_trainer(make_cfg(tmp_path, *flow, f"train.recompute_proximal={str(recompute).lower()}",
                                        name=name))
        assert trainer.proximal_from_update(8) is not recompute
        trainer.train()
        runs[recompute] = (read_metrics(tmp_path / name), dict(trainer.model.named_parameters()))
    (fast, w_fast), (slow, w_slow) = runs[False], runs[True]
    keys = ["mismatch/kl", "mismatch/max_abs_logp_diff", "policy/entropy", "train/loss", "train/grad_norm"]
    for a, b in zip(fast, slow):
        for k in keys:
            assert math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-9), (k, a[k], b[k])
    for name, p in w_fast.items():
        torch.testing.assert_close(p, w_slow[name], rtol=1e-6, atol=1e-7)


def test_proximal_needs_its_own_forward_when_the_weights_move_within_a_batch(tmp_path):
    for extra in (["train.epochs=2"], ["train.mini_batch_size=4"], ["lora.rank=4", "lora.dropout=0.1"],
                  ["loss.correction=bypass"]):
        trainer = make_trainer(make_cfg(tmp_path, *extra, name="x" + str(len(extra[0]))))
        assert not trainer.proximal_from_update(8), extra


def test_group_by_length_cuts_micro_batches_longest_first_and_trains_the_same(tmp_path):
    """Micro-batches cut from the rows sorted by length pad less; the update is the same up to summation order."""
    trained = {}
    for group in (True, False):
        cfg = make_cfg(tmp_path, f"train.group_by_length={str(group).lower()}", "train.steps=1", "data.max_operand=99",
                       "train.recompute_proximal=true",
                       "rollout.max_new_tokens=8", name=f"group-{group}")
        trainer = make_trainer(cfg)
        masks = []
        cut = trainer.micro_batches
        trainer.micro_batches = lambda rows, size, mask=None: masks.append(mask) or cut(rows, size, mask)
        trainer.train()
        assert len(masks) >= 2 and all(m is not None for m in masks)  # scoring and the update both hand the mask
        trained[group] = read_metrics(tmp_path / f"group-{group}")[-1]
        lengths = torch.tensor([5, 9, 2, 9, 7, 3, 8])
        mask = (torch.arange(10)[None, :] >= 10 - lengths[:, None]).long()  # left-padded rows
        chunks = [rows for rows, idle in trainer.micro_batches(torch.arange(7), 3, mask)]
        assert torch.equal(torch.cat(chunks).sort().values, torch.arange(7))  # every row once
        padded = sum(len(rows) * int(lengths[rows].max()) for rows in chunks)
        if group:
            assert [lengths[rows].tolist() for rows in chunks] == [[9, 9, 8], [7, 5, 3], [2]]
            assert padded == 3 * 9 + 3 * 7 + 2
        else:
            assert [rows.tolist() for rows in chunks] == [[0, 1, 2], [3, 4, 5], [6]] and padded == 3 * 9 + 3 * 9 + 8
    # the same rollouts and gradient norm (AdamW's first step moves each weight by about ±lr whatever the gradient's
    # size, so near-zero gradient entries summed in another order are not comparable weight by weight; the GRPO
    # loss itself is a cancellation near 0, float32 noise in any order)
    for key in ("reward/mean", "train/grad_norm", "mismatch/kl"):
        assert trained[True][key] == pytest.approx(trained[False][key], rel=1e-5, abs=1e-10), key


@pytest.mark.parametrize("fmt", ["int8", "fp8"])  # stackable at the tiny model's widths (fp8-block needs 128s)
def test_unified_minibatches_train_on_the_stacked_rollout_copies_refreshed_between_optimizer_steps(tmp_path, fmt,
                                                                                                   monkeypatch):
    """The unified training forward multiplies the rollout copies, which the fast engine stacks (q/k/v and gate/up
    share one buffer). With several optimizer steps per batch the copies are re-quantized all at once between
    minibatches: no backward finds a neighbour's in-place re-quantization under its saved operand, and each
    minibatch multiplies the weights as they are after the previous step."""
    from quarl.model.qlinear import QuantLinear

    stale = []  # a training forward that found its rollout copy behind its weight
    real = QuantLinear._fake_quantized_weight
    monkeypatch.setattr(QuantLinear, "_fake_quantized_weight",
                        lambda self, dtype: stale.append(not self._rollout_copy_current()) or real(self, dtype))
    cfg = make_cfg(tmp_path, "precision.flow=unified", f"precision.format={fmt}", "rollout.engine=fast",
                   "train.mini_batch_size=4")
    trainer = make_trainer(cfg)
    trainer.train()
    assert stale and not any(stale)  # every minibatch's forwards found their copies current
    attn = trainer.model.model.layers[0].self_attn
    storage = lambda m: m.weight_dequant.untyped_storage().data_ptr()  # noqa: E731
    assert storage(attn.q_proj) == storage(attn.k_proj) == storage(attn.v_proj)  # the copies were stacked
    assert [r["train/optimizer_steps"] for r in read_metrics(tmp_path / "run")] == [2, 2]
