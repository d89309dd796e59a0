"""One rank of a test run on many processes: `python -m torch.distributed.run --nproc_per_node N
tests/distributed_worker.py RECORD.pt key=value ...` trains the tiny model with those overrides and, on rank 0,
saves to RECORD.pt every rollout (token ids and behaviour log-probs per answer, by step), every step's metrics, the
trainable weights gathered whole (float32) as the first rollout found them ("start") and after every step, and the
number of held-out problems rank 0 answered in each evaluation ("eval_problems")."""

import sys

import torch

import quarl.rl.trainer as trainer_module
from quarl.config import load_config
from quarl.distributed import end_process
from quarl.rl.sharding import full_value
from quarl.rl.trainer import Trainer


def main(record_path: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config(None, overrides))
    record = {"rollouts": {}, "metrics": {}, "weights": {}, "start": None, "eval_problems": []}
    evaluate = trainer_module.evaluate

    def counted_evaluate(engine, task, examples, **kwargs):
        record["eval_problems"].append(len(examples))
        return evaluate(engine, task, examples, **kwargs)

    trainer_module.evaluate = counted_evaluate

    def weights():  # every rank takes part in the gathers
        return {n: full_value(p).float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    rollout, step_fn, close = trainer.rollout, trainer.step, trainer.close

    def recorded_rollout(step):
        if record["start"] is None:
            record["start"] = weights()
        out = rollout(step)
        record["rollouts"][step + 1] = [[(c.token_ids, c.logprobs) for c in o.completions] for o in out[1]]
        return out

    def recorded_step(step):
        metrics = step_fn(step)
        record["metrics"][step + 1] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        record["weights"][step + 1] = weights()
        return metrics

    def recorded_close():
        if trainer.is_main:
            torch.save(record, record_path)
        close()

    trainer.rollout, trainer.step, trainer.close = recorded_rollout, recorded_step, recorded_close
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    end_process(0)  # as `quarl train` ends a rank (see there)
