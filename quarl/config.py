"""Run configuration: one YAML file plus dotted `key=value` overrides, validated into typed dataclasses.

    cfg = load_config("configs/demo.yaml", ["train.steps=5", "precision.flow=unified"])

Unknown keys fail with a suggestion, values are type-checked, and impossible combinations (e.g. `qlora` without
LoRA) fail with a message that says how to fix them. Names follow TRL/verl where the meaning is the same
(`num_generations`, `max_new_tokens`, `epsilon_high`, `kl_coef`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from quarl.fast_paths import FastPaths
from quarl.precision import LoraConfig, PrecisionConfig
from quarl.rl.critic import CriticConfig
from quarl.rl.mismatch_alarms import AlarmConfig
from quarl.rl.run_log import parse_report_to
from quarl.rl.objectives import LossConfig, get_correction

SAMPLERS = ("inverse-cdf", "gumbel")  # the fast engine's temperature samplers, default first
DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")  # what quarl.devices.resolve_device accepts


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type, or inconsistent."""


@dataclass
class ModelSection:
    # HF dir, hub id, .gguf path, the embedded default, or built-in random tiny-random-llama|qwen2|qwen3|qwen3-moe
    name: str = "smollm2-135m-instruct"
    gguf_file: str | None = None  # file name inside a hub repo or folder that holds several .gguf files
    revision: str | None = None  # hub revision (branch, tag or commit)
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N


@dataclass
class UAQSection:
    """Update-aware quantization (BRIEF §5): fold s into q/k/v, gate/up and the norms before them. 1.0 = off."""

    scale: float = 1.0  # UAQ s (QuRL uses 1.5); 1.0 = off


@dataclass
class AQNSection:
    """Adaptive quantization noise on the rollout model's RMSNorm weights (BRIEF §5). sigma_start = 0 -> off."""

    sigma_start: float = 0.0  # AQN noise std in the first noisy stage (QeRL: 1e-2); 0 = off
    sigma_end: float = 0.0  # std in the last stage; stages between decay geometrically
    stages: int = 10  # training is split into this many equal stages; stage 0 has no noise


@dataclass
class DataSection:
    train: str = "arithmetic"  # gsm8k | math500 | aime24 | arithmetic | a .jsonl/.parquet path | a hub id
    train_split: str = "train"  # split of data.train (hub datasets, gsm8k)
    eval: str | None = None  # None -> the held-out split of the train source
    eval_split: str = "test"  # split of the held-out source
    data_dir: str | None = None  # folder holding gsm8k/, math500/, aime24/ (else $QUARL_DATA_DIR or the samples)
    prompt_field: str | None = None  # question field of a JSONL/parquet/hub dataset (auto when None)
    answer_field: str | None = None  # gold-answer field (auto when None)
    gold_format: str | None = None  # gsm8k | boxed | plain (auto by source)
    limit: int | None = None  # use only the first N training examples
    eval_limit: int | None = 64  # held-out examples scored at each eval
    system_prompt: str | None = None  # system turn for the chat template
    prompt_template: str = "{prompt}"  # the user turn; {prompt} is the question
    chat_template: bool = True  # wrap the user turn with the tokenizer's chat template
    # synthetic arithmetic task (data.train=arithmetic)
    min_operand: int = 0  # smallest operand of the arithmetic task
    max_operand: int = 20  # largest operand
    ops: tuple[str, ...] = ("+",)  # operators drawn from: + - *
    num_train: int = 300  # arithmetic problems for training
    num_eval: int = 64  # disjoint arithmetic problems for held-out eval


@dataclass
class RewardSection:
    """A group with a NaN/Inf reward is dropped from the step's update and counted in groups/nonfinite_reward.

    Dropping only the affected groups (rather than skipping the step) keeps training on the answers that were
    scored; a step where every group is dropped skips its update, which counts toward train.max_nonfinite_steps.
    """

    # "module:function" user fn(completion, example) -> float; resuming a run directory runs the reward function named in its config.yaml
    function: str | None = None
    format_weight: float = 0.0  # add format_weight * format_reward
    format_pattern: str = r"(?s).*\S"  # regex a completion must match for the format reward


