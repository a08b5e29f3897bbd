import math

import pytest
import torch
from kernel_testing import assert_close_f64, nan_like, random_block_tables

from moemesh.kernels.mla import mla_decode_attention_ref, mla_decode_attention_triton

LORA_RANK, ROPE_DIM, BLOCK_SIZE, SCALE = 32, 8, 4, 0.2
NUM_HEADS = 5  # not a multiple of the kernel's 16-head tile
CONTEXTS = [13, 0, 1, 40, 36]  # an empty request, one token, three 16-token partitions


def _naive_mla(q_latent, q_rope, kv_cache, block_tables, context_lens):
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    for r, n in enumerate(context_lens):
        rows = [kv_cache[int(block_tables[r, p // BLOCK_SIZE]), p % BLOCK_SIZE].double() for p in range(n)]
        for h in range(q_latent.shape[1]):
            scores = [
                SCALE
                * (float(q_latent[r, h].double() @ row[:LORA_RANK]) + float(q_rope[r, h].double() @ row[LORA_RANK:]))
                for row in rows
            ]
            if not scores:
                continue
            weights = [math.exp(s - max(scores)) for s in scores]
            for w, row in zip(weights, rows):
                out[r, h] += w / sum(weights) * row[:LORA_RANK]
    return out


def _inputs(dtype):
    kv_cache = torch.randn(60, BLOCK_SIZE, LORA_RANK + ROPE_DIM, dtype=dtype)
    tables = random_block_tables(CONTEXTS, BLOCK_SIZE, 11, kv_cache.shape[0])
    q_latent = torch.randn(len(CONTEXTS), NUM_HEADS, LORA_RANK, dtype=dtype)
    q_rope = torch.randn(len(CONTEXTS), NUM_HEADS, ROPE_DIM, dtype=dtype)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32)
    return q_latent, q_rope, kv_cache, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mla_decode_matches_the_float64_oracle(dtype):
    q_latent, q_rope, kv_cache, tables, lens = _inputs(dtype)
    out = mla_decode_attention_triton(
        q_latent, q_rope, kv_cache, tables, lens, SCALE, partition_size=16, out=nan_like(q_latent)
    )
    assert_close_f64(out, _naive_mla(q_latent, q_rope, kv_cache, tables, CONTEXTS), dtype)
    assert out[1].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_mla_decode_matches_the_float64_oracle_with_either_cache_layout(dtype):
    q_latent, q_rope, kv_cache, tables, lens = _inputs(dtype)
    expected = _naive_mla(q_latent, q_rope, kv_cache, tables, CONTEXTS)
    assert_close_f64(mla_decode_attention_ref(q_latent, q_rope, kv_cache, tables, lens, SCALE), expected, dtype)
    four_d = kv_cache.unsqueeze(2)  # [num_blocks, block_size, 1, D], as store_kv_cache writes it
    assert_close_f64(mla_decode_attention_ref(q_latent, q_rope, four_d, tables, lens, SCALE), expected, dtype)


def test_triton_mla_decode_rejects_a_cache_row_of_the_wrong_width():
    q_latent, q_rope, kv_cache, tables, lens = _inputs(torch.float32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode_attention_triton(q_latent, q_rope, kv_cache[..., :-1].contiguous(), tables, lens, SCALE)
