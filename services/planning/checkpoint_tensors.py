"""The tensors a Hugging Face checkpoint of a supported architecture stores, from config.json
alone: name, shape and tensor class. Torch-free (the operator plans memory with it).

Tensor classes:
- embedding: `embed_tokens`, `lm_head` (absent when tied), an MTP layer's own copies;
- attention: `self_attn.*`, including Qwen3's q/k norms and MLA's latent norms;
- dense_mlp: a dense layer's SwiGLU; shared_experts: DeepSeek-V3's shared SwiGLU;
- router: the MoE gate (`gate.weight`, DeepSeek-V3's `gate.e_score_correction_bias`);
- norm: the decoder layers' and the final RMSNorm, MTP's `enorm` / `hnorm` / `shared_head.norm`;
- routed_experts: every routed expert's SwiGLU; other: MTP's `eh_proj`.

Names follow the released checkpoints (and transformers 5's `save_pretrained`): routed experts
per expert, `...experts.{e}.{gate_proj,up_proj,down_proj}.weight` (Mixtral:
`block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`). The fused 3-D layout
(`...experts.gate_up_proj` [E, 2I, H], `...experts.down_proj` [E, H, I]) is listed apart, as
`fused_alternatives`, for an index that stores it.

`quantizable` marks what a DeepSeek-style FP8 block-quantized checkpoint stores in FP8 with a
float32 `weight_scale_inv` per block: every linear inside a decoder layer (attention, dense
MLP, shared and routed experts). Embeddings, lm_head, norms, the router and MTP's `eh_proj`
stay in the checkpoint dtype, as in DeepSeek-V3's release.

DeepSeek-V3 multi-token-prediction layers (`num_nextn_predict_layers`, stored as layers
num_hidden_layers.. of the checkpoint) are marked `mtp`: stored, not loaded by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

TENSOR_CLASSES = (
    "embedding",
    "attention",
    "dense_mlp",
    "shared_experts",
    "router",
    "norm",
    "routed_experts",
    "other",
)
SUPPORTED_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)


_SWIGLU = ("gate_proj", "up_proj", "down_proj")


class ModelConfigError(ValueError):
    """config.json lacks a field, holds a bad value or names an unsupported architecture."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    tensor_class: str  # one of TENSOR_CLASSES
    mtp: bool = False  # part of a multi-token-prediction layer
    quantizable: bool = False  # stored in FP8 (+ weight_scale_inv) by a block-quantized checkpoint

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class CheckpointLayout:
    architecture: str
    tensors: tuple[TensorSpec, ...]  # what the checkpoint stores
    fused_alternatives: tuple[TensorSpec, ...]  # fused 3-D routed-expert tensors, another layout of the same
    num_layers: int  # decoder layers the engine runs (MTP layers not included)
    moe_layer_ids: tuple[int, ...]  # which of them are MoE
    num_experts: int  # routed experts per MoE layer (0: dense)
    num_mtp_layers: int