@dataclass
class RolloutSection:
    prompts_per_step: int = 8  # prompts per RL step (batch = prompts_per_step x num_generations)
    num_generations: int = 8  # G, answers per prompt (a group)
    max_new_tokens: int = 64  # answer length limit
    temperature: float = 1.0  # sampling temperature (> 0); log-probs are taken at the same temperature
    top_p: float = 1.0  # nucleus sampling (1.0 = off)
    top_k: int = 0  # top-k sampling (0 = off)
    stop: tuple[str, ...] = ()  # strings that end an answer (besides EOS)
    max_batch_size: int = 256  # sequences decoded at once (KV slots of the fast engine)
    engine: str = "auto"  # auto (fast on a GPU, reference on a CPU) | fast | reference
    sampler: str = "inverse-cdf"  # fast engine's temperature draws: inverse-cdf (one uniform per sequence) | gumbel
    # MoE models: the training forward routes each token to the experts the rollout chose (R3)
    router_replay: bool = False


@dataclass
class TrainSection:
    """A NaN/Inf loss or gradient norm skips that optimizer step (train/skipped_updates); NaN/Inf weights stop the run.

    Every step that catches a NaN/Inf (a dropped group or a skipped update) is counted in train/nonfinite_total and
    reported in one line; train.max_nonfinite_steps consecutive steps with a skipped update stop the run.
    """

    steps: int = 20  # RL steps
    seed: int = 0  # seeds sampling, data order and LoRA init
    lr: float = 1e-6  # AdamW learning rate (LoRA runs use ~1e-5)
    lr_schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0  # linear learning-rate warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    max_grad_norm: float = 1.0  # gradient clipping (global L2 norm)
    epochs: int = 1  # PPO epochs over each step's batch
    mini_batch_size: int | None = None  # sequences per optimizer step (None -> the whole batch)
    micro_batch_size: int = 8  # sequences per forward/backward (bounds memory)
    # cut micro-batches from the rows sorted by length, so each forward pads to lengths like its own rather than
    # to the longest answer of the batch (same loss and gradient up to summation order)
    group_by_length: bool = True
    gradient_checkpointing: bool = False  # recompute each decoder layer in backward: less memory, one more forward
    # score π_prox in a forward of its own even where the update's forward gives it (1 step/batch, no dropout)
    recompute_proximal: bool = False
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_refills: int = 3  # DAPO: extra rollouts to refill dropped groups, at most
    overlong_filter: bool = False  # DAPO: mask answers cut at max_new_tokens
    overlong_buffer: int = 0  # DAPO soft overlong punishment length (0 = off)
    overlong_penalty: float = 1.0  # DAPO: largest penalty of the soft overlong punishment
    # stop the run after this many consecutive steps whose update was skipped for NaN/Inf (0 = never stop)
    max_nonfinite_steps: int = 3


@dataclass
class EvalSection:
    every: int = 0  # held-out eval every N steps (0 = only before and after training)
    before: bool = True  # held-out eval before training
    after: bool = True  # held-out eval after training
    n: int = 1  # answers per held-out problem (avg@n, pass@n)
    temperature: float = 0.0  # 0 = greedy
    max_new_tokens: int | None = None  # None -> rollout.max_new_tokens
    # quantized flows: also score the trained policy with quantization off (eval_full/*; reference engine)
    full_precision: bool = True


