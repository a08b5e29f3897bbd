"""Pick the Triton kernel on CUDA tensors and the torch reference elsewhere.

The engine calls only these functions. Triton launchers are looked up lazily so this module
imports on machines without a GPU (or without triton).
"""

import torch

from moemesh.kernels.kv_store import store_kv_cache_ref
from moemesh.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from moemesh.kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref
from moemesh.kernels.rotary import rotary_embedding_ref


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    store_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
    return paged_decode_attention_ref(query, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
    return paged_prefill_attention_ref(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]; decode tokens first
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    num_decode_reqs: int,
    scale: float,
) -> torch.Tensor:
    """One round's attention: the first `num_decode_reqs` requests have one query token each."""
    d = num_decode_reqs
    if d == context_lens.shape[0]:
        return paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
    if d == 0:
        return paged_prefill_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)
    decode_out = paged_decode_attention(query[:d], k_cache, v_cache, block_tables[:d], context_lens[:d], scale)
    prefill_out = paged_prefill_attention(
        query[d:], k_cache, v_cache, cu_seqlens_q[d:] - cu_seqlens_q[d], context_lens[d:], block_tables[d:], scale
    )
    return torch.cat((decode_out, prefill_out), dim=0)


def rms_norm(x, weight, eps):
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rotary_embedding(positions, query, key, cos_sin_cache, is_neox_style=True):
    return rotary_embedding_ref(positions, query, key, cos_sin_cache, is_neox_style)
