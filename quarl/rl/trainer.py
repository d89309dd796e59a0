"""The RL training loop (BRIEF §1). Read `Trainer.step` top to bottom: it is the table of contents of quarl.

    sync (re-quantize + AQN) -> rollout (behaviour log-probs) -> rewards -> advantages
    -> proximal (+ reference) log-probs [-> critic: V_old, GAE advantages and returns]
    -> clipped objective with a mismatch correction [+ clipped value loss] -> optimizer steps
    -> metrics, samples, checkpoint
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import math
import os
import shutil
import signal
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import yaml

from quarl import distributed as qdist
from quarl.config import RunConfig, config_to_dict, load_config, saved_run
from quarl.devices import resolve_device, set_cpu_threads
from quarl.fallbacks import reported_fallbacks
from quarl.kernels.tuning import TUNING_FILE_ENV, current_tables
from quarl.model import gptq
from quarl.model.layers import Attention
from quarl.model.moe import ExpertRouting, SparseMoeBlock, routing_mismatch
from quarl.model.precision_apply import apply_precision, full_precision, hidden_size, refresh_rollout_weights
from quarl.model.qlinear import QuantLinear
from quarl.model.rollout_sync import RolloutSync
from quarl.precision import KERNEL_FORWARD_MIN_HIDDEN
from quarl.rl.aqn import aqn_sigma, set_aqn_noise
from quarl.rl.advantages import dynamic_sampling_keep, group_advantages, overlong_penalty
from quarl.rl.batch import RolloutBatch, answer_logprobs, build_batch
from quarl.rl.checkpoint import atomic_write_bytes, load_latest_intact, save_checkpoint
from quarl.rl.critic import Critic
from quarl.rl.sharded_checkpoint import load_latest_sharded, save_sharded_checkpoint
from quarl.rl.error_tokens import guard_error_answers
from quarl.rl.evaluate import evaluate, metrics_of_records
from quarl.rl.master_weights import MasterWeightAdamW
from quarl.rl.mismatch import mismatch_metrics
from quarl.rl.mismatch_alarms import MismatchAlarms
from quarl.rl.objectives import get_correction, policy_loss
from quarl.rl.run_log import RunLog
from quarl.rl.sharding import (ShardedRolloutSync, drop_unused_rollout_buffers, local_part, make_rollout_copy,
                               shard_model)
from quarl.rl.uaq import apply_uaq
from quarl.tasks.task import TaskData, load_task


def group_seed(round_seed: int, prompt_index: int) -> int:
    """The sampling seed of one group on many ranks: a function of the round's seed (run seed, step, refill
    attempt) and the prompt's index in the round, never of the rank."""
    return (round_seed * 1_000_033 + prompt_index * 7_919 + 1) % (2**62)


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the base learning rate at RL step `step` (0-based): linear warm-up, then the schedule."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return max(0.0, 1.0 - progress)  # linear


def make_engine(model, tokenizer, cfg: RunConfig, device: torch.device):
    """The fast engine (slot KV cache, CUDA graphs) on a GPU or with an FP8 KV cache, the reference engine on a CPU,
    unless configured. Serving a MoE model, either engine records each token's experts (router replay and the
    routing-mismatch metrics)."""
    from quarl.rollout.engine import RolloutEngine
    from quarl.rollout.fast_engine import FastRolloutEngine

    moe = getattr(model, "is_moe", False)
    kind = cfg.rollout.engine
    if kind == "auto":  # an FP8 KV cache exists in the fast engine only (which also runs on a CPU)
        kind = "fast" if device.type == "cuda" or cfg.precision.kv_cache != "auto" else "reference"
    if kind == "reference":
        if cfg.precision.kv_cache != "auto":
            raise ValueError(f"precision.kv_cache={cfg.precision.kv_cache} needs rollout.engine=fast")
        return RolloutEngine(model, tokenizer, max_batch_size=cfg.rollout.max_batch_size, record_routing=moe)
    return FastRolloutEngine(model, tokenizer, max_batch_size=cfg.rollout.max_batch_size,
                             kv_cache_dtype=cfg.precision.kv_cache, sampler=cfg.rollout.sampler,
                             fast_paths=cfg.fast_paths, record_routing=moe)


class RunStopped(RuntimeError):
    """A run could not go on; the message is one line saying why and what to do (`quarl train` prints it, exit 1)."""


class NonFiniteError(RunStopped):
    """NaN/Inf stopped the run: too many consecutive skipped updates, or non-finite weights."""


class RunDirInUse(RunStopped):
    """Another quarl run holds the run directory's lock."""


class RunDirError(ValueError):
    """output.dir cannot be used: it is under a file, or a non-empty folder that is not a quarl run (exit 2)."""


LOCK_NAME = ".quarl.lock"


def is_run_dir(path: Path) -> bool:
    """Whether a folder holds a quarl run: its lock file (every run since the lock was added writes it first), or
    config.yaml together with metrics.jsonl or a checkpoints/ folder (runs written before)."""
    if (path / LOCK_NAME).is_file():
        return True
    return (path / "config.yaml").is_file() and ((path / "metrics.jsonl").is_file() or (path / "checkpoints").is_dir())


def check_output_dir(run_dir: Path) -> None:
    """RunDirError when output.dir is a file or lies under one (nothing else can be created there)."""
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if not path.is_dir():
                where = "is a file" if path == run_dir else f"lies under {path}, which is a file"
                raise RunDirError(f"output.dir={run_dir} {where}, not a folder; choose another output.dir")
            return


def lock_run_dir(run_dir: Path):
    """Take the run directory's exclusive lock (flock on RUN_DIR/.quarl.lock, non-blocking) and write this process's
    id into it; returns the open file, which holds the lock until it is closed (or the process ends, however it
    ends). RunDirInUse when another run holds it. File systems without flock (some network mounts): a warning, and
    the run goes on unlocked."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    path = run_dir / LOCK_NAME
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            f.close()
            warnings.warn(f"cannot lock {path} ({e.strerror}): two runs into {run_dir} would not be stopped",
                          UserWarning, stacklevel=2)
            return None
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise RunDirInUse(f"{run_dir} is in use by another quarl run (pid {pid}); wait for it to end or choose "
                          "another output.dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def reward_source(spec: str) -> str:
    """The file a "module:function" / "file.py:function" reward spec runs code from (once it has been loaded)."""
    target = spec.rpartition(":")[0]
    if target.endswith(".py") or os.sep in target or "/" in target:
        return os.path.abspath(os.path.expanduser(target))
    module = sys.modules.get(target)
    return getattr(module, "__file__", None) or f"module {target}"


def _finite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """isfinite().all() of every tensor, with one host sync per device."""
    flags: list[bool | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        ok = torch.stack([torch.isfinite(tensors[i]).all() for i in idx]).cpu().tolist()
        for i, v in zip(idx, ok):
            flags[i] = bool(v)
    return flags


class GracefulInterrupt:
    """The first Ctrl-C (SIGINT) or SIGTERM asks the loop to stop after the current step and save a checkpoint;
    `quarl train` then exits with 128 + the signal's number: 130 after Ctrl-C, 143 after SIGTERM (what a shell
    reports for a process ended by that signal). A second one stops at once (KeyboardInterrupt: `quarl train`
    prints one line and exits 130; no checkpoint of the unfinished step)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, echo_s: float = 0.0):
        """echo_s: a repeat of the first signal within this many seconds is the same request delivered twice, not
        a second Ctrl-C (under torchrun a terminal's Ctrl-C reaches a rank directly and again through torchrun)."""
        self.requested = False
        self.signum: int | None = None
        self.echo_s = echo_s
        self._first_at = 0.0
        self._previous: dict = {}

    def _handler(self, signum, frame):
        if self.requested:
            if signum == self.signum and time.monotonic() - self._first_at < self.echo_s:
                return
            raise KeyboardInterrupt
        self._first_at = time.monotonic()
        self.requested = True
        self.signum = signum
        name = "interrupt" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n[quarl] {name}: finishing this step, saving a checkpoint, then exiting (Ctrl-C or SIGTERM again "
              "to abort)", flush=True)

    @contextmanager
    def installed(self):
        self._previous = {}
        try:
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
        try:
            yield self
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            self._previous = {}


