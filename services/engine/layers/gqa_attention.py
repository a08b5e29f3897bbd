"""Grouped-query self-attention with RoPE (Llama, Mixtral, Qwen3-MoE): one merged q/k/v
projection, optional per-head RMSNorm of q and k before RoPE (Qwen3's `q_norm` / `k_norm`),
paged attention, output projection."""

from __future__ import annotations

import torch
from torch import nn

from moemesh.engine.layers.attention import Attention
from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.layernorm import RMSNorm
from moemesh.engine.layers.rotary import RotaryEmbedding
from moemesh.engine.layers.transformer_config import TransformerConfig


class GQAAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # per head
            q = self.q_norm(q.reshape(-1, self.head_dim))  # [num_tokens * num_heads, head_dim]
            k = self.k_norm(k.reshape(-1, self.head_dim))  # [num_tokens * num_kv_heads, head_dim]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, meta.rope_cos_sin(self.rotary_emb.cos_sin_cache, positions))
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(-1, self.q_size))
