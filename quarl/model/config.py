"""`ModelConfig`: the decoder's shape and numerics, read from a Hugging Face config.

One dataclass for the three supported families (they differ only in a few switches):

| family (model_type) | HF class            | switches                                                        |
|---------------------|---------------------|-----------------------------------------------------------------|
| `llama` (SmolLM2)   | LlamaForCausalLM    | optional q/k/v/o bias (`attention_bias`), llama3 rope scaling    |
| `qwen2` (Qwen2.5)   | Qwen2ForCausalLM    | q/k/v bias always on, o_proj without bias                        |
| `qwen3`             | Qwen3ForCausalLM    | RMSNorm on q and k per head (`qk_norm`), head_dim given apart    |
| `qwen3_moe`         | Qwen3MoeForCausalLM | qwen3 attention; sparse MoE MLPs (`num_experts` > 0, see below)  |

Mixture of experts (qwen3_moe): a layer i gets a sparse MoE block (a router over `num_experts` SwiGLU experts of
width `moe_intermediate_size`, `num_experts_per_tok` of them per token) unless i is in `mlp_only_layers` or
(i + 1) is not a multiple of `decoder_sparse_step`; such layers keep a dense MLP of width `intermediate_size`.

Both config styles are read: transformers < 5 (`rope_theta` + `rope_scaling`) and transformers >= 5
(`rope_parameters`). `to_hf_dict()` writes both, so either version loads what we save.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "qwen3_moe": "Qwen3MoeForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _supported_list() -> str:
    return ", ".join(f"{cls} (model_type {mt!r})" for mt, cls in SUPPORTED_ARCHITECTURES.items())


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture is not one the decoder implements."""


