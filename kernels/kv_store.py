"""Write the K/V of new tokens into the paged cache by slot mapping.

Cache layout (all attention kernels share it):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A slot is `block_id * block_size + offset`; slot -1 means "padding, do not write".
"""

import torch

from moemesh.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_contiguous,
    check_dtype,
    check_inner_contiguous,
    check_launchable,
    check_shape,
    launch,
    next_pow2,
    tl,
    triton,
)


def store_kv_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, num_kv_heads, head_dim]
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


if HAS_TRITON:

    @triton.jit
    def _store_kv_cache_kernel(
        key_ptr,  # [num_tokens, num_kv_heads, head_dim], dense per token
        value_ptr,
        k_cache_ptr,  # [num_blocks * block_size, num_kv_heads * head_dim]
        v_cache_ptr,
        slot_mapping_ptr,  # [num_tokens]
        key_token_stride,
        value_token_stride,
        TOKEN_SIZE: tl.constexpr,  # num_kv_heads * head_dim
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        chunk = tl.program_id(1)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < tl.where(slot >= 0, TOKEN_SIZE, 0)  # (a block & a scalar bool breaks the interpreter)
        k = tl.load(key_ptr + token.to(tl.int64) * key_token_stride + cols, mask=mask)
        v = tl.load(value_ptr + token.to(tl.int64) * value_token_stride + cols, mask=mask)
        tl.store(k_cache_ptr + slot * TOKEN_SIZE + cols, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + slot * TOKEN_SIZE + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], may be a split of qkv
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int32 or int64, -1 = skip
) -> None:
    """store_kv_cache_ref on the GPU: one program per (token, chunk of its kv_heads * head_dim).

    Slots must be < num_blocks * block_size; that is not checked (it would cost a host sync).
    """
    name = "store_kv_cache_triton"
    check_launchable(name, key, value, k_cache, v_cache, slot_mapping)
    if k_cache.dim() != 4:
        raise ValueError(
            f"{name}: k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {list(k_cache.shape)}"
        )
    num_tokens = key.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_shape(name, "v_cache", v_cache, tuple(k_cache.shape))
    check_shape(name, "key", key, (num_tokens, num_kv_heads, head_dim))
    check_shape(name, "value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape(name, "slot_mapping", slot_mapping, (num_tokens,))
    check_dtype(name, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    for what, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, what, t, FLOAT_DTYPES)
    check_inner_contiguous(name, "key", key, 2)
    check_inner_contiguous(name, "value", value, 2)
    check_contiguous(name, "k_cache", k_cache)
    check_contiguous(name, "v_cache", v_cache)
    check_contiguous(name, "slot_mapping", slot_mapping)
    if num_tokens == 0:
        return
    token_size = num_kv_heads * head_dim
    block = min(next_pow2(token_size), 1024)
    grid = (num_tokens, triton.cdiv(token_size, block))
    launch(
        _store_kv_cache_kernel,
        grid,
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        TOKEN_SIZE=token_size,
        BLOCK=block,
    )
