import pytest
import torch
from kernel_testing import assert_close_f64

from moemesh.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton

NUM_TOKENS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_POSITION = 5, 3, 2, 16, 64


def _naive_rotary(positions, x, cos_sin_cache, is_neox_style):
    """Rotate each (i, partner) pair by the position's angle, one element at a time, float64."""
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    out = x.double().clone()
    for t, pos in enumerate(positions.tolist()):
        cos, sin = cos_sin_cache[pos, :half].double(), cos_sin_cache[pos, half:].double()
        for h in range(x.shape[1]):
            row = x[t, h].double()
            for f in range(half):
                i, j = (f, f + half) if is_neox_style else (2 * f, 2 * f + 1)
                out[t, h, i] = row[i] * cos[f] - row[j] * sin[f]
                out[t, h, j] = row[j] * cos[f] + row[i] * sin[f]
    return out


def _inputs(dtype, rotary_dim):
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(NUM_TOKENS, q_size + 2 * kv_size, dtype=dtype)  # q and k are strided views, as in a model
    query = qkv[:, :q_size].view(NUM_TOKENS, NUM_HEADS, HEAD_DIM)
    key = qkv[:, q_size : q_size + kv_size].view(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM)
    angles = torch.rand(MAX_POSITION, rotary_dim // 2) * 6.3
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [max_position, rotary_dim]
    positions = torch.randint(0, MAX_POSITION, (NUM_TOKENS,))
    return positions, query, key, cos_sin_cache


# (dtype, rotary_dim): full rotation and a partial one (the tail of each head passes through)
CASES = [(torch.float32, HEAD_DIM), (torch.bfloat16, HEAD_DIM), (torch.float32, 8), (torch.bfloat16, 8)]


@pytest.mark.parametrize("dtype,rotary_dim", CASES)
@pytest.mark.parametrize("is_neox_style", [True, False])
def test_triton_rotary_matches_the_float64_oracle(dtype, rotary_dim, is_neox_style):
    positions, query, key, cache = _inputs(dtype, rotary_dim)
    q_out, k_out = rotary_embedding_triton(positions, query, key, cache, is_neox_style)
    assert_close_f64(q_out, _naive_rotary(positions, query, cache, is_neox_style), dtype)
    assert_close_f64(k_out, _naive_rotary(positions, key, cache, is_neox_style), dtype)


@pytest.mark.parametrize("dtype,rotary_dim", CASES)
@pytest.mark.parametrize("is_neox_style", [True, False])
def test_reference_rotary_matches_the_float64_oracle(dtype, rotary_dim, is_neox_style):
    positions, query, key, cache = _inputs(dtype, rotary_dim)
    q_out, k_out = rotary_embedding_ref(positions, query, key, cache, is_neox_style)
    assert_close_f64(q_out, _naive_rotary(positions, query, cache, is_neox_style), dtype)
    assert_close_f64(k_out, _naive_rotary(positions, key, cache, is_neox_style), dtype)


def test_triton_rotary_rejects_a_rotary_dim_wider_than_the_head():
    positions, query, key, _ = _inputs(torch.float32, HEAD_DIM)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding_triton(positions, query, key, torch.randn(MAX_POSITION, 2 * HEAD_DIM), True)
