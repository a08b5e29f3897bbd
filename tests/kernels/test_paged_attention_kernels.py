import importlib
import math

import pytest
import torch
from kernel_testing import assert_close_f64, gather_positions, nan_like, random_block_tables

from moemesh.kernels.dispatch import paged_attention
from moemesh.kernels.paged_attention import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
)

HEAD_DIM = 16
BLOCK_SIZE = 5  # not a power of two: positions map to blocks by // and %
SCALE = 0.3


def _naive_attention(q, k, v, scale):
    """q [num_q, d], k/v [n, d] float64, query i attends to the first n - num_q + i + 1 keys
    (none: zeros, the empty request)."""
    num_q, n = q.shape[0], k.shape[0]
    out = torch.zeros(num_q, v.shape[1], dtype=torch.float64)
    for i in range(num_q):
        visible = n - num_q + i + 1
        if visible <= 0:
            continue
        scores = [float(q[i] @ k[t]) * scale for t in range(visible)]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        for t in range(visible):
            out[i] += weights[t] / total * v[t]
    return out


def _naive_paged(query, k_cache, v_cache, q_lens, context_lens, block_tables, num_kv_heads, block_size=BLOCK_SIZE):
    """[num_tokens, num_heads, head_dim] float64 oracle; token rows per request in order."""
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    start = 0
    for r, (q_len, n) in enumerate(zip(q_lens, context_lens)):
        k = gather_positions(k_cache, block_tables[r], n, block_size)  # [n, kvh, d]
        v = gather_positions(v_cache, block_tables[r], n, block_size)
        for h in range(num_heads):
            if q_len:
                q = query[start : start + q_len, h].double()
                out[start : start + q_len, h] = _naive_attention(q, k[:, h // group], v[:, h // group], SCALE)
        start += q_len
    return out


def _caches(num_kv_heads, dtype, num_blocks=40, block_size=BLOCK_SIZE, head_dim=HEAD_DIM):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)  # [num_blocks, block_size, num_kv_heads, head_dim]
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


# context 0 (an empty request), 1, a multiple of BLOCK_SIZE, and three partitions of 16 tokens
DECODE_CONTEXTS = [13, 0, 1, 40, 37]
# (cached prefix, new tokens): several query tiles, q_len 0, context 0, one token, prefix only
PREFILL_REQUESTS = [(0, 7), (13, 21), (5, 0), (0, 0), (9, 1), (20, 17)]


def _decode_case(num_kv_heads, group, dtype, contexts=DECODE_CONTEXTS):
    k_cache, v_cache = _caches(num_kv_heads, dtype)
    tables = random_block_tables(contexts, BLOCK_SIZE, 9, k_cache.shape[0])
    query = torch.randn(len(contexts), num_kv_heads * group, HEAD_DIM, dtype=dtype)
    context_lens = torch.tensor(contexts, dtype=torch.int32)
    expected = _naive_paged(query, k_cache, v_cache, [1] * len(contexts), contexts, tables, num_kv_heads)
    return (query, k_cache, v_cache, tables, context_lens, SCALE), expected


def _prefill_case(num_kv_heads, group, dtype):
    k_cache, v_cache = _caches(num_kv_heads, dtype)
    q_lens = [q for _, q in PREFILL_REQUESTS]
    context = [p + q for p, q in PREFILL_REQUESTS]
    tables = random_block_tables(context, BLOCK_SIZE, 9, k_cache.shape[0])
    query = torch.randn(sum(q_lens), num_kv_heads * group, HEAD_DIM, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    context_lens = torch.tensor(context, dtype=torch.int32)
    expected = _naive_paged(query, k_cache, v_cache, q_lens, context, tables, num_kv_heads)
    return (query, k_cache, v_cache, cu, context_lens, tables, SCALE), expected


# (num_kv_heads, GQA group = num_heads // num_kv_heads, dtype)
CASES = [(2, 1, torch.float32), (1, 3, torch.bfloat16), (1, 8, torch.float32), (2, 8, torch.bfloat16)]


@pytest.mark.parametrize("num_kv_heads,group,dtype", CASES)
def test_triton_decode_matches_the_float64_oracle(num_kv_heads, group, dtype):
    args, expected = _decode_case(num_kv_heads, group, dtype)
    out = paged_decode_attention_triton(*args, partition_size=16, out=nan_like(args[0]))
    assert_close_f64(out, expected, dtype)
    assert out[1].eq(0).all()  # the empty request


@pytest.mark.parametrize("num_kv_heads,group,dtype", CASES)
def test_triton_prefill_matches_the_float64_oracle(num_kv_heads, group, dtype):
    args, expected = _prefill_case(num_kv_heads, group, dtype)
    out = paged_prefill_attention_triton(*args, block_m=16, out=nan_like(args[0]))
    assert_close_f64(out, expected, dtype)


# the decode reference's two paths: all heads against all kv heads (<= 4 kv heads), per head (more)
REFERENCE_CASES = CASES + [(3, 3, torch.bfloat16), (4, 2, torch.float32), (6, 2, torch.float32)]


@pytest.mark.parametrize("num_kv_heads,group,dtype", REFERENCE_CASES)
def test_references_match_the_float64_oracle(num_kv_heads, group, dtype):
    args, expected = _decode_case(num_kv_heads, group, dtype)
    assert_close_f64(paged_decode_attention_ref(*args), expected, dtype)
    args, expected = _prefill_case(num_kv_heads, group, dtype)
    assert_close_f64(paged_prefill_attention_ref(*args), expected, dtype)


@pytest.mark.parametrize("context", [1, 13, 40])  # inside a block, a block's end, past several
@pytest.mark.parametrize("num_kv_heads,group,dtype", CASES)
def test_single_request_decode_reference_matches_the_float64_oracle(num_kv_heads, group, dtype, context):
    """One request takes its own path (fused attention over K/V cut to its context)."""
    args, expected = _decode_case(num_kv_heads, group, dtype, [context])
    assert_close_f64(paged_decode_attention_ref(*args), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reference_paths_agree(monkeypatch, dtype):
    """The all-heads products (kept on their diagonal) and the per-head products: the same sums."""
    args, _ = _decode_case(3, 3, dtype)
    all_heads = paged_decode_attention_ref(*args)
    module = importlib.import_module("moemesh.kernels.paged_attention")  # the package's name is the function
    monkeypatch.setattr(module, "ALL_HEADS_MAX_KV_HEADS", 0)
    per_head = paged_decode_attention_ref(*args)
    torch.testing.assert_close(all_heads, per_head, rtol=1e-6, atol=1e-6)
    assert all_heads[1].eq(0).all()  # the empty request


def test_triton_attention_with_the_engine_block_size_and_the_default_tiles():
    """block_size 16, head_dim 64, the default partition (256 tokens) and query tile (64): two of each."""
    k_cache, v_cache = _caches(2, torch.bfloat16, num_blocks=40, block_size=16, head_dim=64)
    context = [300, 0, 75]
    tables = random_block_tables(context, 16, 20, k_cache.shape[0])
    lens = torch.tensor(context, dtype=torch.int32)
    query = torch.randn(3, 8, 64, dtype=torch.bfloat16)
    out = paged_decode_attention_triton(query, k_cache, v_cache, tables, lens, SCALE)
    expected = _naive_paged(query, k_cache, v_cache, [1, 1, 1], context, tables, 2, block_size=16)
    assert_close_f64(out, expected, torch.bfloat16)
    q_lens = [70, 0, 3]
    query = torch.randn(sum(q_lens), 8, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 70, 70, 73], dtype=torch.int32)
    out = paged_prefill_attention_triton(query, k_cache, v_cache, cu, lens, tables, SCALE)
    expected = _naive_paged(query, k_cache, v_cache, q_lens, context, tables, 2, block_size=16)
    assert_close_f64(out, expected, torch.bfloat16)


def test_mixed_round_runs_decode_requests_then_prefill_requests():
    k_cache, v_cache = _caches(2, torch.float32)
    q_lens, context = [1, 1, 6, 0, 11], [9, 17, 6, 4, 20]
    tables = random_block_tables(context, BLOCK_SIZE, 4, k_cache.shape[0])
    query = torch.randn(sum(q_lens), 6, HEAD_DIM)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = paged_attention(query, k_cache, v_cache, cu, torch.tensor(context, dtype=torch.int32), tables, 2, SCALE)
    assert_close_f64(out, _naive_paged(query, k_cache, v_cache, q_lens, context, tables, 2), torch.float32)


def test_triton_launchers_reject_bad_inputs_with_a_message():
    (query, k_cache, v_cache, tables, lens, scale), _ = _decode_case(2, 3, torch.float32)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        paged_decode_attention_triton(query[:, :5], k_cache, v_cache, tables, lens, scale)
    with pytest.raises(ValueError, match="k_cache dtype"):
        paged_decode_attention_triton(query, k_cache.bfloat16(), v_cache, tables, lens, scale)
    with pytest.raises(ValueError, match="context_lens must be one of"):
        paged_decode_attention_triton(query, k_cache, v_cache, tables, lens.long(), scale)
    with pytest.raises(ValueError, match="partition_size"):
        paged_decode_attention_triton(query, k_cache, v_cache, tables, lens, scale, partition_size=24)
    (query, k_cache, v_cache, cu, lens, tables, scale), _ = _prefill_case(1, 1, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q must rise"):
        paged_prefill_attention_triton(query[:-1], k_cache, v_cache, cu, lens, tables, scale)
    with pytest.raises(ValueError, match="more new tokens than context"):
        paged_prefill_attention_triton(query, k_cache, v_cache, cu, lens - 5 * (lens > 5).int(), tables, scale)
