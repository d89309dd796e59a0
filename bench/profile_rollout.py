"""cProfile of the trainer's rollout phase on the 135m step-bench workload (`quarl bench step --model-size 135m
--prompts 16 --samples 8 --prompt-len 40 --max-new-tokens 16`), per setting named on the command line:

    python bench/profile_rollout.py bf16 split:int8

3 warm-up steps, then 5 steps with the rollout phase under cProfile; prints each setting's rollout and step times
and its top functions by own and by cumulative time: where a small model's quantized rollout spends host time
(bench/results/step.md). cProfile slows Python roughly 2x.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time

import torch

from quarl.bench import step as bench_step
from quarl.rl.trainer import Trainer

WORKLOAD = ["--model-size", "135m", "--prompts", "16", "--samples", "8", "--prompt-len", "40",
            "--max-new-tokens", "16", "--set", "train.micro_batch_size=32"]
WARMUP, PROFILED, ROWS = 3, 5, 30


def profile_setting(name: str, device: torch.device) -> None:
    parser = argparse.ArgumentParser()
    bench_step.add_bench_step_arguments(parser)
    args = parser.parse_args([*WORKLOAD, "--settings", name])
    setting = bench_step.parse_settings(name)[0]
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = bench_step.run_config(args, setting, run_dir, device)
        model = bench_step.make_model("135m", device, 0)
        task = bench_step.synthetic_task(args.prompts * (WARMUP + PROFILED), args.prompt_len,
                                         model.config.vocab_size, 0)
        trainer = Trainer(cfg, model=model, tokenizer=bench_step.TokenIdTokenizer(), task=task)
        trainer.engine.tokenizer = None  # token-id mode, as the step bench runs it
        trainer.prepare_run_dir()
        for step in range(WARMUP):
            trainer.step(step)
        profile, rollout = cProfile.Profile(), trainer.rollout

        def profiled_rollout(step):
            profile.enable()
            try:
                out = rollout(step)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                return out
            finally:
                profile.disable()

        trainer.rollout = profiled_rollout
        start = time.perf_counter()
        for step in range(WARMUP, WARMUP + PROFILED):
            metrics = trainer.step(step)
        step_s = (time.perf_counter() - start) / PROFILED
        print(f"{name}: rollout {metrics['time/rollout_s']:.3f} s, step {step_s:.3f} s (profiled)")
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(ROWS)
            print(text.getvalue())
        trainer.log.close()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python bench/profile_rollout.py SETTING [SETTING ...]   (e.g. bf16 split:int8)")
    for setting_name in sys.argv[1:]:
        profile_setting(setting_name, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
