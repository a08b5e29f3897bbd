"""Paged multi-head latent attention (MLA, DeepSeek-V2/V3) over a compressed cache.

The cache holds, per token, only the compressed latent c (kv_lora_rank, after kv_a_layernorm)
and the rotated shared rope key k_rope (qk_rope_head_dim): one [num_blocks, block_size, 1,
kv_lora_rank + qk_rope_head_dim] tensor per layer, instead of K and V of every head
(num_heads * (qk_head_dim + v_head_dim) per token). kv_b_proj splits per head into
W_UK [qk_nope_head_dim, kv_lora_rank] and W_UV [v_head_dim, kv_lora_rank]:
    k_nope[h] = W_UK[h] c,   v[h] = W_UV[h] c,   k[h] = [k_nope[h] | k_rope].

Two paths in one round (decode requests come first in the batch):
- prefill / extend (compute-bound, many query tokens): the request's cached latents are
  gathered and up-projected to per-head K/V, then ordinary causal attention;
- decode (memory-bound, one query token): absorbed weights. q_latent[h] = q_nope[h] W_UK[h]
  (folded into the query instead of expanding every cached token), attention runs directly on
  the latent cache (`kernels.mla_decode_attention`), and W_UV[h] maps the latent output back.
  Per step this reads kv_lora_rank + qk_rope_head_dim values per cached token and does no
  per-token up-projection, which is what makes MLA decode cheap. (A faster next step would also
  fold W_UV into o_proj and batch the prefill gather across requests.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh import kernels
from moemesh.engine.layers.attention_metadata import AttentionMetadata


class MLAAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
    ):
        super().__init__()
        self.num_heads, self.scale = num_heads, scale
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.num_kv_heads, self.head_dim = 1, kv_lora_rank + qk_rope_head_dim  # one shared cache "head"
        self.kv_cache = torch.empty(0)  # bound by the runner: [num_blocks, block_size, 1, head_dim]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return [(num_blocks, block_size, 1, self.head_dim)]

    def bind_kv_cache(self, caches: list[torch.Tensor]) -> None:
        (self.kv_cache,) = caches

    def forward(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_rope: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotated
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank], normalized
        k_rope: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
        kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        flat_cache = self.kv_cache.view(-1, self.head_dim)  # [num_blocks * block_size, head_dim]
        entries = torch.cat((latent, k_rope), dim=-1).to(flat_cache.dtype)  # [num_tokens, head_dim]
        flat_cache.index_copy_(0, meta.slot_mapping, entries)
        w = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]  # [H, dn, L], [H, dv, L]
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        d = meta.num_decode_reqs  # decode requests = decode tokens, first in the batch
        if d > 0:
            out[:d] = self._decode(q_nope[:d], q_rope[:d], w_uk, w_uv, meta.block_tables[:d], meta.context_lens[:d])
        if d < meta.context_lens.shape[0]:
            out[d:] = self._prefill(q_nope[d:], q_rope[d:], w, meta, d)
        return out

    def _decode(self, q_nope, q_rope, w_uk, w_uv, block_tables, context_lens) -> torch.Tensor:
        q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)  # [num_decode, H, L]
        out_latent = kernels.mla_decode_attention(
            q_latent.contiguous(), q_rope.contiguous(), self.kv_cache, block_tables, context_lens, self.scale
        )  # [num_decode, H, L]
        return torch.einsum("thl,hvl->thv", out_latent, w_uv)  # [num_decode, H, dv]

    def _prefill(self, q_nope, q_rope, w, meta: AttentionMetadata, first: int) -> torch.Tensor:
        """Up-project each prefill request's gathered latents; one request at a time."""
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_head_dim)
        cache = self.kv_cache.view(self.kv_cache.shape[0], self.kv_cache.shape[1], self.head_dim)
        block_size = cache.shape[1]
        offset = int(meta.cu_seqlens_q[first])
        starts = (meta.cu_seqlens_q[first:] - offset).tolist()
        lens = meta.context_lens[first:].tolist()
        w_kv = w.reshape(-1, self.kv_lora_rank)  # [H * (dn + dv), L]
        for i, context_len in enumerate(lens):
            q_start, q_end = starts[i], starts[i + 1]
            q_len = q_end - q_start
            if q_len == 0 or context_len == 0:
                continue
            num_blocks = -(-context_len // block_size)
            table = meta.block_tables[first + i, :num_blocks].long()
            kv = cache[table].flatten(0, 1)[:context_len].to(q_nope.dtype)  # [context_len, L + dr]
            c, k_rope = kv[:, : self.kv_lora_rank], kv[:, self.kv_lora_rank :]
            kv_up = (c @ w_kv.t()).view(context_len, self.num_heads, -1)  # [context_len, H, dn + dv]
            k_nope, v = kv_up.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)  # [ctx, H, qk]
            q = torch.cat((q_nope[q_start:q_end], q_rope[q_start:q_end]), dim=-1)  # [q_len, H, qk]
            q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
            allowed = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=allowed,
                scale=self.scale,
            )  # [1, H, q_len, dv]
            out[q_start:q_end] = o[0].transpose(0, 1)
        return out
