"""quarl: RL post-training of LLMs with low-precision rollouts (INT8, FP8, NVFP4)."""

__version__ = "0.1.0"