@dataclass
class OutputSection:
    dir: str = "runs/demo"  # run directory (config, metrics, samples, checkpoints)
    checkpoint_every: int = 10  # steps between checkpoints (also saved at the end and on Ctrl-C / SIGTERM)
    keep_checkpoints: int = 2  # newest checkpoints kept in RUN_DIR/checkpoints (>= 1)
    samples_per_step: int = 4  # completions logged to samples.jsonl per step
    # experiment trackers mirroring metrics.jsonl: tensorboard (RUN_DIR/tb), wandb (pip install 'quarl[wandb]'); [] = none
    report_to: tuple[str, ...] = ("tensorboard",)
    tensorboard: bool = True  # false drops tensorboard from output.report_to (kept for older configs)
    wandb_project: str | None = None  # W&B project (None -> $WANDB_PROJECT, else "quarl")
    wandb_name: str | None = None  # W&B run name (None -> the run directory's name)
    export_hf: bool = False  # write a Hugging Face model directory (and PEFT adapters with LoRA) at the end
    progress: bool = True  # progress bars on long rollouts and evals


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    uaq: UAQSection = field(default_factory=UAQSection)
    aqn: AQNSection = field(default_factory=AQNSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    loss: LossConfig = field(default_factory=LossConfig)
    alarms: AlarmConfig = field(default_factory=AlarmConfig)  # mismatch drift warnings (docs/CORRECTIONS.md)
    critic: CriticConfig = field(default_factory=CriticConfig)  # PPO's value function (loss.advantage_estimator=gae)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    output: OutputSection = field(default_factory=OutputSection)
    fast_paths: FastPaths = field(default_factory=FastPaths)
    resume: str | None = None  # a run directory to continue from

    def validate(self) -> "RunConfig":
        # LoRA lives at the top level in YAML; the precision flow needs it to check qlora.
        self.precision.lora = self.lora
        # Dr.GRPO divides by answers x max_new_tokens; the trainer resolves an unset value the same way.
        loss = dataclasses.replace(self.loss, max_new_tokens=self.loss.max_new_tokens or self.rollout.max_new_tokens)
        for check in (self.precision.validate, loss.validate, self.alarms.validate, self.critic.validate):
            try:
                check()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        positive = {
            "rollout.prompts_per_step": self.rollout.prompts_per_step,
            "rollout.num_generations": self.rollout.num_generations,
            "rollout.max_new_tokens": self.rollout.max_new_tokens,
            "train.steps": self.train.steps,
            "train.epochs": self.train.epochs,
            "train.micro_batch_size": self.train.micro_batch_size,
            "output.checkpoint_every": self.output.checkpoint_every,
            "eval.n": self.eval.n,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{key}={value} must be >= 1")
        non_negative = {
            "train.warmup_steps": (self.train.warmup_steps, "0 = no warm-up"),
            "train.max_nonfinite_steps": (self.train.max_nonfinite_steps, "0 = never stop for NaN/Inf"),
            "eval.every": (self.eval.every, "0 = only before and after training"),
            "output.samples_per_step": (self.output.samples_per_step, "0 = log no completions"),
        }
        for key, (value, meaning) in non_negative.items():
            if value < 0:
                raise ConfigError(f"{key}={value} must be >= 0 ({meaning})")
        if self.output.keep_checkpoints < 1:
            raise ConfigError(f"output.keep_checkpoints={self.output.keep_checkpoints} must be >= 1 (the newest "
                              "checkpoint is always kept: resume needs it)")
        if self.eval.max_new_tokens is not None and self.eval.max_new_tokens < 1:
            raise ConfigError(f"eval.max_new_tokens={self.eval.max_new_tokens} must be >= 1, or null to use "
                              "rollout.max_new_tokens")
        if not (math.isfinite(self.train.lr) and self.train.lr > 0):
            raise ConfigError(f"train.lr={self.train.lr} must be a finite number > 0 (e.g. 1e-6 for full "
                              "fine-tuning, 1e-5 with LoRA)")
        if not self.train.max_grad_norm > 0:  # also NaN
            raise ConfigError(f"train.max_grad_norm={self.train.max_grad_norm} must be > 0 (the global gradient "
                              "norm is clipped to it; a negative value would reverse the gradient); default 1.0")
        try:  # "tensorboard,wandb" and "none" as on the command line; output.tensorboard=false folded in
            trackers = parse_report_to([part for item in self.output.report_to for part in item.split(",")])
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.output.report_to = tuple(t for t in trackers if t != "tensorboard" or self.output.tensorboard)
        if not self.output.dir.strip():
            raise ConfigError("output.dir is empty: give the run directory, e.g. output.dir=runs/my-run")
        if not DEVICE_NAME.fullmatch(self.model.device.strip().lower()):
            raise ConfigError(f"model.device={self.model.device!r}; choose auto, cpu, cuda or cuda:N (N = GPU index)")
        if self.rollout.temperature <= 0:
            raise ConfigError(
                f"rollout.temperature={self.rollout.temperature}: RL needs sampling (> 0); greedy answers to the same "
                "prompt are identical and give no advantage signal"
            )
        if self.eval.n > 1 and self.eval.temperature <= 0:
            raise ConfigError(f"eval.n={self.eval.n} needs eval.temperature > 0 (greedy answers would all be equal)")
        if self.rollout.num_generations < 2 and self.loss.advantage_estimator == "group":
            raise ConfigError(
                "rollout.num_generations must be >= 2: group-relative advantages compare answers to the same "
                f"prompt (got {self.rollout.num_generations}); PPO with a critic (loss.advantage_estimator=gae) "
                "can train on one answer per prompt"
            )
        check_critic(self)
        if self.rollout.engine not in ("auto", "fast", "reference"):
            raise ConfigError(f"rollout.engine={self.rollout.engine!r}; choose auto, fast or reference")
        if self.rollout.sampler not in SAMPLERS:
            raise ConfigError(f"rollout.sampler={self.rollout.sampler!r}; choose {' or '.join(SAMPLERS)}")
        if self.rollout.num_generations > self.rollout.max_batch_size:
            raise ConfigError(
                f"rollout.num_generations={self.rollout.num_generations} exceeds rollout.max_batch_size="
                f"{self.rollout.max_batch_size}: a group is decoded together; raise max_batch_size"
            )
        if self.precision.kv_cache != "auto" and self.rollout.engine == "reference":
            raise ConfigError(f"precision.kv_cache={self.precision.kv_cache} needs the fast engine; set "
                              "rollout.engine=fast (or auto on a GPU)")
        if self.precision.batch_invariant:
            if self.rollout.engine == "reference":
                raise ConfigError("precision.batch_invariant decodes on the fast engine, whose decode steps share the "
                                  "training forward's kernels; set rollout.engine=fast (or auto on a GPU)")
            differ = [text for text, bad in ((f"aqn.sigma_start={self.aqn.sigma_start}", self.aqn.sigma_start > 0),
                                             (f"rollout.top_p={self.rollout.top_p}", self.rollout.top_p < 1.0),
                                             (f"rollout.top_k={self.rollout.top_k}", self.rollout.top_k > 0)) if bad]
            if differ:
                raise ConfigError(f"precision.batch_invariant makes the rollout compute the training policy to the "
                                  f"bit, but {', '.join(differ)} makes it differ by design (AQN noise, top-p / top-k "
                                  "filtering): turn that off, or batch_invariant off")
        if self.train.lr_schedule not in ("constant", "cosine", "linear"):
            raise ConfigError(f"train.lr_schedule={self.train.lr_schedule!r}; choose constant, cosine or linear")
        batch = self.rollout.prompts_per_step * self.rollout.num_generations
        if self.train.mini_batch_size is not None and not 1 <= self.train.mini_batch_size <= batch:
            raise ConfigError(
                f"train.mini_batch_size={self.train.mini_batch_size} must be between 1 and the step's batch "
                f"(prompts_per_step x num_generations = {batch})"
            )
        if self.aqn.sigma_start < 0 or self.aqn.sigma_end < 0 or self.aqn.stages < 1:
            raise ConfigError("aqn.sigma_start and aqn.sigma_end must be >= 0 and aqn.stages >= 1")
        if self.aqn.sigma_start > 0 and self.precision.flow == "bf16":
            raise ConfigError(
                "aqn adds noise to the quantized rollout model; with precision.flow=bf16 there is no quantization "
                "noise to imitate. Use flow=split/qlora, or set aqn.sigma_start=0"
            )
        if self.uaq.scale <= 0:
            raise ConfigError(f"uaq.scale={self.uaq.scale} must be > 0 (1.0 = off; QuRL uses 1.5)")
        if self.uaq.scale != 1.0 and self.lora.enabled:
            raise ConfigError("uaq rescales the base weights for full fine-tuning; it has no effect with LoRA")
        warn_inert_clip(self)
        return self


def check_critic(cfg: "RunConfig") -> None:
    """The critic settings against the rest of the run: ConfigError when the actor would never train, a warning
    (UserWarning, one line) when critic.* keys are set but no critic runs."""
    import warnings

    critic = cfg.critic
    if cfg.loss.advantage_estimator != "gae":
        changed = [f"critic.{f.name}" for f in dataclasses.fields(CriticConfig)
                   if getattr(critic, f.name) != f.default]
        if changed:
            warnings.warn(f"{', '.join(changed)} set, but loss.advantage_estimator={cfg.loss.advantage_estimator}: "
                          "no critic runs; set loss.advantage_estimator=gae for PPO with a critic", UserWarning,
                          stacklevel=3)
        return
    if cfg.train.dynamic_sampling and cfg.rollout.num_generations < 2:
        raise ConfigError("train.dynamic_sampling drops groups whose rewards are all equal, which every one-answer "
                          "group is: with rollout.num_generations=1 nothing would train; set "
                          "train.dynamic_sampling=false (or num_generations >= 2)")
    if critic.warmup_steps >= cfg.train.steps:
        raise ConfigError(f"critic.warmup_steps={critic.warmup_steps} >= train.steps={cfg.train.steps}: the actor "
                          "would never train; lower critic.warmup_steps (e.g. a tenth of train.steps)")


RUN_SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))  # top-level keys, never read as TRL names


