"""Rollout: batched, KV-cached sampling of groups of completions with behaviour log-probs.

`RolloutEngine(model, tokenizer).generate(prompts, n=G, ...)` -> one `RequestOutput` per prompt holding G
`Completion`s (token ids, text, behaviour log-probs, finish reason). See quarl/rollout/engine.py.
"""

from quarl.rollout.engine import Completion, RequestOutput, RolloutEngine
from quarl.rollout.sampling import SamplingParams

__all__ = ["Completion", "RequestOutput", "RolloutEngine", "SamplingParams"]
