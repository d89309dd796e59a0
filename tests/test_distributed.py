"""Runs on many processes (torchrun, gloo on the CPU, FSDP2): the same as one process, resumable on another number
of ranks, and a killed rank stops the whole job with nothing half written (docs/DISTRIBUTED.md).

Every run here is a real `python -m torch.distributed.run --standalone` (a free port each) of
tests/distributed_worker.py or of `quarl train --nproc`, on the tiny random Llama, 4 prompts x 4 answers a step.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from quarl.rl.sharded_checkpoint import sharded_checkpoints, verify_sharded

pytestmark = pytest.mark.slow  # real torchrun launches (several processes per test)

ROOT = Path(__file__).resolve().parent.parent
REWARD = '''def digit_reward(completion, example):
    return sum(ch.isdigit() for ch in completion[:8]) / 8.0
'''


def overrides(tmp: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        "model.name=tiny-random-llama", "model.device=cpu", "data.train=arithmetic", "data.max_operand=9",
        "data.num_train=40", "data.num_eval=4", f"reward.function={tmp / 'reward.py'}:digit_reward",
        "rollout.prompts_per_step=4", "rollout.num_generations=4", "rollout.max_new_tokens=6",
        f"train.steps={steps}", "train.lr=1e-3", "train.micro_batch_size=3", "train.seed=3",
        "eval.before=false", "eval.after=false", "output.tensorboard=false", "output.progress=false",
        "output.checkpoint_every=1", "output.keep_checkpoints=5", f"output.dir={run_dir}", *extra,
    ]


# The unified flow: rollout and training forward both quantize (INT8 W8A8), so a rollout copy that follows the
# trained weights gives behaviour log-probs equal to the training forward's, and the sync quantizes gathered shards.
UNIFIED = ("precision.flow=unified", "precision.format=int8", "precision.weight_only=false")
# Held-out evals before training and after every step but the last, two sampled answers per problem (4 problems).
EVAL = ("eval.before=true", "eval.after=false", "eval.every=1", "eval.n=2", "eval.temperature=0.7")


def env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1"}


def torchrun(nproc: int, record: Path, args: list[str]) -> dict:
    """Run the worker on `nproc` processes; returns its record (see tests/distributed_worker.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "distributed_worker.py"), str(record), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(record, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One rank for 3 steps and two ranks for 2 steps, same global batch; then the two-rank run resumed on one
    rank for its third step."""
    tmp = tmp_path_factory.mktemp("dist")
    (tmp / "reward.py").write_text(REWARD)
    one = torchrun(1, tmp / "one.pt", overrides(tmp, tmp / "one", 3, *UNIFIED, *EVAL))
    two = torchrun(2, tmp / "two.pt", overrides(tmp, tmp / "two", 2, *UNIFIED, *EVAL, "output.export_hf=true"))
    resumed = torchrun(1, tmp / "resumed.pt", overrides(tmp, tmp / "two", 3, *UNIFIED, f"resume={tmp / 'two'}"))
    return {"one": one, "two": two, "resumed": resumed, "tmp": tmp}


def tokens(rollout):
    return [[ids for ids, _ in group] for group in rollout]


def logprobs(rollout):
    return torch.tensor([x for group in rollout for _, lps in group for x in lps], dtype=torch.float64)


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_two_ranks_equal_one_rank(runs):
    one, two = runs["one"], runs["two"]
    # the weights move far more than the tolerance below, so equal weights are not equal by standing still
    assert max_weight_diff(one["start"], one["weights"][2]) > 1e-3
    assert max_weight_diff(one["start"], two["start"]) == 0.0
    for step in (1, 2):
        # rollouts: the same tokens; behaviour log-probs equal up to the order gradients were summed in
        assert tokens(one["rollouts"][step]) == tokens(two["rollouts"][step]), f"step {step}"
        assert torch.allclose(logprobs(one["rollouts"][step]), logprobs(two["rollouts"][step]), atol=1e-5, rtol=0)
        # float32 gradients summed over other micro-batch splits: 1e-5 absolute on weights of size ~0.1-1
        assert max_weight_diff(one["weights"][step], two["weights"][step]) < 1e-5, f"step {step}"
        m1, m2 = one["metrics"][step], two["metrics"][step]
        for key in ("reward/mean", "reward/std", "groups/kept", "rollout/answer_len_mean", "train/optimizer_steps"):
            assert m1[key] == m2[key], key
        for key in ("train/grad_norm", "policy/entropy", "policy/ratio_mean", "is/weight_mean"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=1e-6)
        # the rollout copy follows the trained weights: the unified flow's behaviour log-probs equal the training
        # forward's up to float32 rounding (a copy left at the step-1 weights differs by 0.2 at step 2)
        assert m1["mismatch/max_abs_logp_diff"] < 1e-5 and m2["mismatch/max_abs_logp_diff"] < 1e-5


def test_ranks_share_the_held_out_eval_and_agree_with_one_rank(runs):
    def eval_rows(run):
        rows = [json.loads(line) for line in (runs["tmp"] / run / "eval_samples.jsonl").read_text().splitlines()]
        return [(r["step"], r["id"], r["completions"], r["scores"]) for r in rows if r["eval"] == "eval"]

    one, two = eval_rows("one"), eval_rows("two")
    assert len(two) == 2 * 4 and len({c for _, _, cs, _ in two for c in cs}) > 1  # two evals, varied answers
    assert one[:len(two)] == two  # the same sampled answers and scores, problem by problem
    assert runs["two"]["eval_problems"] == [2, 2] and runs["one"]["eval_problems"][:2] == [4, 4]  # rank 0's share


def test_the_export_holds_the_gathered_weights(runs):
    from safetensors.torch import load_file

    exported = load_file(str(runs["tmp"] / "two" / "export" / "hf" / "model.safetensors"))
    weights = runs["two"]["weights"][2]
    common = [k for k in weights if k in exported]
    assert len(common) >= len(weights) - 1  # all of them (lm_head may be tied to the embeddings)
    for k in common:  # float32 masters rounded once to the export's bf16
        assert torch.equal(exported[k], weights[k].to(torch.bfloat16)), k


def test_rank_zero_alone_writes_the_run_files(runs):
    run = runs["tmp"] / "two"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    # the eval before training, the two ranks' steps 1-2, the resume's step 3: one line each
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3]
    assert (run / "config.yaml").is_file()
    assert "time/sync_s" in json.loads(lines[1])


def test_a_two_rank_checkpoint_resumes_on_one_rank(runs):
    one, two, resumed = runs["one"], runs["two"], runs["resumed"]
    # the sharded float32 masters come back exactly, then step 3 goes on as the one-rank run did
    assert max_weight_diff(resumed["start"], two["weights"][2]) == 0.0
    assert list(resumed["rollouts"]) == [3]
    assert tokens(resumed["rollouts"][3]) == tokens(one["rollouts"][3])
    assert max_weight_diff(resumed["weights"][3], one["weights"][3]) < 2e-5
    folders = sharded_checkpoints(runs["tmp"] / "two")
    assert [f.name for f in folders] == ["step_000001.dcp", "step_000002.dcp", "step_000003.dcp"]
    assert all(verify_sharded(f) is None for f in folders)
    meta = [json.loads((f / "quarl.json").read_text()) for f in folders]
    assert [m["world_size"] for m in meta] == [2, 2, 1]


def test_a_one_rank_checkpoint_resumes_on_two_ranks(runs, tmp_path):
    """One rank keeps the one-process model and optimizer (no FSDP); its checkpoints hold the state dicts of a
    sharded run's (float32 masters, AdamW moments and step by parameter name), so two ranks resume from its step-2
    checkpoint and step 3 goes on as the one-rank run did (wrong moments or step counts would move it further)."""
    import shutil

    run = tmp_path / "one"
    shutil.copytree(runs["tmp"] / "one", run, ignore=shutil.ignore_patterns("step_000003.dcp", ".quarl.lock"))
    again = torchrun(2, tmp_path / "again.pt", overrides(runs["tmp"], run, 3, *UNIFIED, f"resume={run}"))
    assert max_weight_diff(again["start"], runs["one"]["weights"][2]) == 0.0
    assert list(again["rollouts"]) == [3]
    assert tokens(again["rollouts"][3]) == tokens(runs["one"]["rollouts"][3])
    assert max_weight_diff(again["weights"][3], runs["one"]["weights"][3]) < 2e-5
    assert max_weight_diff(again["weights"][3], runs["one"]["weights"][2]) > 1e-3


@pytest.mark.parametrize("case", ["tied-embeddings", "qlora"])
def test_a_one_rank_checkpoint_of_tied_or_qlora_models_resumes_on_two_ranks(case, tmp_path):
    """The sharded run's state dicts name a tied embedding twice (embed_tokens and lm_head) and keep a qlora base's
    codes (buffers): a one-rank checkpoint holds them too, so two ranks load it and start where it ended."""
    from quarl.model.decoder import QuarlForCausalLM
    from quarl.model.loading import save_pretrained
    from quarl.model.tiny import tiny_config, tiny_tokenizer

    (tmp_path / "reward.py").write_text(REWARD)
    if case == "tied-embeddings":
        from tiny_models import randomize_

        torch.manual_seed(0)  # O(1) logits: varied answers, so the groups' rewards differ and step 1 trains
        model = randomize_(QuarlForCausalLM(tiny_config("llama", tie_word_embeddings=True)))
        assert model.lm_head.weight is model.model.embed_tokens.weight
        extra = [f"model.name={save_pretrained(model, tiny_tokenizer(), str(tmp_path / 'tied'))}"]
    else:
        extra = ["precision.flow=qlora", "precision.format=int8", "lora.rank=4"]
    run = tmp_path / "run"
    one = torchrun(1, tmp_path / "one.pt", overrides(tmp_path, run, 1, *extra))
    two = torchrun(2, tmp_path / "two.pt", overrides(tmp_path, run, 2, *extra, f"resume={run}"))
    assert max_weight_diff(two["start"], one["weights"][1]) == 0.0
    assert max_weight_diff(one["start"], one["weights"][1]) > 1e-4  # step 1 moved the weights
    assert list(two["rollouts"]) == [2]


def test_a_fresh_qlora_run_on_two_ranks_calibrates_the_gptq_base_of_one_rank(tmp_path):
    """A fresh sharded qlora run calibrates its GPTQ base on every rank (the Hessians averaged over ranks): the base
    it saves equals the one-rank run's bit for bit, and so do the rollouts and the trained adapters' first step."""
    from safetensors.torch import load_file

    from quarl.model.gptq import BASE_CODES_FILE

    (tmp_path / "reward.py").write_text(REWARD)
    extra = ["precision.flow=qlora", "precision.format=nvfp4", "lora.rank=4"]
    one = torchrun(1, tmp_path / "one.pt", overrides(tmp_path, tmp_path / "one", 1, *extra))
    two = torchrun(2, tmp_path / "two.pt", overrides(tmp_path, tmp_path / "two", 1, *extra))
    base_one, base_two = (load_file(str(tmp_path / run / BASE_CODES_FILE)) for run in ("one", "two"))
    assert base_one.keys() == base_two.keys() and len(base_one) > 0
    assert all(torch.equal(base_one[k], base_two[k]) for k in base_one)
    assert tokens(two["rollouts"][1]) == tokens(one["rollouts"][1])
    assert max_weight_diff(one["start"], one["weights"][1]) > 1e-4  # the step moved the adapters
    assert max_weight_diff(two["weights"][1], one["weights"][1]) < 1e-5


def test_a_mixture_of_experts_trains_on_two_ranks_as_on_one(tmp_path):
    """Each rank routes its own tokens, so an expert may get rows on one rank and none on the other; FSDP reduces a
    layer's gradients as one collective over the same parameters on every rank, so the per-expert path gives idle
    experts a zero gradient there (without it the ranks' collectives differ in size and the job dies). Step 1
    equals the one-rank run (AdamW moves no weight on a zero first gradient)."""
    # any varied text scores differently: the groups' rewards differ even where a random model writes no digits
    (tmp_path / "reward.py").write_text("def digit_reward(completion, example):\n"
                                        "    return sum(map(ord, completion)) % 7 / 6\n")
    moe = ["model.name=tiny-random-qwen3-moe"]
    one = torchrun(1, tmp_path / "one.pt", overrides(tmp_path, tmp_path / "one", 1, *moe))
    two = torchrun(2, tmp_path / "two.pt", overrides(tmp_path, tmp_path / "two", 2, *moe))
    assert tokens(two["rollouts"][1]) == tokens(one["rollouts"][1])
    assert max_weight_diff(one["start"], one["weights"][1]) > 1e-3
    assert max_weight_diff(two["weights"][1], one["weights"][1]) < 1e-5
    assert two["metrics"][2]["train/optimizer_steps"] == 1


def test_smoothed_int8_rollouts_on_two_ranks_equal_one_rank(tmp_path):
    """SmoothQuant on many ranks: each rank calibrates the whole model before sharding (maximum over ranks), the
    rollout copy is made as Q(W diag(s)) and every sync quantizes the gathered weights times s. Rollouts, behaviour
    log-probs, the rollout/training mismatch and the weights equal the one-rank run's; a run without smoothing
    has another mismatch, so the comparison sees whether the factors reached the copy."""
    (tmp_path / "reward.py").write_text(REWARD)
    split = ("precision.flow=split", "precision.format=int8", "precision.smooth_alpha=0")
    smooth = ("precision.flow=split", "precision.format=int8")  # int8 W8A8 rollouts smooth by default
    one = torchrun(1, tmp_path / "one.pt", overrides(tmp_path, tmp_path / "one", 2, *smooth))
    two = torchrun(2, tmp_path / "two.pt", overrides(tmp_path, tmp_path / "two", 2, *smooth))
    plain = torchrun(1, tmp_path / "plain.pt", overrides(tmp_path, tmp_path / "plain", 1, *split))
    for step in (1, 2):
        assert tokens(one["rollouts"][step]) == tokens(two["rollouts"][step]), f"step {step}"
        assert torch.allclose(logprobs(one["rollouts"][step]), logprobs(two["rollouts"][step]), atol=1e-5, rtol=0)
        assert two["metrics"][step]["mismatch/kl"] == pytest.approx(one["metrics"][step]["mismatch/kl"], rel=1e-3,
                                                                    abs=1e-7)
        assert max_weight_diff(one["weights"][step], two["weights"][step]) < 1e-5, f"step {step}"
    assert abs(plain["metrics"][1]["mismatch/kl"] - one["metrics"][1]["mismatch/kl"]) > \
        1e-3 * one["metrics"][1]["mismatch/kl"]


def test_a_damaged_sharded_checkpoint_is_not_intact(runs, tmp_path):
    import shutil

    copy = tmp_path / "step_000002.dcp"
    shutil.copytree(runs["tmp"] / "two" / "checkpoints" / "step_000002.dcp", copy)
    assert verify_sharded(copy) is None
    shard = next(p for p in copy.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "checksum" in verify_sharded(copy)
    (copy / "quarl.json").unlink()
    assert "quarl.json" in verify_sharded(copy)


def test_resume_skips_a_damaged_sharded_checkpoint(runs, tmp_path):
    """A flipped byte in the newest checkpoint of the two-rank run: resuming on two ranks warns, takes step 1's
    checkpoint (whose weights come back exactly) and trains step 2 again with the same rollouts."""
    import shutil

    run = tmp_path / "two"
    shutil.copytree(runs["tmp"] / "two", run, ignore=shutil.ignore_patterns("step_000003.dcp", ".quarl.lock"))
    shard = next(p for p in (run / "checkpoints" / "step_000002.dcp").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    again = torchrun(2, tmp_path / "again.pt", overrides(runs["tmp"], run, 2, *UNIFIED, f"resume={run}"))
    assert max_weight_diff(again["start"], runs["two"]["weights"][1]) == 0.0
    assert list(again["rollouts"]) == [2]
    assert tokens(again["rollouts"][2]) == tokens(runs["two"]["rollouts"][2])


def rank_process(marker: str, rank: int) -> int | None:
    """The pid of the worker process of `rank` whose command line holds `marker`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in cmdline and f"RANK={rank}".encode() in environ and b"LOCAL_RANK" in b" ".join(environ):
            return int(entry.name)
    return None


def test_nproc_must_be_positive(capsys):
    from quarl.cli import main

    assert main(["train", "--nproc", "0", "model.device=cpu"]) == 2
    assert "--nproc must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank's process through /proc")
def test_killing_one_rank_stops_the_job_cleanly(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "quarl", "train", "--nproc", "2", *overrides(tmp_path, run, 500)]
    job = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step_000002.dcp").is_dir():
            assert job.poll() is None and time.monotonic() < deadline, "the job did not reach step 2"
            time.sleep(0.2)
        pid = rank_process(str(run), 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "quarl train: error: the 2-process job stopped" in err
    # every checkpoint folder in place is whole (a save cut short stays a hidden .tmp folder), every metrics line
    # is a complete record, and the run resumes from the newest checkpoint
    folders = sharded_checkpoints(run)
    assert len(folders) >= 2 and all(verify_sharded(f) is None for f in folders)
    names = {p.name for p in (run / "checkpoints").iterdir()}
    assert all(n.endswith(".dcp") or n.endswith(".dcp.tmp") for n in names), names
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2


def test_ctrl_c_stops_every_rank_after_saving_the_step(tmp_path):
    """Ctrl-C in a terminal reaches the launcher, torchrun and every rank (torchrun then sends it again): the ranks
    finish the step, save it and stop; `quarl train --nproc` exits 130."""
    (tmp_path / "reward.py").write_text(REWARD)
    run = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "quarl", "train", "--nproc", "2", *overrides(tmp_path, run, 500)]
    # its own process group, as a terminal's foreground job, with Ctrl-C's default action: a shell starts
    # background jobs (a CI runner's, say) with SIGINT ignored, and Python keeps an inherited SIG_IGN
    job = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step_000002.dcp").is_dir():
            assert job.poll() is None and time.monotonic() < deadline, "the job did not reach step 2"
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGINT)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, err[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    assert steps == list(range(1, last + 1))
    assert sharded_checkpoints(run)[-1].name == f"step_{last:06d}.dcp"  # the interrupted step was saved
    assert verify_sharded(sharded_checkpoints(run)[-1]) is None
    assert f"stopped after step {last}" in out


@pytest.mark.gpu
def test_gpu_ranks_nccl_match_one_rank_and_the_plain_run(tmp_path):
    """NCCL, bf16 compute (FSDP mixed precision), the fast engine with CUDA graphs: one rank under torchrun against
    the plain single-process run (both train; their step times are printed, not asserted), and, with 2 GPUs, two
    ranks against one: the same step-1 tokens (identical weights) and weights within bf16 rounding after step 2."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (tmp_path / "reward.py").write_text(REWARD)
    args = lambda name: [a.replace("model.device=cpu", "model.device=cuda")  # noqa: E731
                         for a in overrides(tmp_path, tmp_path / name, 2, "precision.flow=split",
                                            "precision.format=int8")]
    plain = subprocess.run([sys.executable, str(ROOT / "tests" / "distributed_worker.py"), str(tmp_path / "plain.pt"),
                            *args("plain")], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-4000:]
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    one = torchrun(1, tmp_path / "one.pt", args("one"))
    for run in (plain, one):
        assert run["metrics"][2]["train/optimizer_steps"] == 1
        assert run["metrics"][2]["mismatch/kl"] < 0.05  # INT8 rollouts against the bf16 training forward
    print("step time s (plain, torchrun 1 rank):", plain["metrics"][2]["time/step_s"], one["metrics"][2]["time/step_s"])
    if torch.cuda.device_count() >= 2:
        two = torchrun(2, tmp_path / "two.pt", args("two"))
        assert tokens(two["rollouts"][1]) == tokens(one["rollouts"][1])
        for k in one["weights"][2]:  # float32 masters; bf16 gradients summed in another order
            torch.testing.assert_close(two["weights"][2][k], one["weights"][2][k], atol=2e-4, rtol=0)