class _NoLog:
    """The run log of ranks other than 0: rank 0 alone writes metrics, TensorBoard and samples."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def samples(self, step: int, rows: list) -> None:
        pass

    def eval_samples(self, step: int, rows: list) -> None:
        pass

    def close(self) -> None:
        pass


class Trainer:
    """Owns the model, the rollout engine, the optimizer and the run directory of one training run."""

    def __init__(self, cfg: RunConfig, model=None, tokenizer=None, *, reward_fns=None, reward_weights=None,
                 dataset=None, eval_dataset=None, task: TaskData | None = None):
        """cfg: a validated RunConfig; model / tokenizer: an already loaded model (else cfg.model.name is loaded).
        reward_fns, reward_weights, dataset, eval_dataset: Python callables and data in place of the config's
        reward and data sources (see `quarl.tasks.task.load_task` and `quarl.train`). task: a ready TaskData in
        place of the config's data and reward and of all of these, whose prompts render without this trainer's
        tokenizer (to token ids, as the step benchmark's, or text from a renderer already bound)."""
        from quarl.model.loading import load_model

        self.cfg = cfg
        RunLog.check_installed(cfg.output.report_to)  # a missing tracker fails before the model loads
        if os.environ.get(TUNING_FILE_ENV):
            current_tables()  # a bad user tuning file fails now, not at the first GEMM of the run
        # Under torchrun: one rank per process, the trained model sharded (FSDP2), a full rollout copy per rank
        # (quarl/rl/sharding.py, docs/DISTRIBUTED.md). Without it: one process, one model, as always. One rank under
        # torchrun keeps the one-process model and optimizer (FSDP on one rank only adds its hooks, copies and
        # DTensor dispatch) and the many-rank run's collectives, seeds and sharded (DCP) checkpoints.
        self.distributed = qdist.launched_by_torchrun()
        if self.distributed and cfg.loss.advantage_estimator == "gae":
            raise ValueError("loss.advantage_estimator=gae (PPO with a critic) runs on one process: the critic is not "
                             "sharded over ranks; run it without torchrun / --nproc, or use advantage_estimator=group")
        if self.distributed:
            resolve_device(cfg.model.device)  # the same checks of the name
            self.device = qdist.local_device(cfg.model.device)
            qdist.init_from_env(self.device)
            self.sharded = qdist.world_size() > 1
        else:
            self.device = resolve_device(cfg.model.device)
            self.sharded = False
        if self.sharded and cfg.precision.batch_invariant:
            raise ValueError("precision.batch_invariant runs on one process: the sharded rollout copy and FSDP's "
                             "gathers are not covered; run without torchrun or set precision.batch_invariant=false")
        set_cpu_threads(self.device)
        self.dtype = cfg.precision.torch_dtype(self.device)
        self.is_main = qdist.is_main()
        # Sharded masters are the parameters themselves (float32); the compute dtype is FSDP's mixed precision.
        master_dtype = torch.float32 if self.sharded else self.dtype
        if task is not None and any(x is not None for x in (reward_fns, reward_weights, dataset, eval_dataset)):
            raise ValueError("Trainer(task=...) takes its data and rewards from the task; pass reward_fns, "
                             "reward_weights, dataset and eval_dataset only without it")
        # The data and a user reward function are checked before the (slow) model load; prompts render later. A
        # reward function is user code: say so before importing it and trying it on one example.
        if cfg.reward.function and self.is_main and task is None:
            print(f"[quarl] loading the reward function {cfg.reward.function} (user code, runs in this process)")
        self.task: TaskData = task if task is not None else load_task(
            cfg.data, cfg.reward, None, seed=cfg.train.seed, reward_fns=reward_fns, reward_weights=reward_weights,
            dataset=dataset, eval_dataset=eval_dataset)
        if cfg.reward.function and self.is_main and task is None:
            print(f"[quarl] reward function: {cfg.reward.function} (from {reward_source(cfg.reward.function)})")
        torch.manual_seed(cfg.train.seed)
        if model is None:
            model, tokenizer = load_model(
                cfg.model.name, device=str(self.device), dtype=master_dtype,
                gguf_file=cfg.model.gguf_file, revision=cfg.model.revision,
            )
        self.model, self.tokenizer = model.to(device=self.device, dtype=master_dtype), tokenizer
        self.model.set_fast_paths(cfg.fast_paths)  # the training forward's and the answer log-probs' paths
        # PPO with a critic; built before UAQ and quantization touch the actor: a separate critic copies these weights
        self.critic = Critic.build(cfg, self.model, self.device, self.dtype) \
            if cfg.loss.advantage_estimator == "gae" else None
        if cfg.uaq.scale != 1.0:
            apply_uaq(self.model, cfg.uaq.scale)
        if task is None:  # a given task renders its prompts itself
            self.task.set_tokenizer(self.tokenizer)
        # GPTQ reads the full-precision weights, which quantizing a qlora base drops: its codes are made first (on
        # the CPU until loaded, so the model never holds two bases on the GPU)
        lora_starts: dict = {}  # linear -> (A, B) where lora.init=base_error
        base_codes = self._gptq_base(lora_starts) if self._calibrates_gptq_base() else {}
        self.quantized_linears = apply_precision(self.model, cfg.precision)
        self._report_gemms()
        # whether a trained weight's training forward multiplies its rollout copy (unified: the kernel or bf16 GEMMs)
        self._training_reads_rollout_copies = not self.sharded and any(
            m.trained_rollout_copy and (m.bf16_gemms or m.kernel_forward)
            for m in self.model.modules() if isinstance(m, QuantLinear))
        for linear, codes in base_codes.items():
            linear.load_frozen_base_codes(codes)
        for linear, (a, b) in lora_starts.items():
            if linear.lora_rank:  # lora.targets may leave a linear without adapters
                linear.start_lora_at(a, b)
        if cfg.lora.init == "base_error" and not cfg.resume and not base_codes and self.is_main:
            warnings.warn("lora.init=base_error: this run made no GPTQ base (the model came with its base "
                          "quantized), so its adapters start at B = 0", stacklevel=2)
        if cfg.resume:
            self._load_run_base()  # with the adapters' start, which the KL reference below copies
        # written into the run directory once it is prepared (a fresh run first moves an earlier one aside)
        self._base_codes_to_save = base_codes if self.is_main else {}
        self._lora_starts_to_save = lora_starts if self.is_main else {}
        del base_codes, lora_starts
        self.model.gradient_checkpointing = cfg.train.gradient_checkpointing
        if cfg.precision.kv_cache != "auto" and cfg.precision.flow == "unified":
            # The training forward sees the KV cache's FP8 rounding too, so rollout stays on-policy.
            for module in self.model.modules():
                if isinstance(module, Attention):
                    module.kv_quant = cfg.precision.kv_cache
        self.reference = None
        if cfg.loss.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        if cfg.precision.resolved_smooth_alpha:  # before sharding: the rollout copy made there takes them along
            self._smooth_rollout()
        self.rollout_model = self.model  # what the rollout engine reads: the model itself on one process
        if self.sharded:
            self._shard()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters: check lora/precision settings")
        # float32 masters and moments for bf16 parameters: AdamW on bf16 weights rounds small updates away
        self.optimizer = MasterWeightAdamW(
            self.params, lr=cfg.train.lr, betas=cfg.train.betas, weight_decay=cfg.train.weight_decay
        )
        # Dr.GRPO divides by answers x max_new_tokens: resolved here, not written back into the config.
        self.loss_cfg = dataclasses.replace(
            cfg.loss, max_new_tokens=cfg.loss.max_new_tokens or cfg.rollout.max_new_tokens
        )
        # one warning with remedies when the mismatch drifts
        self.alarms = MismatchAlarms(cfg.alarms, cfg, hidden_size(self.model, cfg.precision))
        if cfg.rollout.router_replay and not getattr(self.model, "is_moe", False):
            raise ValueError(f"rollout.router_replay=true needs a mixture-of-experts model; {cfg.model.name} has no "
                             "MoE layers (set rollout.router_replay=false)")
        self.engine = make_engine(self.rollout_model, self.tokenizer, cfg, self.device)
        self.rollout_sync = ShardedRolloutSync(self.model, self.rollout_model) if self.sharded else \
            RolloutSync(self.model)
        self._routing_counts: dict[str, list[float]] = {}  # moe/* metric -> [differing decisions, decisions]
        self.run_dir = Path(cfg.output.dir)
        self.start_step = 0
        self.log: RunLog | None = None
        self._lock = None  # the open RUN_DIR/.quarl.lock while this trainer holds the run directory
        # NaN/Inf guard: steps that caught one (cumulative), consecutive steps with a skipped update, and the cause
        self.nonfinite_total = 0
        self.nonfinite_streak = 0
        self.nonfinite_cause: str | None = None
        self._fallbacks_logged: set[str] = set()  # fallbacks already named in metrics.jsonl
        self._nonfinite_reward_groups = (0, 0)  # (dropped, sampled) groups of the last rollout

    # ------------------------------------------------------------------------------------------------ setup

    def _shard(self) -> None:
        """Make the rank's full rollout copy (compute dtype, quantized), then shard the trained model (and the
        reference model) with FSDP2; see quarl/rl/sharding.py."""
        self.rollout_model = make_rollout_copy(self.model, self.dtype)
        drop_unused_rollout_buffers(self.model)
        # The fused log-prob path calls hidden_states() and lm_head directly, outside the root's FSDP forward hooks
        self.model.set_fast_paths(dataclasses.replace(self.cfg.fast_paths, fused_logprobs=False))
        for module in self.model.modules():
            if isinstance(module, SparseMoeBlock):  # each rank must reduce gradients of the same experts
                module.every_expert_gradient = True
        shard_model(self.model, self.device, self.dtype)
        if self.reference is not None:
            self.reference.set_fast_paths(dataclasses.replace(self.cfg.fast_paths, fused_logprobs=False))
            shard_model(self.reference, self.device, self.dtype)

    def _report_gemms(self) -> None:
        """Say once where the unified or qlora flow multiplies when `precision.kernel_forward` was left to the model
        size."""
        precision = self.cfg.precision
        if precision.kernel_forward is not None or precision.batch_invariant or not self.is_main or \
                self.device.type != "cuda":
            return  # set by hand (batch invariance takes bf16 GEMMs), or nothing to choose: a CPU runs no kernels
        # the linears whose training forward is quantized (unified, qlora); none in the bf16 and split flows
        linears = [m for m in self.model.modules() if isinstance(m, QuantLinear) and m.train_format is not None]
        if not linears:
            return
        where = "bf16 GEMMs of the dequantized weights, in rollout and training alike" \
            if any(m.bf16_gemms for m in linears) else "the quantized kernels in the rollout"
        hidden = hidden_size(self.model, precision)
        if precision.resolved_weight_only_at(hidden) != precision.resolved_weight_only:
            where += ", activations unquantized (weight-only; precision.weight_only=false quantizes them too)"
        print(f"[quarl] {precision.flow} flow: multiplies with {where} (hidden size {hidden}; the kernels by default "
              f"from {KERNEL_FORWARD_MIN_HIDDEN}, where they save more than their launches cost; "
              "precision.kernel_forward=true / false chooses)")

    def _calibrates_gptq_base(self) -> bool:
        """Whether this run quantizes its qlora base with GPTQ now: a fresh run whose config asks for it, on a model
        that still has its full-precision weights. A resumed run never calibrates again: it loads the base it made
        (`_load_run_base`), so its adapters meet the base they were trained against."""
        if self.cfg.precision.resolved_base_quantizer != "gptq" or self.cfg.resume:
            return False
        if self.model.model.layers[0].self_attn.q_proj.weight is None:
            if self.is_main:
                print("[quarl] the model came with its qlora base quantized already: it keeps that base (no GPTQ; "
                      "the adapters start at B = 0)")
            return False
        return True

    def _load_run_base(self) -> None:
        """On resume: load the GPTQ base the run saved (RUN_DIR/base_gptq.safetensors), whatever the config now
        says; a run that saved none keeps the round-to-nearest base it trained on, with a warning where the config
        asks for GPTQ."""
        loaded = gptq.load_run_base(self.model, Path(self.cfg.output.dir))
        if not loaded and self.cfg.precision.resolved_base_quantizer == "gptq" and self.is_main:
            warnings.warn(f"{Path(self.cfg.output.dir) / gptq.BASE_CODES_FILE} not found: this run trained on a "
                          "round-to-nearest qlora base, which it keeps (precision.base_quantizer=gptq applies to new "
                          "runs only)", stacklevel=2)

    def _gptq_base(self, lora_starts: dict) -> dict:
        """GPTQ codes of the qlora base (`precision.base_quantizer`, quarl/model/gptq.py) from the full-precision
        model, calibrated on the first `gptq.CALIBRATION_PROMPTS` training prompts followed by their gold answers:
        {linear: weight QuantizedTensor on the CPU}. With lora.init=base_error it also fills lora_starts[linear] =
        (A, B), the adapters' start (quarl/model/lora_init.py). Sharded, every rank calibrates the whole (not yet
        sharded) model on the same prompts, reading the float32 masters (one GPU process: the compute-dtype model,
        so the two bases may differ in rare codes), and the Hessians are averaged over ranks, so that every rank
        computes the same codes (and adapters)."""
        batches, prompts = self._calibration(gptq.CALIBRATION_PROMPTS)
        world = qdist.world_size() if self.sharded else 1
        combine = (lambda h: qdist.sum_over_ranks(h, self.device) / world) if self.sharded else None
        start = time.perf_counter()
        rank = self.cfg.lora.rank if self.cfg.precision.resolved_lora_init == "base_error" else 0
        codes = gptq.gptq_base(self.model, self.cfg.precision.resolved_format, batches, combine=combine,
                               weight_dtype=self.dtype, progress=self.is_main and self.cfg.output.progress,
                               adapters=lora_starts, adapter_rank=rank)
        if self.is_main:
            print(f"[quarl] GPTQ quantized {len(codes)} base linears to {self.cfg.precision.resolved_format} in "
                  f"{time.perf_counter() - start:.1f} s (calibrated on {prompts} training prompts)"
                  + (f"; the rank-{rank} adapters start as the correction of its error (lora.init=base_error)"
                     if rank else ""))
        return codes

    def _calibration(self, count: int) -> tuple:
        """(calibration batches of the first `count` training prompts followed by their gold answers, the number
        of distinct prompts among them): what SmoothQuant and GPTQ calibrate on (`smoothing.calibration_batches`)."""
        from quarl.model.smoothing import calibration_batches, calibration_sequences

        sequences = calibration_sequences(self.task, self.tokenizer, count)
        return calibration_batches(sequences, self.device), len({tuple(seq) for seq in sequences})

    def _smooth_rollout(self) -> None:
        """SmoothQuant factors for the rollout copy (`precision.smooth_alpha`, quarl/model/smoothing.py), calibrated
        in full precision on the first `CALIBRATION_PROMPTS` training prompts followed by their gold answers. Runs
        before a resumed run loads its checkpoint, on the model as loaded, so a resumed run gets the factors the
        first run had (on as many ranks), and before sharding, so a sharded run's rollout copy (`make_rollout_copy`)
        takes them. Sharded, it reads the float32 masters; on one GPU process the compute-dtype model."""
        from quarl.model.smoothing import CALIBRATION_PROMPTS, smooth_rollout

        batches, prompts = self._calibration(CALIBRATION_PROMPTS)
        # every rank calibrates the whole (not yet sharded) model on the same prompts; the maximum over ranks makes
        # their factors equal to the last bit
        combine = (lambda m: qdist.max_over_ranks(m, self.device)) if self.sharded else None
        count = smooth_rollout(self.model, batches, self.cfg.precision.resolved_smooth_alpha, combine)
        if self.is_main:
            print(f"[quarl] smoothed the activations of {count} rollout linears (SmoothQuant, alpha "
                  f"{self.cfg.precision.resolved_smooth_alpha}, calibrated on {prompts} training prompts)")

    def prepare_run_dir(self) -> None:
        """Lock the run directory, write the resolved config, restore the latest checkpoint when resuming.

        Only one run writes into a folder: the first takes an exclusive lock on RUN_DIR/.quarl.lock (released when
        the trainer closes or the process ends) and a second one fails at once (RunDirInUse). A fresh run never
        mixes with an earlier run in the same folder: that run is moved aside to RUN_DIR.prev-DATE (nothing is
        deleted). A non-empty folder that is not a quarl run (see `is_run_dir`), e.g. a source tree given as
        output.dir, is refused (RunDirError) and left untouched.
        """
        error = None
        if self.is_main:  # rank 0 alone owns the folder: lock, earlier runs, config, metrics
            try:
                self._claim_run_dir()
            except Exception as e:  # every rank must hear of it, or the others wait for rank 0 forever
                error = e
        if self.distributed:
            told = qdist.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
            if told is not None and error is None:
                raise RunStopped(f"rank 0 could not prepare output.dir ({told})")
        if error is not None:
            raise error
        resume_step = None
        if self.cfg.resume:
            self._restore()
            resume_step = self.start_step
        if not self.is_main:
            self.log = _NoLog()
            return
        self.log = RunLog.from_config(self.run_dir, self.cfg, resume_step=resume_step)
        # `resume` is not saved: re-running (or copying) this file would otherwise silently continue this run.
        saved = config_to_dict(self.cfg)
        saved.pop("resume", None)
        atomic_write_bytes(self.run_dir / "config.yaml", yaml.safe_dump(saved).encode())
        if self._base_codes_to_save:  # the GPTQ base this run trains against: resume and export load it
            gptq.save_base_codes(self.model, self._base_codes_to_save, self.run_dir / gptq.BASE_CODES_FILE,
                                 self._lora_starts_to_save)
            self._base_codes_to_save = self._lora_starts_to_save = {}

    def _claim_run_dir(self) -> None:
        """Check and lock the run directory; move an earlier run aside (see `prepare_run_dir`)."""
        run_dir = self.run_dir
        check_output_dir(run_dir)
        print(f"[quarl] run directory: {run_dir}", flush=True)
        if not self.cfg.resume and run_dir.is_dir() and any(run_dir.iterdir()):
            if not is_run_dir(run_dir):
                raise RunDirError(
                    f"output.dir={run_dir} is a non-empty folder that is not a quarl run (no {LOCK_NAME}, no "
                    "config.yaml with metrics.jsonl or checkpoints/); nothing was changed: choose a new or empty "
                    "folder for output.dir")
            earlier = lock_run_dir(run_dir)  # not while another run writes there
            try:
                aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
                shutil.move(str(run_dir), str(aside))
                print(f"[quarl] {run_dir} held an earlier run; moved it to {aside}")
                run_dir.mkdir(parents=True, exist_ok=True)
                self._lock = lock_run_dir(run_dir)
            finally:
                if earlier is not None:
                    earlier.close()
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._lock = lock_run_dir(run_dir)

    def _restore(self) -> None:
        """Load the newest intact checkpoint (checksums verified; a damaged one is skipped with a warning): a
        single-process .pt file, or on many ranks a sharded DCP folder (written on any number of ranks)."""
        if self.distributed:
            state, ckpt = load_latest_sharded(self.run_dir, self.model,
                                              self.optimizer.optimizer if self.sharded else self.optimizer)
        else:
            state, ckpt = load_latest_intact(self.run_dir, self.model, self.optimizer)
        self.start_step = state["step"]
        if self.critic is not None:
            self.critic.load_state_dict(state.get("critic"), ckpt)
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        if self.sharded:
            self.rollout_sync()
        else:
            refresh_rollout_weights(self.model)
        if self.is_main:
            print(f"[quarl] resumed from {ckpt} (step {self.start_step})")

    def close(self) -> None:
        """Close the run log, release the run directory's lock and leave the process group (train() does this
        however it ends)."""
        if self.log is not None:
            self.log.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if self.distributed:
            qdist.shutdown()

    # ------------------------------------------------------------------------------------------------ one step

    def set_lr(self, step: int) -> None:
        """The learning rate is a pure function of the RL step (warm-up, then the schedule): nothing to save."""
        t = self.cfg.train
        factor = lr_factor(step, t.steps, t.warmup_steps, t.lr_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = t.lr * factor
        if self.critic is not None:
            self.critic.set_lr(factor)

    def sync(self, step: int) -> float:
        """Re-quantize master weights into the rollout copy (in place) and draw this step's AQN noise."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the last update's kernels are not the sync's time
        t0 = time.perf_counter()
        self.rollout_sync()  # a LoRA-frozen base is quantized once; trained weights every step
        a = self.cfg.aqn
        sigma = aqn_sigma(step, self.cfg.train.steps, a.sigma_start, a.sigma_end, a.stages)
        if a.sigma_start > 0:
            gen = torch.Generator().manual_seed(self.cfg.train.seed * 7919 + step)
            set_aqn_noise(self.rollout_model, sigma, gen)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return sigma, time.perf_counter() - t0

    def rollout(self, step: int):
        """Sample groups, score them, and (DAPO dynamic sampling) refill groups whose rewards are all equal.

        A group with a NaN/Inf reward is dropped (its advantages would all be NaN) and counted in
        `_nonfinite_reward_groups`; with dynamic sampling it is refilled like an uninformative group.
        """
        r, tr = self.cfg.rollout, self.cfg.train
        wanted = r.prompts_per_step
        examples, outputs, rewards = [], [], []
        sampled_rewards = []  # every answer's reward, kept or dropped by dynamic sampling (finite groups only)
        sampled_groups = dropped_groups = 0  # groups sampled; groups dropped for a NaN/Inf reward
        attempt = 0
        tokens = 0
        while True:
            batch = self.task.train_batch(step, attempt, wanted if attempt == 0 else wanted - len(examples))
            seed = tr.seed * 1_000_003 + step * 101 + attempt
            if self.distributed:
                outs, flat = self._rollout_share(batch, seed)
            else:
                outs = self.engine.generate(
                    [self.task.render(ex) for ex in batch], n=r.num_generations,
                    max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                    stop=list(r.stop) or None, seed=seed,
                )
                # every answer of the round in one call: user reward functions may score a batch at once
                flat = self.task.rewards([c.text for out in outs for c in out.completions],
                                         [ex for ex, out in zip(batch, outs) for _ in out.completions])
            offsets = [0]
            for out in outs:
                offsets.append(offsets[-1] + len(out.completions))
            for i, (ex, out) in enumerate(zip(batch, outs)):
                scores = torch.tensor(flat[offsets[i] : offsets[i + 1]], dtype=torch.float32)
                tokens += sum(len(c.token_ids) for c in out.completions)
                sampled_groups += 1
                if not bool(torch.isfinite(scores).all()):
                    dropped_groups += 1  # NaN/Inf would poison the whole group's advantages: not trained on
                    continue
                sampled_rewards.append(scores)
                keep = not tr.dynamic_sampling or bool(dynamic_sampling_keep(scores, r.num_generations)[0])
                if keep:
                    examples.append(ex)
                    outputs.append(out)
                    rewards.append(scores)
            attempt += 1
            if not tr.dynamic_sampling or len(examples) >= wanted or attempt > tr.max_refills:
                break
        self._nonfinite_reward_groups = (dropped_groups, sampled_groups)
        sampled = torch.cat(sampled_rewards) if sampled_rewards else torch.zeros(0)
        return examples, outputs, rewards, sampled, tokens, attempt

    def _rollout_share(self, batch: list, seed: int) -> tuple[list, list[float]]:
        """Many ranks: generate and score this rank's contiguous share of the round's prompts (whole groups), then
        gather every rank's groups in prompt order, so each rank holds the round's full results.

        Every answer draws from its own stream, seeded by (round seed, the prompt's index in the round, the answer's
        index; `quarl.rollout.seeding`), never by the rank or by the other prompts of the call: the same global
        batch gives the same rollouts on any number of ranks. (One process without torchrun draws a round from one
        generator instead, so its samples differ from these; both are reproducible.)
        Returns (outputs [len(batch)], rewards flat over outputs' completions)."""
        r = self.cfg.rollout
        share = qdist.shard_range(len(batch), qdist.world_size(), qdist.rank())
        outs = []
        if len(share):
            outs = self.engine.generate(
                [self.task.render(batch[i]) for i in share], n=r.num_generations, max_new_tokens=r.max_new_tokens,
                temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=list(r.stop) or None,
                seeds=[group_seed(seed, i) for i in share],
            )
        flat = self.task.rewards([c.text for out in outs for c in out.completions],
                                 [batch[i] for i, out in zip(share, outs) for _ in out.completions]) if outs else []
        gathered = qdist.all_gather_objects((outs, [float(x) for x in flat]))
        return [o for part in gathered for o in part[0]], [x for part in gathered for x in part[1]]

    def assemble(self, outputs, rewards) -> tuple[RolloutBatch, dict]:
        r, tr = self.cfg.rollout, self.cfg.train
        flat_rewards = torch.cat(rewards) if rewards else torch.zeros(0)
        lengths = torch.tensor([len(c.token_ids) for o in outputs for c in o.completions], dtype=torch.float32)
        truncated = [c.finish_reason == "length" for o in outputs for c in o.completions]
        shaped = flat_rewards.clone()
        if tr.overlong_buffer > 0:
            shaped = shaped + overlong_penalty(lengths, r.max_new_tokens, tr.overlong_buffer, tr.overlong_penalty)
        scale = "none" if self.cfg.loss.loss_type == "dr_grpo" else "std"
        advantages = group_advantages(shaped, r.num_generations, scale=scale)
        counts = [not (tr.overlong_filter and t) for t in truncated]
        batch = build_batch(
            prompt_ids=[o.prompt_token_ids for o in outputs for _ in o.completions],
            answer_ids=[c.token_ids for o in outputs for c in o.completions],
            behaviour_logprobs=[c.logprobs for o in outputs for c in o.completions],
            counts=counts, advantages=advantages, rewards=shaped,
            group_index=[i for i, o in enumerate(outputs) for _ in o.completions],
            pad_id=0,  # any id below the vocabulary size: padding is masked
            routing=[c.routing for o in outputs for c in o.completions]
            if all(c.routing is not None for o in outputs for c in o.completions) else None,
        )
        stats = {
            "reward/trained_mean": flat_rewards.mean().item(),
            "reward/std": flat_rewards.std(unbiased=False).item(),
            "rollout/answer_len_mean": lengths.mean().item(),
            "rollout/truncated_frac": sum(truncated) / max(len(truncated), 1),
        }
        return batch, stats


    @torch.no_grad()
    def score(self, model, batch: RolloutBatch, with_entropy: bool):
        """No-grad log-probs of the answers (π_prox or π_ref) in micro-batches. Returns ([B, T-1], entropy)."""
        out = torch.zeros_like(batch.behaviour_logprobs)
        entropy = torch.zeros_like(batch.behaviour_logprobs) if with_entropy else None
        mb = self.cfg.train.micro_batch_size
        was_training = model.training
        model.eval()  # π_prox is the policy itself: no (LoRA) dropout
        for rows, idle in self.micro_batches(torch.arange(len(batch)), mb, batch.attention_mask):
            rows = rows.tolist()
            sub = batch.select(rows)
            routing = self.expert_routing(sub)
            lp, ent = answer_logprobs(
                model, sub.input_ids.to(self.device), sub.attention_mask.to(self.device),
                self.cfg.rollout.temperature, sub.answer_width, with_entropy, sub.answer_lengths, routing=routing,
            )
            if idle:  # a forward only to keep this rank's collectives in step with the others
                continue
            if model is self.model:
                self.count_routing(sub, routing)
            width = lp.shape[1]  # rows are left-padded: answers live in the last `width` columns
            out[rows, -width:] = lp.float().cpu()
            if with_entropy:
                entropy[rows, -width:] = ent.float().cpu()
        model.train(was_training)
        if self.distributed:  # every row was filled by exactly one rank and is 0 elsewhere: the sum is exact
            out = qdist.sum_over_ranks(out, self.device)
            entropy = qdist.sum_over_ranks(entropy, self.device) if with_entropy else None
        return out, entropy

    def expert_routing(self, sub: RolloutBatch) -> ExpertRouting | None:
        """The routing of a training forward over `sub` (MoE models with a rollout record): the rollout's experts
        replayed when rollout.router_replay, and a record of the forward's own top-k either way."""
        if sub.expert_indices is None:
            return None
        replay = sub.expert_indices.to(self.device) if self.cfg.rollout.router_replay else None
        return ExpertRouting(replay=replay, record=True)

    def count_routing(self, sub: RolloutBatch, routing: ExpertRouting | None) -> None:
        """Add the forward's routing decisions that differ from the rollout's to this step's moe/* counts:
        routing_mismatch compares the forward's own top-k (what it would route to without replay), and
        routing_mismatch_used the experts it used (0 with replay)."""
        if routing is None:
            return
        recorded = sub.expert_indices
        for key, which in (("moe/routing_mismatch", "own"), ("moe/routing_mismatch_used", "used")):
            fraction, decisions = routing_mismatch(recorded, routing.stacked(which).cpu())
            counts = self._routing_counts.setdefault(key, [0.0, 0])
            counts[0] += fraction * decisions
            counts[1] += decisions

    def routing_metrics(self) -> dict:
        """This step's moe/* metrics (empty for dense models), then the counts start over. On many ranks the
        counts of every rank's micro-batches are summed first."""
        if self.distributed and getattr(self.model, "is_moe", False):
            keys = ("moe/routing_mismatch", "moe/routing_mismatch_used")  # the same order on every rank
            counts = torch.tensor([v for k in keys for v in self._routing_counts.get(k, [0.0, 0])],
                                  dtype=torch.float64)
            summed = qdist.sum_over_ranks(counts, self.device).tolist()
            self._routing_counts = {k: summed[2 * i:2 * i + 2] for i, k in enumerate(keys)}
        out = {key: wrong / total for key, (wrong, total) in self._routing_counts.items() if total}
        self._routing_counts = {}
        return out

    def micro_batches(self, rows: torch.Tensor, size: int, attention_mask: torch.Tensor | None = None
                      ) -> list[tuple[torch.Tensor, bool]]:
        """Micro-batches (row indices long [<= size], idle) of `rows` (long [R]) for this process.

        One process: consecutive chunks of `size`, none idle. Many ranks: this rank's contiguous share of `rows`
        in chunks of `size`, then idle micro-batches (the first row again, whose results are thrown away) until
        every rank has as many as the rank with the largest share: each forward and backward of a sharded model
        runs collectives, so every rank must run the same number. With `train.group_by_length` and the batch's
        attention_mask [B, T], the rows (this rank's share) are chunked longest first, so each micro-batch,
        trimmed to its longest row (`RolloutBatch.select`), pads little.
        """
        if not self.distributed:
            mine = self._longest_first(rows, attention_mask)
            return [(mine[i:i + size], False) for i in range(0, len(mine), size)]
        world = qdist.world_size()
        share = qdist.shard_range(len(rows), world, qdist.rank())
        mine = self._longest_first(rows[share.start:share.stop], attention_mask)
        out = [(mine[i:i + size], False) for i in range(0, len(mine), size)]
        most = -(-len(qdist.shard_range(len(rows), world, 0)) // size)  # share 0 is the largest
        out += [(rows[:1], True)] * (most - len(out))
        return out

    def _longest_first(self, rows: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """rows ordered by their real tokens, longest first (ties keep their order); unchanged without
        attention_mask or with train.group_by_length off."""
        if attention_mask is None or not self.cfg.train.group_by_length or len(rows) < 2:
            return rows
        lengths = attention_mask[rows].sum(1)
        return rows[torch.sort(lengths, descending=True, stable=True).indices]

    def proximal_from_update(self, batch_size: int) -> bool:
        """Whether π_prox can be read off the update's own forward instead of a separate scoring pass.

        With one optimizer step per batch (one epoch, one minibatch) every micro-batch's training forward runs on
        the weights π_prox is defined by, and without dropout it computes the same values as `score` (which is
        the same forward under no_grad), so the detached log-probs are π_prox. Off for the bypass correction
        (no π_prox at all) and with train.recompute_proximal.
        """
        tr = self.cfg.train
        if tr.recompute_proximal or get_correction(self.cfg.loss.correction).skips_proximal or tr.epochs != 1:
            return False
        if self.cfg.loss.error_token_guard != "off":  # the guard's log-ratio test needs π_prox before the update
            return False
        if tr.mini_batch_size is not None and tr.mini_batch_size < batch_size:
            return False
        return not any(getattr(m, "lora_dropout", 0.0) > 0 for m in self.model.modules())

    def update(self, batch: RolloutBatch, proximal, reference, step: int, collect_proximal: bool = False) -> dict:
        """Epochs x minibatches of optimizer steps on the clipped objective; returns token-weighted metrics.

        collect_proximal: `proximal` is None and the (single) optimizer step's forward supplies it, detached
        (see `proximal_from_update`); the collected log-probs and entropy [B, T-1] are then returned under the
        keys "_proximal" and "_entropy".

        NaN/Inf guard: a minibatch whose loss or gradient norm is not finite gets no optimizer step (its gradients
        are dropped); "train/skipped_updates" counts them and "_nonfinite" lists the causes. NonFiniteError when
        the weights are not finite after an optimizer step (e.g. train.lr far too high).
        """
        tr = self.cfg.train
        if collect_proximal:
            collected = torch.zeros_like(batch.behaviour_logprobs)
            collected_entropy = torch.zeros_like(batch.behaviour_logprobs)
        n = len(batch)
        mini = tr.mini_batch_size or n
        gen = torch.Generator().manual_seed(tr.seed * 31337 + step)
        sums: dict[str, float] = {}
        weight_total = 0.0
        grad_norms, critic_norms, losses = [], [], []
        skipped: list[str] = []  # the cause of each skipped optimizer step
        critic = self.critic
        optimizers = [self.optimizer] + ([critic.optimizer] if critic is not None else [])
        actor_trains = critic is None or critic.actor_trains(step)  # critic warm-up: only the critic learns
        self.model.train()
        # A unified training forward that multiplies the rollout copies: after an optimizer step they are re-quantized
        # all at once before the next minibatch, not one linear at a time inside its forward, where a stacked
        # projection's shared buffer would change under a neighbour's saved operand.
        stepped = False
        for _ in range(tr.epochs):
            order = torch.randperm(n, generator=gen) if tr.epochs > 1 or mini < n else torch.arange(n)
            for m0 in range(0, n, mini):
                mini_rows = order[m0 : m0 + mini]
                num_tokens = int(batch.answer_mask[mini_rows].sum().item())
                if num_tokens == 0:
                    continue
                if stepped and self._training_reads_rollout_copies:
                    with torch.no_grad():
                        self.rollout_sync()
                stepped = False
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
                mini_loss = 0.0
                mini_sums: dict[str, float] = {}
                mini_weight = 0.0
                bad = None  # why this minibatch gets no optimizer step
                for rows, idle in self.micro_batches(mini_rows, tr.micro_batch_size, batch.attention_mask):
                    sub = batch.select(rows)
                    routing = self.expert_routing(sub)
                    with critic.reading(self.model) if critic is not None else nullcontext():
                        logprobs, ent = answer_logprobs(
                            self.model, sub.input_ids.to(self.device), sub.attention_mask.to(self.device),
                            self.cfg.rollout.temperature, sub.answer_width, with_entropy=collect_proximal,
                            answer_lengths=sub.answer_lengths, routing=routing,
                        )
                    if collect_proximal and not idle:  # this forward is the proximal pass: its routing is the step's
                        self.count_routing(sub, routing)
                    width = logprobs.shape[1]  # the last `width` columns hold every answer token of these rows
                    dev = lambda t: None if t is None else t[rows, -width:].to(self.device)  # noqa: E731
                    prox = dev(proximal)
                    if collect_proximal:
                        prox = logprobs.detach()
                        if not idle:
                            collected[rows, -width:] = prox.float().cpu()
                            collected_entropy[rows, -width:] = ent.float().cpu()
                    loss, metrics = policy_loss(
                        logprobs, prox, sub.behaviour_logprobs[:, -width:].to(self.device),
                        sub.answer_advantages(width).to(self.device), sub.answer_mask[:, -width:].to(self.device),
                        self.loss_cfg, reference_logprobs=dev(reference), num_sequences=len(mini_rows),
                        num_tokens=num_tokens,
                    )
                    if idle:  # no share of the loss, but the same collectives as the other ranks
                        (loss * 0.0).backward()
                        continue
                    if critic is not None:  # the clipped value loss joins this backward (alone during warm-up)
                        value_loss, value_metrics = critic.loss(sub, width, num_tokens, self.device, actor_trains)
                        loss = (loss if actor_trains else loss.detach()) + value_loss
                        metrics.update(value_metrics)
                    loss_value = loss.item()
                    if bad is None and not math.isfinite(loss_value):
                        bad = f"non-finite loss ({loss_value})"
                    if bad is None or self.distributed:  # a sharded backward is a collective: every rank runs it
                        # FSDP averages gradients over ranks; this rank's loss is a share of the minibatch's sum
                        (loss * qdist.world_size() if self.distributed else loss).backward()
                    mini_loss += loss_value  # micro-batch losses are shares of the minibatch loss
                    w = float(sub.answer_mask.sum())
                    mini_weight += w
                    for k, v in metrics.items():
                        mini_sums[k] = mini_sums.get(k, 0.0) + float(v) * w
                grad_norm = float("nan")
                if bad is None or self.distributed:
                    grad_norm = self.optimizer.clip_grad_norm_(tr.max_grad_norm)
                    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                    critic_norm = 0.0 if critic is None else float(critic.optimizer.clip_grad_norm_(tr.max_grad_norm))
                    if bad is None and not math.isfinite(grad_norm):
                        bad = f"non-finite gradient norm ({grad_norm})"
                    elif bad is None and not math.isfinite(critic_norm):
                        bad = f"non-finite critic gradient norm ({critic_norm})"
                if self.distributed:
                    # one rank's bad loss skips the step on every rank; losses and metrics are sums of shares
                    if qdist.any_rank(bad is not None, self.device) and bad is None:
                        bad = "non-finite loss on another rank"
                    keys = sorted(set().union(*qdist.all_gather_objects(sorted(mini_sums))))
                    totals = qdist.sum_over_ranks(torch.tensor(
                        [mini_loss, mini_weight] + [mini_sums.get(k, 0.0) for k in keys], dtype=torch.float64),
                        self.device).tolist()
                    mini_loss, mini_weight = totals[0], totals[1]
                    mini_sums = dict(zip(keys, totals[2:]))
                if bad is not None:
                    for optimizer in optimizers:  # nothing of this minibatch reaches the weights
                        optimizer.zero_grad(set_to_none=True)
                    skipped.append(bad)
                    continue
                for optimizer in optimizers:
                    optimizer.step()
                stepped = True
                losses.append(mini_loss)
                grad_norms.append(grad_norm)
                critic_norms.append(critic_norm)
                weight_total += mini_weight
                for k, v in mini_sums.items():
                    sums[k] = sums.get(k, 0.0) + v
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        if grad_norms:
            self.check_weights_finite(step + 1)
        out = {k: v / max(weight_total, 1.0) for k, v in sums.items()}
        if grad_norms:
            out["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
            if critic is not None:
                out["critic/grad_norm"] = sum(critic_norms) / len(critic_norms)
            out["train/loss"] = sum(losses) / len(losses)
        out["train/optimizer_steps"] = len(grad_norms)
        out["train/skipped_updates"] = len(skipped)
        out["_nonfinite"] = skipped
        if collect_proximal:
            if self.distributed:  # each row was filled by one rank and is 0 on the others: the sums are exact
                collected = qdist.sum_over_ranks(collected, self.device)
                collected_entropy = qdist.sum_over_ranks(collected_entropy, self.device)
            out["_proximal"], out["_entropy"] = collected, collected_entropy
        return out

    def nonfinite_weights(self) -> list[str]:
        """Names of trainable parameters (or their float32 masters) holding NaN/Inf."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        tensors = [local_part(p.detach()) for _, p in named]  # many ranks: each checks its shards ...
        names = [n for n, _ in named]
        by_id = {id(p): n for n, p in named}
        for p, master in zip(self.optimizer.params, self.optimizer.masters):
            if master is not p:
                tensors.append(master.detach())
                names.append(f"{by_id.get(id(p), '?')} (float32 master)")
        flags = _finite_flags(tensors)
        if self.distributed:  # ... and every rank learns of any rank's bad shard
            flags = [bool(v) for v in qdist.all_reduce_min([float(f) for f in flags], self.device)]
        bad = [n for n, ok in zip(names, flags) if not ok]
        return bad + (self.critic.nonfinite_weights() if self.critic is not None else [])

    def check_weights_finite(self, step: int, doing: str = "after the optimizer step") -> None:
        """NonFiniteError naming the (1-based) step when a trainable weight is NaN/Inf: nothing good follows."""
        bad = self.nonfinite_weights()
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise NonFiniteError(
                f"step {step}: the weights are non-finite {doing} (NaN/Inf in {bad[0]}{more}; train.lr="
                f"{self.cfg.train.lr:g}); stopped without writing them: lower train.lr, and resume from the last "
                "checkpoint (checkpoints already written are kept)")

    def _nonfinite_report(self, step: int, metrics: dict, skipped: list[str], all_dropped: bool) -> None:
        """Count this step's NaN/Inf events in its metrics and say them in one line."""
        dropped, sampled = self._nonfinite_reward_groups
        causes = []
        if dropped:
            causes.append(f"the reward function returned NaN/Inf in {dropped} of {sampled} groups (dropped)")
        for cause in dict.fromkeys(skipped):  # distinct, in order
            causes.append(cause)
        n_skipped = len(skipped) + (1 if all_dropped else 0)
        metrics["groups/nonfinite_reward"] = dropped
        metrics["train/skipped_updates"] = n_skipped
        if causes:
            self.nonfinite_total += 1
            self.nonfinite_cause = "; ".join(causes)
            if all_dropped:
                outcome = "no group left to train on: update skipped"
            elif skipped:
                total = n_skipped + int(metrics.get("train/optimizer_steps", 0))
                outcome = "update skipped" if total == 1 else f"{n_skipped} of {total} updates skipped"
            else:
                outcome = "trained on the other groups"
            if self.is_main:
                print(f"[quarl] step {step + 1}: {self.nonfinite_cause}; {outcome}", file=sys.stderr, flush=True)
        metrics["train/nonfinite_total"] = self.nonfinite_total

    def _report_fallbacks(self, metrics: dict) -> None:
        """Name, in this step's record, each fast path that fell back since the last record (once per run)."""
        new = {k: v for k, v in reported_fallbacks().items() if k not in self._fallbacks_logged}
        if new:
            self._fallbacks_logged.update(new)
            metrics["fallbacks"] = new

    def step(self, step: int) -> dict:
        t_step = time.perf_counter()
        sigma, sync_s = self.sync(step)

        t0 = time.perf_counter()
        self.set_lr(step)
        examples, outputs, rewards, sampled_rewards, tokens, attempts = self.rollout(step)
        rollout_s = time.perf_counter() - t0
        metrics = {"time/sync_s": sync_s, "time/rollout_s": rollout_s, "rollout/tokens_per_s": tokens / rollout_s}
        engine_stats = getattr(self.engine, "last_stats", None) or {}
        for key in ("graph_captures", "graph_drops"):  # captures every step would mean the graphs read moved buffers
            if key in engine_stats:
                metrics[f"rollout/{key}"] = engine_stats[key]
        metrics["aqn/sigma"] = sigma
        metrics["groups/kept"] = len(examples)
        metrics["groups/rollout_rounds"] = attempts
        finite = sampled_rewards[torch.isfinite(sampled_rewards)]
        # over every finite reward sampled (DAPO drops some groups; NaN/Inf rewards are counted apart)
        metrics["reward/mean"] = finite.mean().item() if finite.numel() else float("nan")
        if not examples:  # dynamic sampling found no informative group, or every reward was NaN/Inf
            self._nonfinite_report(step, metrics, [], all_dropped=self._nonfinite_reward_groups[0] > 0)
            self._report_fallbacks(metrics)
            metrics["time/step_s"] = time.perf_counter() - t_step
            return metrics

        batch, stats = self.assemble(outputs, rewards)
        metrics.update(stats)

        t0 = time.perf_counter()
        # a correction that skips π_prox (bypass: π_prox := μ) saves this forward; the trust region then follows μ
        skip = get_correction(self.cfg.loss.correction).skips_proximal
        from_update = self.proximal_from_update(len(batch))  # then the update's forward supplies π_prox
        proximal = entropy = None
        if not skip and not from_update:
            proximal, entropy = self.score(self.model, batch, with_entropy=True)
        reference = self.score(self.reference, batch, False)[0] if self.reference is not None else None
        metrics["time/prox_s"] = time.perf_counter() - t0
        if self.loss_cfg.error_token_guard != "off":  # flagged answers are masked or dropped before the update
            batch, proximal, reference, entropy, error_metrics = guard_error_answers(
                batch, self.loss_cfg, proximal, reference, entropy)
            metrics.update(error_metrics)
        if self.critic is not None:  # V_old over the answers (no grad, like π_prox), then GAE advantages and returns
            t0 = time.perf_counter()
            batch, critic_metrics = self.critic.prepare(batch, self.cfg.train.micro_batch_size, self.device,
                                                        routing_of=self.expert_routing)
            metrics.update(critic_metrics)
            metrics["time/critic_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        update_metrics = self.update(batch, proximal, reference, step, collect_proximal=from_update)
        if from_update:
            proximal, entropy = update_metrics.pop("_proximal"), update_metrics.pop("_entropy")
        skipped = update_metrics.pop("_nonfinite")
        metrics.update(update_metrics)
        self._nonfinite_report(step, metrics, skipped, all_dropped=False)
        metrics["time/train_s"] = time.perf_counter() - t0
        mask = batch.answer_mask
        if proximal is not None and mask.sum() > 0:
            metrics.update(mismatch_metrics(batch.behaviour_logprobs, proximal, mask))
            metrics["policy/entropy"] = float((entropy * mask).sum() / mask.sum())
        metrics.update(self.routing_metrics())
        if self.loss_cfg.error_token_guard == "off":  # error/* metrics only
            metrics.update(guard_error_answers(batch, self.loss_cfg, proximal)[-1])
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        self._report_fallbacks(metrics)
        metrics["time/step_s"] = time.perf_counter() - t_step

        self.log.samples(step + 1, [
            {"prompt": ex.prompt, "gold": ex.gold, "completion": out.completions[0].text,
             "reward": float(rw[0])}
            for ex, out, rw in list(zip(examples, outputs, rewards))[: self.cfg.output.samples_per_step]
        ])
        return metrics

    # ------------------------------------------------------------------------------------------------ loop

    def evaluate(self, step: int) -> dict:
        """Held-out scores of the current weights in rollout precision, without AQN noise, after `step` steps; the
        completions and per-problem scores go to RUN_DIR/eval_samples.jsonl ("eval": "eval" or "eval_full").
        On many ranks each rank answers its contiguous share of the problems and the records are gathered: the
        same answers and scores as one rank (each problem samples from its own seeded stream)."""
        if self.sharded:
            self.rollout_sync()
        else:
            refresh_rollout_weights(self.model)
        if self.cfg.aqn.sigma_start > 0:
            set_aqn_noise(self.rollout_model, 0.0)
        e = self.cfg.eval
        kwargs = dict(n=e.n, temperature=e.temperature, max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
                      seed=self.cfg.train.seed, stop=list(self.cfg.rollout.stop) or None,
                      progress=self.cfg.output.progress and self.is_main)
        examples, first = self.task.eval_examples, 0
        if self.distributed:
            share = qdist.shard_range(len(examples), qdist.world_size(), qdist.rank())
            examples, first = examples[share.start:share.stop], share.start
        records: list[dict] = []
        result = None
        if examples:  # a rank may have no share when there are fewer problems than ranks
            result = evaluate(self.engine, self.task, examples, desc=f"held-out eval (step {step})",
                              records=records, first_index=first, **kwargs)
        if self.distributed:
            records = [r for part in qdist.all_gather_objects(records) for r in part]
            result = metrics_of_records(records, e.n)
        out = {f"eval/{k}": v for k, v in result.items()}
        rows = [{"eval": "eval", **r} for r in records]
        # many ranks: the rollout copy keeps only the quantized weights, so there is no full-precision twin to score
        if e.full_precision and self.cfg.precision.flow != "bf16" and not self.sharded:
            from quarl.rollout.engine import RolloutEngine

            records = []
            with full_precision(self.rollout_model):
                engine = RolloutEngine(self.rollout_model, self.tokenizer,
                                       max_batch_size=self.cfg.rollout.max_batch_size)
                full = evaluate(engine, self.task, self.task.eval_examples, records=records,
                                desc=f"held-out eval, quantization off (step {step})", **kwargs)
            out.update({f"eval_full/{k}": v for k, v in full.items() if k != "num_examples"})
            rows += [{"eval": "eval_full", **r} for r in records]
        self.log.eval_samples(step, rows)
        return out

    def warn_if_rollout_format_too_lossy(self, before: dict) -> None:
        """Warn once when the quantized rollout model scores far below the same weights in full precision before
        any training (e.g. FP4 formats on a small model): RL then learns from a much weaker behaviour policy."""
        quantized, full = before.get("eval/accuracy"), before.get("eval_full/accuracy")
        if quantized is None or full is None or not (full - quantized >= 0.05 and quantized < 0.5 * full):
            return
        fmt = self.cfg.precision.resolved_format
        warnings.warn(
            f"the {fmt} rollout model scores {quantized:.3f} on the held-out problems against {full:.3f} in full "
            f"precision before training: {fmt} loses too much on this model (FP4 formats on small models do); try "
            "precision.format=int8 / fp8 / fp8-block, or a larger model", UserWarning, stacklevel=2)

    def train(self) -> dict:
        """Run (or resume) the loop to cfg.train.steps; returns the last step's metrics (+ eval results).

        Stops early after Ctrl-C / SIGTERM (checkpoint saved; summary["interrupted"], summary["signal"]) and with
        NonFiniteError after train.max_nonfinite_steps consecutive steps with a skipped update. The run directory
        is locked for the duration and released however this ends.
        """
        try:
            summary = self._train()
            if self.distributed:
                # every rank finishes its collectives before any leaves the group (the process ends later, through
                # quarl.distributed.end_process, in `quarl train`)
                qdist.barrier()
            return summary
        except Exception as e:
            if self.distributed and qdist.collective_failure(e):
                raise RunStopped(
                    f"rank {qdist.rank()} of {qdist.world_size()}: another rank stopped while this one waited for it "
                    f"({str(e).splitlines()[0][:200]}); the job stopped; checkpoints already written are intact: "
                    f"resume with resume={self.run_dir}") from e
            raise
        finally:
            self.close()

    def _train(self) -> dict:
        from tqdm import tqdm

        self.prepare_run_dir()
        cfg = self.cfg
        summary: dict = {}
        if cfg.eval.before and self.start_step == 0 and self.task.eval_examples:
            summary["before"] = self.evaluate(0)
            self.log.log(0, summary["before"])
            if self.is_main:
                print(f"[quarl] held-out before training: {_fmt(summary['before'])}")
                self.warn_if_rollout_format_too_lossy(summary["before"])
        interrupt = GracefulInterrupt(echo_s=2.0 if self.distributed else 0.0)
        bar = tqdm(
            total=cfg.train.steps, initial=self.start_step, desc="quarl train", unit="step",
            disable=not cfg.output.progress or not self.is_main, dynamic_ncols=True,
        )
        step = self.start_step
        last: dict = {}
        try:
            with interrupt.installed():
                while step < cfg.train.steps:
                    last = self.step(step)
                    step += 1
                    if (cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps
                            and self.task.eval_examples):
                        last.update(self.evaluate(step))
                    self.log.log(step, last)
                    self._count_skipped(step, last)
                    if self.is_main:
                        self.alarms.check(step, last)
                    bar.update(1)
                    bar.set_postfix(
                        reward=f"{last.get('reward/mean', float('nan')):.3f}",
                        kl=f"{last.get('mismatch/kl', float('nan')):.1e}",
                        s=f"{last.get('time/step_s', 0):.1f}",
                    )
                    if self.distributed:  # a signal to any rank stops every rank after the same step
                        interrupt.requested = qdist.any_rank(interrupt.requested, self.device)
                    if step % cfg.output.checkpoint_every == 0 or step == cfg.train.steps or interrupt.requested:
                        self.checkpoint(step)
                    if interrupt.requested:
                        if self.is_main:
                            print(f"[quarl] stopped after step {step}; resume with: quarl train "
                                  f"{self.run_dir}/config.yaml resume={self.run_dir}")
                        summary["interrupted"] = True
                        summary["signal"] = interrupt.signum
                        break
        finally:
            bar.close()
        if not summary.get("interrupted") and cfg.eval.after and self.task.eval_examples:
            summary["after"] = self.evaluate(step)
            self.log.log(step, summary["after"])
            if self.is_main:
                print(f"[quarl] held-out after training: {_fmt(summary['after'])}")
        if not summary.get("interrupted") and cfg.output.export_hf:
            from quarl.export import export_run

            if self.sharded:
                self.export_distributed()
            else:
                export_run(self.model, self.tokenizer, self.cfg, self.run_dir / "export")
        summary["last"] = last
        summary["step"] = step
        return summary

    def export_distributed(self) -> None:
        """Many ranks: gather the trained weights whole into rank 0's CPU memory (parameter by parameter), load them
        into a CPU copy of the model as configured, and export it from rank 0 (RUN_DIR/export, as on one process).
        The rollout copy cannot serve: its quantized linears keep codes only."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from quarl.export import export_run
        from quarl.model.gptq import load_run_base
        from quarl.model.loading import load_model

        full = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
        if self.is_main:
            cfg = self.cfg
            torch.manual_seed(cfg.train.seed)  # a random-init model (tiny-random-*) comes back the same
            model, _ = load_model(cfg.model.name, device="cpu", dtype=torch.float32, gguf_file=cfg.model.gguf_file,
                                  revision=cfg.model.revision)
            if cfg.uaq.scale != 1.0:
                apply_uaq(model, cfg.uaq.scale)
            apply_precision(model, cfg.precision)
            load_run_base(model, self.run_dir)
            unexpected = model.load_state_dict(full, strict=False).unexpected_keys
            if unexpected:
                raise RuntimeError(f"the gathered weights hold {unexpected[:3]}, which the reloaded model lacks")
            export_run(model, self.tokenizer, cfg, self.run_dir / "export")
        qdist.barrier()

    def _count_skipped(self, step: int, metrics: dict) -> None:
        """Consecutive steps with a skipped update or a NaN/Inf reward (a reward function that keeps returning them
        is broken even when other groups still train); NonFiniteError at train.max_nonfinite_steps (0 = never)."""
        if not metrics.get("train/skipped_updates") and not metrics.get("groups/nonfinite_reward"):
            self.nonfinite_streak = 0
            return
        self.nonfinite_streak += 1
        limit = self.cfg.train.max_nonfinite_steps
        if limit and self.nonfinite_streak >= limit:
            raise NonFiniteError(
                f"step {step}: {self.nonfinite_cause}; {self.nonfinite_streak} consecutive steps met NaN/Inf "
                f"(train.max_nonfinite_steps={limit}): check the reward function for NaN/Inf and lower train.lr "
                "(checkpoints already written are kept)")

    def checkpoint(self, step: int) -> None:
        """Save after `step` completed steps (never non-finite weights), keeping output.keep_checkpoints."""
        from tqdm import tqdm

        self.check_weights_finite(step, doing="at the checkpoint")
        if self.distributed:
            path = save_sharded_checkpoint(
                self.run_dir, step, self.model, self.optimizer.optimizer if self.sharded else self.optimizer, keep=self.cfg.output.keep_checkpoints,
                nonfinite_total=self.nonfinite_total, nonfinite_streak=self.nonfinite_streak)
            if self.is_main:
                tqdm.write(f"[quarl] step {step}: checkpoint saved to {path}")
            return
        critic = {"critic": self.critic.state_dict()} if self.critic is not None else {}
        path = save_checkpoint(self.run_dir, step, self.model, self.optimizer, keep=self.cfg.output.keep_checkpoints,
                               nonfinite_total=self.nonfinite_total, nonfinite_streak=self.nonfinite_streak, **critic)
        tqdm.write(f"[quarl] step {step}: checkpoint saved to {path}")  # above the progress bar, not through it


def _fmt(metrics: dict) -> str:
    """"eval/accuracy" -> "accuracy=...", "eval_full/accuracy" (quantization off) -> "full_accuracy=..."."""
    def name(key: str) -> str:
        return key.replace("eval_full/", "full_") if key.startswith("eval_full/") else key.split("/", 1)[-1]

    return ", ".join(f"{name(k)}={v:.3f}" for k, v in metrics.items() if isinstance(v, float))


def train_from_config(config_path: str | None, overrides: list[str]) -> dict:
    """`quarl train CONFIG [key=value ...]`; `resume=RUN_DIR` continues a run with its saved config."""
    resume = [o for o in overrides if o.startswith("resume=")]
    if resume:
        run_dir = resume[-1].split("=", 1)[1]
        saved, earlier = saved_run(run_dir)
        rest = [o for o in overrides if not o.startswith("resume=")]
        cfg = load_config(saved, [f"{key}={value}" for key, value in earlier.items()] + rest +
                          [f"resume={run_dir}", f"output.dir={run_dir}"])
    else:
        cfg = load_config(config_path, overrides)
    return Trainer(cfg).train()