def warn_inert_clip(cfg: "RunConfig") -> str | None:
    """Warn (UserWarning, one line) when the config asks for a clip setting that one optimizer step cannot use.

    The clip binds only where π_θ ≠ π_prox, i.e. from the second optimizer step on a batch: with one epoch and one
    minibatch per batch, R = π_θ/π_prox = 1 at the only step, so correction=acr trains exactly like tis and an
    epsilon_high different from epsilon_low (explicit, or loss_type=dapo's 0.28) does nothing. (naive and bypass
    are exempt from the epsilon_high case: their R = π_θ/μ differs from 1 from the start.) Returns the message,
    or None when nothing is inert.
    """
    import warnings

    batch = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
    mini = cfg.train.mini_batch_size
    if cfg.train.epochs > 1 or (mini is not None and mini < batch):
        return None  # several optimizer steps per batch: the clip binds from the second one on
    loss = cfg.loss
    eps_high = loss.resolved_epsilon_high
    inert = []
    if loss.correction == "acr":
        inert.append("loss.correction=acr only differs from tis")
    if eps_high != loss.epsilon_low and not get_correction(loss.correction).anchor_is_behaviour:
        source = "loss_type=dapo's default" if loss.epsilon_high is None else "set"
        inert.append(f"loss.epsilon_high={eps_high:g} ({source}, != epsilon_low={loss.epsilon_low:g}) only acts")
    if not inert:
        return None
    message = (f"{' and '.join(inert)} when the clip binds, i.e. with several optimizer steps per batch, but this "
               f"config takes one (train.epochs=1, train.mini_batch_size={mini} covers the batch of {batch}): set "
               f"train.mini_batch_size below prompts_per_step x num_generations = {batch} (e.g. a quarter of it, "
               f"{max(batch // 4, 1)}) or train.epochs > 1")
    warnings.warn(message, UserWarning, stacklevel=3)
    return message