def architecture(config: dict) -> str:
    archs = config.get("architectures") or ["LlamaForCausalLM"]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(f"unsupported architecture {archs[0]!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def field(config: dict, name: str, default: object = ...) -> int:
    """A positive integer field of config.json (or `default` when absent and one is given)."""
    value = config.get(name)
    if value is None:
        if default is ...:
            raise ModelConfigError(f"config.json lacks {name!r}")
        return default  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelConfigError(f"config.json field {name!r} must be a non-negative integer, got {value!r}")
    return value


def checkpoint_tensors(config: dict) -> CheckpointLayout:
    if not isinstance(config, dict):
        raise ModelConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
    arch = architecture(config)
    return _Builder(arch, config).build()


class _Builder:
    def __init__(self, arch: str, config: dict):
        self.arch, self.c = arch, config
        self.tensors: list[TensorSpec] = []
        self.fused: list[TensorSpec] = []
        self.hidden = field(config, "hidden_size")
        self.num_layers = field(config, "num_hidden_layers")
        self.vocab = field(config, "vocab_size")
        self.num_heads = field(config, "num_attention_heads")
        if self.hidden == 0 or self.num_heads == 0:
            raise ModelConfigError("config.json: hidden_size and num_attention_heads must be positive")
        self.num_kv_heads = field(config, "num_key_value_heads", self.num_heads)
        self.head_dim = field(config, "head_dim", self.hidden // self.num_heads)
        self.bias = bool(config.get("attention_bias", False))
        if arch == "DeepseekV3ForCausalLM":
            self.num_experts = field(config, "n_routed_experts", 0)
        elif arch == "Qwen3MoeForCausalLM":
            # transformers 5 writes num_local_experts
            self.num_experts = field(config, "num_experts", 0) or field(config, "num_local_experts", 0)
        elif arch == "MixtralForCausalLM":
            self.num_experts = field(config, "num_local_experts")
        else:
            self.num_experts = 0
        self.num_mtp = field(config, "num_nextn_predict_layers", 0) if arch == "DeepseekV3ForCausalLM" else 0
        only = config.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise ModelConfigError(f"config.json field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
        self.mlp_only_layers = set(only)

    def add(self, name: str, shape: tuple[int, ...], cls: str, mtp: bool, quantizable: bool = False) -> None:
        self.tensors.append(TensorSpec(name, shape, cls, mtp, quantizable))

    def linear(self, prefix: str, out: int, inp: int, cls: str, mtp: bool, bias: bool = False) -> None:
        self.add(f"{prefix}.weight", (out, inp), cls, mtp, quantizable=True)
        if bias:
            self.add(f"{prefix}.bias", (out,), cls, mtp)

    def swiglu(self, prefix: str, inter: int, cls: str, mtp: bool, names=_SWIGLU, bias: bool = False) -> None:
        gate, up, down = names
        self.linear(f"{prefix}.{gate}", inter, self.hidden, cls, mtp, bias)
        self.linear(f"{prefix}.{up}", inter, self.hidden, cls, mtp, bias)
        self.linear(f"{prefix}.{down}", self.hidden, inter, cls, mtp, bias)

    def is_moe_layer(self, i: int) -> bool:
        """HF's rule per family (DeepSeek-V3: i >= first_k_dense_replace and i % moe_layer_freq
        == 0; Qwen3-MoE: i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
        c = self.c
        if self.num_experts == 0:
            return False
        if self.arch == "DeepseekV3ForCausalLM":
            freq = field(c, "moe_layer_freq", 1) or 1
            return i >= field(c, "first_k_dense_replace", 0) and i % freq == 0
        if self.arch == "Qwen3MoeForCausalLM":
            step = field(c, "decoder_sparse_step", 1) or 1
            return i not in self.mlp_only_layers and (i + 1) % step == 0
        return True  # Mixtral

    def build(self) -> CheckpointLayout:
        h = self.hidden
        self.add("model.embed_tokens.weight", (self.vocab, h), "embedding", False)
        for i in range(self.num_layers + self.num_mtp):
            self.layer(i, mtp=i >= self.num_layers)
        self.add("model.norm.weight", (h,), "norm", False)
        if not self.c.get("tie_word_embeddings", False):
            self.add("lm_head.weight", (self.vocab, h), "embedding", False)
        return CheckpointLayout(
            self.arch,
            tuple(self.tensors),
            tuple(self.fused),
            self.num_layers,
            tuple(i for i in range(self.num_layers) if self.is_moe_layer(i)),
            self.num_experts,
            self.num_mtp,
        )

    def layer(self, i: int, mtp: bool) -> None:
        p, h = f"model.layers.{i}", self.hidden
        if mtp:  # DeepSeek-V3 MTP module: its own embedding + head copies, two norms and eh_proj
            self.add(f"{p}.embed_tokens.weight", (self.vocab, h), "embedding", True)
            self.add(f"{p}.enorm.weight", (h,), "norm", True)
            self.add(f"{p}.hnorm.weight", (h,), "norm", True)
            self.add(f"{p}.eh_proj.weight", (h, 2 * h), "other", True)
            self.add(f"{p}.shared_head.norm.weight", (h,), "norm", True)
            self.add(f"{p}.shared_head.head.weight", (self.vocab, h), "embedding", True)
        self.add(f"{p}.input_layernorm.weight", (h,), "norm", mtp)
        self.add(f"{p}.post_attention_layernorm.weight", (h,), "norm", mtp)
        if self.arch == "DeepseekV3ForCausalLM":
            self.mla_attention(f"{p}.self_attn", mtp)
        else:
            self.gqa_attention(f"{p}.self_attn", mtp)
        if self.is_moe_layer(i):
            self.moe(p, mtp)
        else:
            bias = self.arch == "LlamaForCausalLM" and bool(self.c.get("mlp_bias", False))
            self.swiglu(f"{p}.mlp", field(self.c, "intermediate_size"), "dense_mlp", mtp, bias=bias)

    def gqa_attention(self, p: str, mtp: bool) -> None:
        h, q, kv = self.hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = self.bias and self.arch != "MixtralForCausalLM"  # HF Mixtral has no attention biases
        self.linear(f"{p}.q_proj", q, h, "attention", mtp, bias)
        self.linear(f"{p}.k_proj", kv, h, "attention", mtp, bias)
        self.linear(f"{p}.v_proj", kv, h, "attention", mtp, bias)
        self.linear(f"{p}.o_proj", h, q, "attention", mtp, bias)
        if self.arch == "Qwen3MoeForCausalLM":
            self.add(f"{p}.q_norm.weight", (self.head_dim,), "attention", mtp)
            self.add(f"{p}.k_norm.weight", (self.head_dim,), "attention", mtp)

    def mla_attention(self, p: str, mtp: bool) -> None:
        c, h, heads = self.c, self.hidden, self.num_heads
        kv_lora, nope, rope = field(c, "kv_lora_rank"), field(c, "qk_nope_head_dim"), field(c, "qk_rope_head_dim")
        v_dim, q_lora = field(c, "v_head_dim"), field(c, "q_lora_rank", 0)
        if q_lora:
            self.linear(f"{p}.q_a_proj", q_lora, h, "attention", mtp, self.bias)
            self.add(f"{p}.q_a_layernorm.weight", (q_lora,), "attention", mtp)
            self.linear(f"{p}.q_b_proj", heads * (nope + rope), q_lora, "attention", mtp)
        else:
            self.linear(f"{p}.q_proj", heads * (nope + rope), h, "attention", mtp)
        self.linear(f"{p}.kv_a_proj_with_mqa", kv_lora + rope, h, "attention", mtp, self.bias)
        self.add(f"{p}.kv_a_layernorm.weight", (kv_lora,), "attention", mtp)
        self.linear(f"{p}.kv_b_proj", heads * (nope + v_dim), kv_lora, "attention", mtp)
        self.linear(f"{p}.o_proj", h, heads * v_dim, "attention", mtp, self.bias)

    def moe(self, p: str, mtp: bool) -> None:
        c, h, e = self.c, self.hidden, self.num_experts
        if self.arch == "MixtralForCausalLM":
            inter, block, names = field(c, "intermediate_size"), f"{p}.block_sparse_moe", ("w1", "w3", "w2")
        else:
            inter, block, names = field(c, "moe_intermediate_size"), f"{p}.mlp", _SWIGLU
        self.add(f"{block}.gate.weight", (e, h), "router", mtp)
        if self.arch == "DeepseekV3ForCausalLM":
            self.add(f"{block}.gate.e_score_correction_bias", (e,), "router", mtp)
            shared = field(c, "n_shared_experts", 0)
            if shared:
                self.swiglu(f"{block}.shared_experts", inter * shared, "shared_experts", mtp)
        for expert in range(e):
            self.swiglu(f"{block}.experts.{expert}", inter, "routed_experts", mtp, names)
        for prefix in {f"{p}.mlp.experts", f"{block}.experts"}:
            self.fused.append(TensorSpec(f"{prefix}.gate_up_proj", (e, 2 * inter, h), "routed_experts", mtp, True))
            self.fused.append(TensorSpec(f"{prefix}.down_proj", (e, h, inter), "routed_experts", mtp, True))
