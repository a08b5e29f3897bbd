"""Qwen3-MoE: GQA attention with per-head RMSNorm on q and k (before RoPE), softmax top-k routing
(`norm_topk_prob` renormalizes), no shared experts. Layer i is MoE when it is not in
`mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; the others are dense SwiGLU MLPs."""

from __future__ import annotations

import torch
from torch import nn

from moemesh import kernels
from moemesh.engine.layers.attention import Attention
from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.moe import GatingConfig, SparseMoE
from moemesh.engine.layers.rotary import RotaryEmbedding
from moemesh.engine.models.config import TransformerConfig
from moemesh.engine.models.llama import LlamaMLP
from moemesh.engine.models.moe_model import MoEForCausalLM


class Qwen3MoeAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.eps = cfg.rms_norm_eps
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = _HeadNorm(self.head_dim)
        self.k_norm = _HeadNorm(self.head_dim)
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = kernels.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.eps)  # per head
        k = kernels.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.eps)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(-1, self.q_size))


class _HeadNorm(nn.Module):
    """Holds the per-head RMSNorm weight (HF `q_norm.weight` / `k_norm.weight`)."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def read_moe_config(self, hf: dict) -> int:
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        self.gating = GatingConfig(num_experts, hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False)))
        self.moe_intermediate_size = hf["moe_intermediate_size"]
        self.decoder_sparse_step = hf.get("decoder_sparse_step", 1)
        self.mlp_only_layers = set(hf.get("mlp_only_layers") or [])
        return num_experts

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.gating.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def make_attention(self, layer: int) -> nn.Module:
        return Qwen3MoeAttention(self.cfg)

    def make_mlp(self, layer: int, moe_layer: int | None) -> nn.Module:
        if moe_layer is None:
            return LlamaMLP(self.cfg.hidden_size, self.cfg.intermediate_size)
        return SparseMoE(moe_layer, self.cfg.hidden_size, self.moe_intermediate_size, self.gating, self.moe_runtime)
