"""Rotary position embedding applied to the rotary part of each head.

`cos_sin_cache` is [max_position, rotary_dim]: first half cos, second half sin, of the
frequencies for each position (built by the engine's rotary layer, which owns any scaling).
Neox style rotates the two halves of the rotary dims (HF Llama's rotate_half); GPT-J style
rotates interleaved pairs.
"""

import torch


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [num_tokens, rotary_dim / 2]
    return _rotate(query, cos, sin, is_neox_style), _rotate(key, cos, sin, is_neox_style)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool) -> torch.Tensor:
    rotary_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rotary_dim].float(), x[..., rotary_dim:]
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
