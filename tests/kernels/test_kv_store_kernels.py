import pytest
import torch

from moemesh.kernels.kv_store import store_kv_cache_ref, store_kv_cache_triton

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 5, 3, 8


def _naive_store(key, value, k_cache, v_cache, slot_mapping):
    k_out, v_out = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_out[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[token].to(k_out.dtype)
            v_out[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = value[token].to(v_out.dtype)
    return k_out, v_out


def _inputs(dtype, num_tokens=7):
    qkv = torch.randn(num_tokens, 5 * NUM_KV_HEADS * HEAD_DIM, dtype=dtype)  # key/value are strided splits of it
    key = qkv[:, : NUM_KV_HEADS * HEAD_DIM].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, 2 * NUM_KV_HEADS * HEAD_DIM : 3 * NUM_KV_HEADS * HEAD_DIM].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens]
    slots[2] = -1  # padding token
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    return key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_triton_store_writes_exactly_the_mapped_slots(dtype, slot_dtype):
    key, value, k_cache, v_cache, slots = _inputs(dtype)
    k_expected, v_expected = _naive_store(key, value, k_cache, v_cache, slots)
    store_kv_cache_triton(key, value, k_cache, v_cache, slots.to(slot_dtype))
    torch.testing.assert_close(k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0, equal_nan=True)
    assert not torch.isnan(k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[slots >= 0]]).any()


def test_reference_store_matches_naive_store_and_casts_to_the_cache_dtype():
    key, value, k_cache, v_cache, slots = _inputs(torch.float32)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    k_expected, v_expected = _naive_store(key, value, k_cache, v_cache, slots)
    store_kv_cache_ref(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0, equal_nan=True)


def test_triton_store_rejects_a_non_contiguous_cache_and_a_float_slot_mapping():
    key, value, k_cache, v_cache, slots = _inputs(torch.float32)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        store_kv_cache_triton(key, value, k_cache.transpose(0, 1).contiguous().transpose(0, 1), v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be one of"):
        store_kv_cache_triton(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="key must have shape"):
        store_kv_cache_triton(key[:, :2], value, k_cache, v_cache, slots)
