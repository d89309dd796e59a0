"""quarl: RL post-training of LLMs with low-precision rollouts (INT8, FP8, NVFP4).

    import quarl
    result = quarl.train("configs/demo.yaml", reward_fns=[my_reward], dataset=my_records, max_steps=10)

`quarl.train`, `quarl.TrainResult`, `quarl.make_config` (quarl.api), `quarl.per_sample` (quarl.tasks.rewards),
`quarl.load_config`, `quarl.RunConfig`, `quarl.ConfigError` (quarl.config) are imported on first use, so that
`import quarl` stays light (no torch) until one of them is needed.
"""

__version__ = "0.1.0"

_LAZY = {
    "train": "quarl.api",
    "make_config": "quarl.api",
    "TrainResult": "quarl.api",
    "per_sample": "quarl.tasks.rewards",
    "load_config": "quarl.config",
    "RunConfig": "quarl.config",
    "ConfigError": "quarl.config",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'quarl' has no attribute {name!r}")