# ----------------------------------------------------------------------------------------------------------------
# dict -> dataclass with checks


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert) `value` to the annotated type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], key) for v in value)
        if len(args) != len(value):
            raise ConfigError(f"{key} must have {len(args)} elements, got {value!r}")
        return tuple(_coerce(v, a, key) for a, v in zip(args, value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value


# ----------------------------------------------------------------------------------------------------------------
# TRL names

# TRL (GRPOConfig / ModelConfig) name -> the quarl key with the same meaning. Accepted at the top level of a config
# (as TRL's flat config: `beta: 0.04`, `learning_rate=1e-5` on the command line) and inside the quarl key's own
# section (`loss.beta`); they are stored, and saved, under the quarl key.
TRL_ALIASES: dict[str, str] = {
    "beta": "loss.kl_coef",
    "epsilon": "loss.epsilon_low",
    "epsilon_high": "loss.epsilon_high",
    "loss_type": "loss.loss_type",
    "vllm_importance_sampling_cap": "loss.is_cap",
    "num_generations": "rollout.num_generations",
    "max_completion_length": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "learning_rate": "train.lr",
    "lr_scheduler_type": "train.lr_schedule",
    "warmup_steps": "train.warmup_steps",
    "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.max_grad_norm",
    "max_steps": "train.steps",
    "seed": "train.seed",
    "num_iterations": "train.epochs",
    "gradient_checkpointing": "train.gradient_checkpointing",
    "mask_truncated_completions": "train.overlong_filter",
    "eval_steps": "eval.every",
    "output_dir": "output.dir",
    "report_to": "output.report_to",
    "run_name": "output.wandb_name",
    "save_steps": "output.checkpoint_every",
    "save_total_limit": "output.keep_checkpoints",
    "model_name_or_path": "model.name",
    "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.targets",
}

# TRL names without a single quarl key: what to set instead (said in the unknown-key error).
TRL_UNMAPPED: dict[str, str] = {
    "per_device_train_batch_size": "TRL's per_device_train_batch_size counts completions per device and step; in "
    "quarl set rollout.prompts_per_step (prompts per step; the batch is prompts_per_step x num_generations) and "
    "train.micro_batch_size (sequences per forward/backward)",
    "gradient_accumulation_steps": "TRL's gradient_accumulation_steps has no quarl key: one RL step trains on "
    "rollout.prompts_per_step x rollout.num_generations answers, in train.micro_batch_size pieces",
    "generation_batch_size": "set rollout.prompts_per_step (prompts per step) instead of TRL's generation_batch_size",
    "steps_per_generation": "set train.mini_batch_size (sequences per optimizer step) instead of TRL's "
    "steps_per_generation",
    "reward_weights": "reward weights are given to quarl.train(reward_weights=[...]) with the reward functions",
}


# Keys an earlier quarl wrote into a run's config.yaml that no longer exist: such a config still loads (a resumed run),
# with a warning, and the value is ignored. Key -> why it went.
REMOVED_KEYS = {
    "fast_paths.stack_lora": "training LoRA stacking was removed (no measurable gain, and it changed how the bf16 "
                             "gradients round); the rollout still stacks adapters (fast_paths.stack_rollout_lora)",
}


# Keys added to the config after runs were saved without them, with the value that reproduces what such a run
# computed (a resumed run must not change behaviour halfway). Key -> value for a saved config.yaml that lacks it.
ADDED_KEYS = {
    "precision.smooth_alpha": 0.0,  # SmoothQuant: off before it existed; now on by default for int8 W8A8
    "precision.base_quantizer": "rtn",  # qlora bases were rounded to nearest before GPTQ existed
    "precision.kernel_forward": True,  # the quantized kernels in rollout, at every model size, before it was a choice
    "lora.init": "zeros",  # adapters started at B = 0 before they could start as a base-error correction
    # the unified flow quantized activations on bf16 GEMMs too before it left them unquantized there
    "precision.unified_weight_only_on_bf16": False,
}


def saved_run_defaults(path) -> dict[str, Any]:
    """{dotted key: value} for each `ADDED_KEYS` key that the saved run config at `path` (a run's config.yaml) does
    not set: what resuming that run must use instead of today's default."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    out = {}
    for key, value in ADDED_KEYS.items():
        section, name = key.split(".")
        if not isinstance(data.get(section), dict) or name not in data[section]:
            out[key] = value
    return out


def saved_run(run_dir) -> tuple[Path, dict[str, Any]]:
    """What `resume=RUN_DIR` loads: the run's config.yaml and the overrides that go under the caller's own
    (`saved_run_defaults`). Raises FileNotFoundError when RUN_DIR holds no saved config."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(f"resume={run_dir}: {saved} not found (is it a quarl run directory?)")
    return saved, saved_run_defaults(saved)


def _alias_hint(key: str) -> str | None:
    """"; did you mean loss.kl_coef (TRL's beta)?" for a TRL name, the explanation for a TRL name without one
    quarl key, else None."""
    if key in TRL_ALIASES:
        return f"; did you mean {TRL_ALIASES[key]} (TRL's {key})?"
    if key in TRL_UNMAPPED:
        return f"; {TRL_UNMAPPED[key]}"
    return None


def resolve_aliases(data: dict) -> dict:
    """A copy of a raw config mapping with TRL names (`TRL_ALIASES`) moved to their quarl keys.

    A TRL name is accepted at the top level or inside its quarl key's section (`loss.beta`); giving both the TRL
    name and the quarl key with different values is a ConfigError. Other keys are left for the loader to check.
    """
    if not isinstance(data, dict):
        return data
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    moves = []  # (where the alias was written, alias, section, key)
    for alias, target in TRL_ALIASES.items():
        section, key = target.split(".")
        if alias in out and alias not in RUN_SECTIONS:
            moves.append((alias, out.pop(alias), section, key))
        node = out.get(section)
        if isinstance(node, dict) and alias != key and alias in node:
            moves.append((f"{section}.{alias}", node.pop(alias), section, key))
    for written, value, section, key in moves:
        node = out.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{written} sets {section}.{key}, but {section} is a value, not a section")
        if key in node and node[key] != value:
            raise ConfigError(f"{written}={value!r} and {section}.{key}={node[key]!r} set the same key (TRL's name "
                              f"and quarl's); keep one")
        node[key] = value
    return out


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'the config'} must be a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields and full in REMOVED_KEYS:
            warnings.warn(f"config key {full} is ignored: {REMOVED_KEYS[full]}", stacklevel=2)
            continue
        if key not in fields:
            raise ConfigError(f"unknown config key {full!r}{_unknown_key_hint(str(key), fields, prefix)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{full} must be a section (a mapping of {full}.KEY: value), got {value!r}")
            kwargs[key] = _build(tp, value or {}, f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def _unknown_key_hint(key: str, fields: dict, prefix: str) -> str:
    """The tail of the unknown-key error: a close quarl key, the quarl key of a TRL name, or the valid keys."""
    hint = _alias_hint(key)
    if hint is not None:
        return hint
    close = difflib.get_close_matches(key, list(fields), n=1)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    close = difflib.get_close_matches(key, list(TRL_ALIASES), n=1)
    if close:
        return _alias_hint(close[0])
    return f"; valid keys: {', '.join(fields)}"


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """["train.steps=5", "lora.rank=16"] -> nested dict. Values are parsed as YAML scalars (5 -> int)."""
    data: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=5)")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return data


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(data: dict) -> RunConfig:
    """Build and validate a RunConfig from a nested mapping (TRL names accepted, see `resolve_aliases`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping of sections (model:, train:, ...), got {_kind(data)}")
    data = resolve_aliases(data)
    if isinstance(data.get("precision"), dict) and "lora" in data["precision"]:
        raise ConfigError("LoRA settings go in the top-level `lora:` section (lora.rank=...), not under precision")
    return _build(RunConfig, data, "").validate()


def _kind(value: Any) -> str:
    """"a list", "a string", ... for error messages about YAML values."""
    names = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), f"a {type(value).__name__}")


def read_config_file(path: str | Path) -> dict:
    """The raw mapping of a YAML config file (not yet checked against RunConfig). Raises ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if data is None:  # an empty file: all defaults
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, train:, ...), got "
                          f"{_kind(data)}")
    return data


