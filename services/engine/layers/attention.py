"""Paged attention layer: store the new tokens' K/V, then attend through block tables."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from moemesh import kernels
from moemesh.engine.layers.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner once the pool is sized: [num_blocks, block_size, kvh, head_dim]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """The cache tensors this layer needs (the runner allocates them): K and V."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [shape, shape]

    def bind_kv_cache(self, caches: list[torch.Tensor]) -> None:
        """Called by the runner once, with tensors of the shapes from `kv_cache_shape`."""
        self.k_cache, self.v_cache = caches

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        kernels.store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        all_decode = meta.num_decode_reqs == meta.context_lens.shape[0]
        plan = partial(meta.decode_plan, self.k_cache.shape[1]) if all_decode and not q.is_cuda else None
        return kernels.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.cu_seqlens_q,
            meta.context_lens,
            meta.block_tables,
            meta.num_decode_reqs,
            self.scale,
            plan,
        )