@dataclass
class ModelConfig:
    """Decoder hyper-parameters (names follow the meaning, HF names are mapped in `from_hf`)."""

    architecture: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" (the HF model_type)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF keys: rope_type, factor, low_freq_factor, high_freq_factor, ...
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    attention_out_bias: bool = False  # bias on o_proj (llama / qwen3 with attention_bias; never qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before rope
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    num_experts: int = 0  # experts per MoE layer (0 = a dense model)
    num_experts_per_tok: int = 0  # top-k: experts each token is routed to
    moe_intermediate_size: int = 0  # hidden width of each expert's SwiGLU MLP
    norm_topk_prob: bool = False  # renormalise the k chosen routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here (dense MLP)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "ModelConfig":
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} is not supported; supported: {_supported_list()}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs whole groups of query heads per key/value head"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_experts:
            self._validate_moe()
        elif self.architecture == "qwen3_moe":
            raise ValueError("a qwen3_moe config needs num_experts > 0 (num_local_experts in transformers >= 5)")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES} "
                "(remove rope_scaling from the config to use plain rotary embeddings)"
            )
        if rope_type in ("linear", "llama3") and "factor" not in self.rope_scaling:
            raise ValueError(f"rope_scaling of type {rope_type!r} needs a 'factor': {self.rope_scaling}")
        if rope_type == "llama3":
            missing = {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} - set(
                self.rope_scaling
            )
            if missing:
                raise ValueError(f"llama3 rope_scaling is missing {sorted(missing)}: {self.rope_scaling}")
        return self

    def _validate_moe(self) -> None:
        if self.architecture != "qwen3_moe":
            raise ValueError(f"num_experts={self.num_experts} is set, but mixture-of-experts layers exist only in "
                             f"qwen3_moe models, not {self.architecture}; set num_experts=0")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                             f"num_experts={self.num_experts}")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be a positive integer")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1 (1 = every layer sparse)")
        bad = [i for i in self.mlp_only_layers if not 0 <= int(i) < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layer indices of a {self.num_layers}-layer model")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has a sparse MoE block (else a dense MLP), as transformers decides."""
        return self.num_experts > 0 and layer_idx not in self.mlp_only_layers and \
            (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers with a sparse MoE block, in order (empty for a dense model)."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Build from a config.json dict or a `transformers.PretrainedConfig`.

        Raises UnsupportedArchitectureError for other model types (the message lists the supported ones).
        """
        d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type is None and archs:
            model_type = {cls_name: mt for mt, cls_name in SUPPORTED_ARCHITECTURES.items()}.get(archs[0])
        if model_type not in SUPPORTED_ARCHITECTURES:
            shown = model_type if model_type is not None else (archs[0] if archs else "<none given>")
            raise UnsupportedArchitectureError(
                f"model architecture {shown!r} is not supported; supported: {_supported_list()}"
            )
        if d.get("use_sliding_window"):
            raise ValueError(
                "the config enables sliding-window attention (use_sliding_window=true), which the decoder does not "
                "implement; set use_sliding_window=false (Qwen2.5 and Qwen3 checkpoints ship with it off)"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported; the decoder uses SiLU-gated MLPs")

        rope_params = d.get("rope_parameters") or {}
        if any(isinstance(v, dict) for v in rope_params.values()):
            raise ValueError(
                "per-layer-type rope_parameters are not supported by the decoder (one rope for all layers)"
            )
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        scaling = d.get("rope_scaling") or {k: v for k, v in rope_params.items() if k != "rope_theta"}
        scaling = dict(scaling) if scaling else None
        if scaling is not None:
            if "rope_type" not in scaling and "type" in scaling:
                scaling["rope_type"] = scaling.pop("type")
            scaling.pop("rope_theta", None)
            if scaling.get("rope_type", "default") == "default":
                scaling = None

        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)])
        attn_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes bias on q/k/v (and none on o_proj) regardless of the config.
            attention_bias=True if model_type == "qwen2" else attn_bias,
            attention_out_bias=False if model_type == "qwen2" else attn_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **(_moe_fields(d) if model_type == "qwen3_moe" else {}),
        )

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict:
        """A config.json dict that transformers (4.x and 5.x) loads as the matching *ForCausalLM."""
        if self.architecture == "qwen2" and (not self.attention_bias or self.attention_out_bias):
            raise ValueError("qwen2 checkpoints always have q/k/v bias and no o_proj bias; this config differs")
        if self.attention_bias != self.attention_out_bias and self.architecture != "qwen2":
            raise ValueError(f"{self.architecture} has one attention_bias switch for q/k/v/o; this config differs")
        d: dict[str, Any] = {
            "architectures": [SUPPORTED_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": {"rope_type": self.rope_type, "rope_theta": self.rope_theta,
                                **{k: v for k, v in (self.rope_scaling or {}).items() if k != "rope_type"}},
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids))
            if self.eos_token_ids else None,
            "use_cache": True,
        }
        if self.architecture == "qwen2":
            d.update(use_sliding_window=False, sliding_window=None)
        else:
            d["attention_bias"] = self.attention_bias
        if self.architecture in ("qwen3", "qwen3_moe"):
            d.update(use_sliding_window=False, sliding_window=None)
        if self.architecture == "qwen3_moe":
            # num_experts (transformers < 5, the published checkpoints) and num_local_experts (>= 5) both
            d.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))
        if self.architecture == "llama":
            d["mlp_bias"] = self.mlp_bias
        elif self.mlp_bias:
            raise ValueError(f"{self.architecture} has no mlp_bias option; this config differs")
        if torch_dtype is not None:
            d["torch_dtype"] = torch_dtype
        return d


def _moe_fields(d: dict) -> dict:
    """ModelConfig's MoE fields from a qwen3_moe config dict (num_experts, or num_local_experts from
    transformers >= 5)."""
    experts = d.get("num_local_experts", d.get("num_experts"))
    if experts is None:
        raise KeyError("num_experts")
    return dict(num_experts=int(experts), num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=[int(i) for i in d.get("mlp_only_layers") or []])
