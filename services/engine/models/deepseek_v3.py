"""DeepSeek-V3: multi-head latent attention (MLA) and DeepSeekMoE.

Attention: q = q_proj(x), or q_b_proj(rms(q_a_proj(x))) when `q_lora_rank` is set; per head
[q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)]. kv_a_proj_with_mqa(x) = [latent
(kv_lora_rank) | k_rope (qk_rope_head_dim, one head shared by all)]; the latent goes through
kv_a_layernorm. The paged cache stores the normalized latent and the rotated k_rope only (see
layers/mla_attention.py for the prefill and absorbed decode paths). RoPE rotates interleaved
pairs when `rope_interleave` (HF's default), the two halves otherwise. With YaRN (the released
checkpoint's rope_scaling) the rotary table holds the YaRN frequencies and cos/sin factor, and
the softmax scale is multiplied by mscale(factor, mscale_all_dim)^2, as DeepSeek's reference and
transformers do.

FFN: the first `first_k_dense_replace` layers are dense SwiGLU MLPs; the rest are DeepSeekMoE:
grouped sigmoid routing with the selection-only `e_score_correction_bias`, -inf group masking,
`routed_scaling_factor`, plus `n_shared_experts` shared experts (one SwiGLU of
n_shared_experts * moe_intermediate_size). Multi-token-prediction layers (index >=
num_hidden_layers, e.g. layer 61 of the released checkpoint) are skipped when loading.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.layernorm import RMSNorm
from moemesh.engine.layers.mla_attention import MLAAttention
from moemesh.engine.layers.moe import GatingConfig, SparseMoE
from moemesh.engine.layers.rope_scaling import RopeScaling, yarn_mscale
from moemesh.engine.layers.rotary import RotaryEmbedding
from moemesh.engine.layers.transformer_config import TransformerConfig
from moemesh.engine.models.llama import LlamaMLP
from moemesh.engine.models.moe_model import MoEForCausalLM

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps


class DeepseekV3Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        hf = cfg.hf_config
        self.num_heads = cfg.num_heads
        self.q_lora_rank, self.kv_lora_rank = hf.get("q_lora_rank"), hf["kv_lora_rank"]
        self.qk_nope_head_dim, self.qk_rope_head_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        self.v_head_dim = hf["v_head_dim"]
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = cfg.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        kv_b_size = self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, kv_b_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, cfg.hidden_size, bias=bias)
        interleaved = hf.get("rope_interleave", True)
        self.rotary_emb = RotaryEmbedding(
            self.qk_rope_head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling, is_neox_style=not interleaved
        )
        self.attn = MLAAttention(
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
            scale=qk_head_dim**-0.5 * _softmax_scale_factor(cfg.rope_scaling),
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [num_tokens, H * qk_head_dim]
        q = q.view(-1, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # [num_tokens, kv_lora_rank]
        q_rope, k_rope = self.rotary_emb(positions, q_rope.contiguous(), k_rope.contiguous()[:, None, :])
        o = self.attn(q_nope, q_rope, latent, k_rope[:, 0], self.kv_b_proj.weight, meta)  # [T, H, v_head_dim]
        return self.o_proj(o.reshape(-1, self.num_heads * self.v_head_dim))


def _softmax_scale_factor(scaling: RopeScaling | None) -> float:
    """DeepSeek's YaRN correction of the softmax scale: mscale(factor, mscale_all_dim)^2 when the
    checkpoint sets mscale_all_dim (on top of the cos/sin factor the rotary table holds)."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


class DeepseekV3ForCausalLM(MoEForCausalLM):
    def read_moe_config(self, hf: dict) -> int:
        num_experts = hf["n_routed_experts"]
        self.gating = GatingConfig(
            num_experts,
            hf["num_experts_per_tok"],
            renormalize=bool(hf.get("norm_topk_prob", True)),
            method="grouped_topk",
            scoring_func=hf.get("scoring_func", "sigmoid"),
            num_expert_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        )
        self.moe_intermediate_size = hf["moe_intermediate_size"]
        self.num_shared_experts = hf.get("n_shared_experts") or 0
        self.first_k_dense_replace = hf.get("first_k_dense_replace") or 0
        return num_experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def make_attention(self, layer: int) -> nn.Module:
        return DeepseekV3Attention(self.cfg)

    def make_mlp(self, layer: int, moe_layer: int | None) -> nn.Module:
        hidden = self.cfg.hidden_size
        if moe_layer is None:
            return LlamaMLP(hidden, self.cfg.intermediate_size)
        shared = None
        if self.num_shared_experts:
            shared = LlamaMLP(hidden, self.moe_intermediate_size * self.num_shared_experts)
        return SparseMoE(
            moe_layer,
            hidden,
            self.moe_intermediate_size,
            self.gating,
            self.moe_runtime,
            shared_experts=shared,
            has_correction_bias=True,
            float32_logits=True,
        )

    def skip_weight(self, name: str) -> bool:
        m = _LAYER_INDEX.match(name)
        return super().skip_weight(name) or (m is not None and int(m.group(1)) >= self.cfg.num_layers)