def config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """A command line's optional CONFIG argument and its overrides: `quarl CMD key=value ...` (no YAML file) puts
    the first override where the file would be; it is moved back to the overrides."""
    overrides = list(overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config, *overrides]
    return config, overrides


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (None = all defaults), apply dotted overrides, validate. Raises ConfigError."""
    data = read_config_file(path) if path is not None else {}
    # TRL names resolve in each source apart, so that an override wins over the file's value of the same key
    data = _merge(resolve_aliases(data), resolve_aliases(parse_overrides(overrides or [])))
    return config_from_dict(data)


def config_to_dict(cfg: RunConfig) -> dict:
    """Plain nested dict (tuples become lists) suitable for YAML/JSON."""

    def plain(obj: Any) -> Any:
        if isinstance(obj, (list, tuple)):
            return [plain(v) for v in obj]
        if isinstance(obj, dict):
            return {k: plain(v) for k, v in obj.items()}
        return obj

    data = plain(dataclasses.asdict(cfg))
    data["precision"].pop("lora", None)  # stored at the top level
    return data


def effective_config_dict(cfg: RunConfig) -> dict:
    """`config_to_dict(cfg)` with the values left unset (null) filled in as validate() and the trainer resolve them:

    precision.format (the flow's default; "bf16" for flow=bf16), precision.weight_only, precision.smooth_alpha,
    precision.base_quantizer, lora.alpha (= rank), lora.init, loss.aggregation (by loss_type), loss.epsilon_high
    (0.28 for dapo, else epsilon_low), loss.max_new_tokens and eval.max_new_tokens (= rollout.max_new_tokens),
    train.mini_batch_size (= the step's batch) and data.eval (= the train source, whose held-out split is used).
    Values that depend on the machine (model.device, rollout.engine, precision.compute_dtype "auto"), on the model's
    hidden size (precision.kernel_forward, and precision.weight_only where the unified flow resolves it by that size)
    and on the data (data.gold_format, detected from the answers) stay as given.

    Args:
        cfg: a validated RunConfig.
    Returns:
        a plain nested dict (what `quarl config` prints).
    """
    data = config_to_dict(cfg)
    p, loss = cfg.precision, cfg.loss
    data["precision"]["format"] = p.resolved_format or "bf16"
    if p.weight_only_by_hidden_size:
        data["precision"]["weight_only"] = None  # the model's hidden size decides
    else:
        data["precision"]["weight_only"] = p.resolved_weight_only if p.flow != "bf16" else False
    data["precision"]["smooth_alpha"] = p.resolved_smooth_alpha
    data["precision"]["base_quantizer"] = p.resolved_base_quantizer
    data["lora"]["alpha"] = cfg.lora.alpha if cfg.lora.alpha is not None else float(cfg.lora.rank)
    data["lora"]["init"] = p.resolved_lora_init
    data["loss"]["aggregation"] = loss.resolved_aggregation
    data["loss"]["epsilon_high"] = loss.resolved_epsilon_high
    data["loss"]["max_new_tokens"] = loss.max_new_tokens or cfg.rollout.max_new_tokens
    data["eval"]["max_new_tokens"] = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    batch = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
    data["train"]["mini_batch_size"] = cfg.train.mini_batch_size or batch
    if cfg.data.eval is None:
        data["data"]["eval"] = cfg.data.train
    return data
