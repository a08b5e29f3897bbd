"""Rotary position embedding applied to the rotary part of each head.

`cos_sin_cache` is [max_position, rotary_dim]: first half cos, second half sin, of the
frequencies for each position (built by the engine's rotary layer, which owns any scaling).
Neox style rotates the two halves of the rotary dims (HF Llama's rotate_half); GPT-J style
rotates interleaved pairs.
"""

import torch

from moemesh.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_dtype,
    check_inner_contiguous,
    check_launchable,
    check_shape,
    launch,
    next_pow2,
    scratch,
    tl,
    triton,
)


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32
    is_neox_style: bool = True,
    cos_sin: torch.Tensor | None = None,  # [num_tokens, rotary_dim] cos_sin_cache[positions], if known
) -> tuple[torch.Tensor, torch.Tensor]:
    if cos_sin is None:
        cos_sin = cos_sin_cache[positions]
    cos, sin = cos_sin.float().chunk(2, dim=-1)  # [num_tokens, rotary_dim / 2]
    if query.shape[2:] == key.shape[2:] and query.dtype == key.dtype:
        # query and key heads rotated as one tensor: half the small ops (what decode pays for),
        # the same elementwise products
        both = _rotate(torch.cat((query, key), dim=1), cos, sin, is_neox_style)
        return both.split((query.shape[1], key.shape[1]), dim=1)
    return _rotate(query, cos, sin, is_neox_style), _rotate(key, cos, sin, is_neox_style)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool) -> torch.Tensor:
    """In float32 (cos and sin are: x's rows are promoted in each product), cast back to x's dtype."""
    rotary_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    if is_neox_style:
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if x_pass.shape[-1] == 0:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x_pass), dim=-1)


if HAS_TRITON:

    @triton.jit
    def _rotary_embedding_kernel(
        positions_ptr,  # [num_tokens]
        x_ptr,  # [num_tokens, num_heads, head_dim], dense heads
        cos_sin_ptr,  # [max_position, rotary_dim], contiguous
        out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
        x_token_stride,
        x_head_stride,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROTARY_DIM: tl.constexpr,
        IS_NEOX: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        half: tl.constexpr = ROTARY_DIM // 2
        # For output dim j < ROTARY_DIM: out[j] = x[j] * cos[f] + sign * x[partner] * sin[f]
        if IS_NEOX:  # halves: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
            first = dims < half
            freq = tl.where(first, dims, dims - half)
            partner = tl.where(first, dims + half, dims - half)
        else:  # interleaved pairs (x[2i], x[2i + 1])
            first = dims % 2 == 0
            freq = dims // 2
            partner = tl.where(first, dims + 1, dims - 1)
        rotated = dims < ROTARY_DIM
        mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        row = x_ptr + token * x_token_stride + heads[:, None] * x_head_stride
        x = tl.load(row + dims[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)
        xp = tl.load(row + partner[None, :], mask=mask & rotated[None, :], other=0.0).to(tl.float32)
        cos = tl.load(cos_sin_ptr + pos * ROTARY_DIM + freq, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * ROTARY_DIM + half + freq, mask=rotated, other=0.0).to(tl.float32)
        sign = tl.where(first, -1.0, 1.0)
        y = tl.where(rotated[None, :], xf * cos[None, :] + sign[None, :] * xp * sin[None, :], xf)
        o_ptrs = out_ptr + (token * NUM_HEADS + heads[:, None]) * HEAD_DIM + dims[None, :]
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate_triton(name, positions, x, cos_sin_cache, is_neox_style):
    num_tokens, num_heads, head_dim = x.shape
    out = scratch(tuple(x.shape), x.dtype, x.device)  # [num_tokens, num_heads, head_dim]
    if num_tokens > 0:
        launch(
            _rotary_embedding_kernel,
            (num_tokens,),
            positions,
            x,
            cos_sin_cache,
            out,
            x.stride(0),
            x.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            ROTARY_DIM=cos_sin_cache.shape[1],
            IS_NEOX=bool(is_neox_style),
            BLOCK_H=next_pow2(num_heads),
            BLOCK_D=next_pow2(head_dim),
        )
    return out


def rotary_embedding_triton(
    positions: torch.Tensor,  # [num_tokens] int32 or int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], may be a split of qkv
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding_ref on the GPU: one program per token and tensor, all heads in one tile.

    Positions must be < max_position; that is not checked (it would cost a host sync)."""
    name = "rotary_embedding_triton"
    check_launchable(name, positions, query, key, cos_sin_cache)
    num_tokens, head_dim = query.shape[0], query.shape[-1]
    check_shape(name, "positions", positions, (num_tokens,))
    check_shape(name, "query", query, (num_tokens, None, None))
    check_shape(name, "key", key, (num_tokens, None, head_dim))
    check_shape(name, "cos_sin_cache", cos_sin_cache, (None, None))
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"{name}: rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
    check_dtype(name, "positions", positions, (torch.int32, torch.int64))
    for what, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_dtype(name, what, t, FLOAT_DTYPES)
    check_inner_contiguous(name, "query", query, 1)
    check_inner_contiguous(name, "key", key, 1)
    if not (positions.is_contiguous() and cos_sin_cache.is_contiguous()):
        raise ValueError(f"{name}: positions and cos_sin_cache must be contiguous")
    return (
        _rotate_triton(name, positions, query, cos_sin_cache, is_neox_style),
        _rotate_triton(name, positions, key, cos_sin_cache, is_neox_style),
    )
