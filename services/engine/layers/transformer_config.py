"""The transformer hyper-parameters every model file reads, parsed from a HF config dict."""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.engine.layers.rope_scaling import RopeScaling


@dataclass(frozen=True)
class TransformerConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)  # the rest, for MoE fields

    @classmethod
    def from_hf(cls, hf: dict) -> TransformerConfig:
        """Raises ModelLoadError for a rope_scaling the engine cannot serve."""
        architectures = hf.get("architectures") or ["LlamaForCausalLM"]
        num_heads = hf["num_attention_heads"]
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        params = hf.get("rope_parameters")  # transformers 5 nests theta and scaling here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", params.get("type", "default")) != "default":
                rope_scaling = params
        return cls(
            architecture=architectures[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=RopeScaling.from_hf(rope_scaling, hf),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            hf_config=hf,
        )
