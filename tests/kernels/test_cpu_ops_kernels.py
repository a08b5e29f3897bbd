"""The C decoder ops of kernels/csrc/cpu_ops.c and paged_attention.c against float64 oracles built here, for each
build this machine can run (native, AVX2 only, scalar): fused add + RMSNorm, NeoX rotary embedding, the
KV-cache store and decode attention over paged KV. Where cpu_ops.c claims the torch reference's own roundings (the residual
sum, rotary), the outputs are also compared with that reference bit for bit; and dispatch.py is
checked to pick the C op for the CPU tensors it reads and the reference for the rest."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import C_BUILDS as BUILDS
from kernel_testing import TOLERANCES, assert_close_f64, built_library, gather_positions, nan_like, random_block_tables

from moemesh.kernels import cpu_ops, dispatch
from moemesh.kernels.kv_store import store_kv_cache_ref
from moemesh.kernels.norm import fused_add_rms_norm_ref
from moemesh.kernels.paged_attention import paged_prefill_attention_ref
from moemesh.kernels.rotary import rotary_embedding_ref

DTYPES = [torch.float32, torch.bfloat16]


def _library(build: str):
    return built_library(cpu_ops.build, build)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a tail after the 16-wide partial sums
def test_rms_norm_with_and_without_residual_matches_float64(build, dtype, hidden):
    lib = _library(build)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2 * hidden, generator=gen).to(dtype)[:, :hidden]  # rows with a stride
    residual = torch.randn(5, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    summed = x.double() + residual.double()
    expected = summed.to(dtype).double()  # the sum is rounded to the dtype first, as x + residual is
    expected = expected * torch.rsqrt(expected.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    out, got_summed = cpu_ops.rms_norm(x, weight, 1e-6, residual, lib=lib)
    assert torch.equal(got_summed, x + residual)
    assert_close_f64(out, expected, dtype)
    ref_out, _ = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOLERANCES[dtype])
    plain = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert_close_f64(cpu_ops.rms_norm(x, weight, 1e-6, lib=lib), plain, dtype)


def _rope_inputs(dtype, tokens=6, heads=9, kv_heads=3, head_dim=64, rotary_dim=64):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)  # strided, as the layer's
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(128, dtype=torch.float64), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()  # [128, rotary_dim]
    positions = torch.tensor([0, 5, 127, 3, 3, 64][:tokens])
    return q, k, cos_sin, positions


def _rope_f64(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[positions].double()[:, None, :half], cos_sin[positions].double()[:, None, half:]
    x = x.double()
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])  # 32: partial rotary, the rest copied
def test_rope_equals_the_torch_reference_bit_for_bit_and_float64_within_rounding(build, dtype, rotary_dim):
    lib = _library(build)
    q, k, cos_sin, positions = _rope_inputs(dtype, rotary_dim=rotary_dim)
    q_out, k_out = cpu_ops.rope_neox(positions, q, k, cos_sin, lib=lib)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cos_sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert_close_f64(q_out, _rope_f64(q, cos_sin, positions), dtype)
    assert_close_f64(k_out, _rope_f64(k, cos_sin, positions), dtype)


def test_rope_refuses_a_position_outside_the_table():
    lib = _library("native")
    q, k, cos_sin, _ = _rope_inputs(torch.float32, tokens=2)
    with pytest.raises(IndexError, match="position"):
        cpu_ops.rope_neox(torch.tensor([1, 128]), q, k, cos_sin, lib=lib)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_the_rows_to_their_slots_and_skips_negative_ones(dtype):
    lib = _library("native")
    k_cache, v_cache = torch.zeros(4, 16, 3, 64, dtype=dtype), torch.zeros(4, 16, 3, 64, dtype=dtype)
    qkv = torch.randn(3, 6 * 64).to(dtype)
    key, value = qkv[:, : 3 * 64].view(3, 3, 64), qkv[:, 3 * 64 :].view(3, 3, 64)  # strided rows
    slots = torch.tensor([17, -1, 63])
    cpu_ops.store_kv(key, value, k_cache, v_cache, slots, lib=lib)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache.view(-1, 3, 64)[17], key[0]) and torch.equal(v_cache.view(-1, 3, 64)[63], value[2])
    with pytest.raises(IndexError, match="slot"):  # refused whole: nothing of the round is written
        cpu_ops.store_kv(key, value, k_cache, v_cache, torch.tensor([0, 1, 64]), lib=lib)
    assert torch.equal(k_cache, k_ref)


def _attention_f64(q, k_cache, v_cache, tables, lens, scale):
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, length in enumerate(lens.tolist()):
        if length == 0:
            continue
        k = gather_positions(k_cache, tables[r], length, block_size)  # [len, kvh, d]
        v = gather_positions(v_cache, tables[r], length, block_size)
        for h in range(heads):
            g = h // (heads // kv_heads)
            probs = torch.softmax(k[:, g] @ q[r, h].double() * scale, dim=0)
            out[r, h] = probs @ v[:, g]
    return out


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", DTYPES)
# groups of 3, 1, 8 and 5 query heads (the vector loops take 4 at a time); head_dim 40 is no multiple of
# AVX-512's 16 lanes (the scalar loops there) but is of AVX2's 8
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 48), (10, 2, 40)])
def test_decode_attention_matches_float64_over_random_block_tables(build, dtype, heads, kv_heads, head_dim):
    lib = _library(build)
    gen = torch.Generator().manual_seed(2)
    lens = torch.tensor([1, 37, 0, 130, 16], dtype=torch.int32)  # 0: an empty request gets zeros
    block_size, num_blocks = 16, 40
    tables = random_block_tables(lens.tolist(), block_size, 10, num_blocks)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, lib=lib)
    assert out.dtype == dtype and torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close_f64(out, _attention_f64(q, k_cache, v_cache, tables, lens, scale), dtype)


def _prefill_f64(q, k_cache, v_cache, cu, tables, lens, scale):
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, length in enumerate(lens.tolist()):
        first, q_len = int(cu[r]), int(cu[r + 1] - cu[r])
        k = gather_positions(k_cache, tables[r], length, block_size)  # [len, kvh, d]
        v = gather_positions(v_cache, tables[r], length, block_size)
        for i in range(q_len):
            visible = length - q_len + i + 1  # the cached prefix, earlier new tokens and itself
            for h in range(heads):
                g = h // (heads // kv_heads)
                probs = torch.softmax(k[:visible, g] @ q[first + i, h].double() * scale, dim=0)
                out[first + i, h] = probs @ v[:visible, g]
    return out


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 40)])
def test_prefill_attention_is_causal_over_the_cached_prefix_and_matches_float64(
    build, dtype, heads, kv_heads, head_dim, monkeypatch
):
    """New tokens of each request (after a cached prefix of 0, 20 or 33 tokens; one request with no
    new tokens) attend to the prefix and to themselves causally; two threads split the requests."""
    lib = _library(build)
    gen = torch.Generator().manual_seed(6)
    q_lens, prefixes = [5, 17, 0, 1], [0, 20, 9, 33]
    lens = torch.tensor([a + b for a, b in zip(q_lens, prefixes)], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    block_size, num_blocks = 16, 40
    tables = random_block_tables(lens.tolist(), block_size, 4, num_blocks)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    out = cpu_ops.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale, lib=lib)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_f64(out, _prefill_f64(q, k_cache, v_cache, cu, tables, lens, scale), dtype)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, cu, lens, tables, scale)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


def test_prefill_attention_refuses_offsets_and_blocks_outside_the_cache():
    lib = _library("native")
    k_cache = torch.randn(4, 16, 3, 64)
    q = torch.randn(3, 9, 64)
    good = dict(cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32), context_lens=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(IndexError, match="block id"):
        cpu_ops.paged_prefill_attention(
            q,
            k_cache,
            k_cache.clone(),
            good["cu_seqlens_q"],
            good["context_lens"],
            torch.tensor([[4]], dtype=torch.int32),
            0.125,
            lib=lib,
        )
    with pytest.raises(IndexError, match="query offset"):  # more new tokens than the context holds
        cpu_ops.paged_prefill_attention(
            q,
            k_cache,
            k_cache.clone(),
            good["cu_seqlens_q"],
            torch.tensor([2], dtype=torch.int32),
            torch.tensor([[1]], dtype=torch.int32),
            0.125,
            lib=lib,
        )
    with pytest.raises(IndexError, match="offsets past"):
        cpu_ops.paged_prefill_attention(
            q,
            k_cache,
            k_cache.clone(),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32),
            torch.tensor([[1]], dtype=torch.int32),
            0.125,
            lib=lib,
        )


def test_dispatch_takes_the_c_prefill_for_short_prompts_and_the_reference_for_long(monkeypatch):
    if cpu_ops.library() is None:
        pytest.skip("no C compiler here")
    calls = []
    real = cpu_ops.paged_prefill_attention
    monkeypatch.setattr(cpu_ops, "paged_prefill_attention", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a))
    cache = torch.randn(20, 16, 3, 64)
    tables = torch.arange(1, 17, dtype=torch.int32)[None]  # one request, up to 256 tokens
    for q_len in (255, 256):  # causal pairs 255 * 256 / 2 = 32640 <= 1 << 15; 256 * 257 / 2 = 32896 > 1 << 15
        cu, lens = torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([q_len], dtype=torch.int32)
        dispatch.paged_prefill_attention(torch.randn(q_len, 9, 64), cache, cache.clone(), cu, lens, tables, 0.125)
    assert calls == [255]


def test_decode_attention_splits_requests_over_threads_with_the_same_result(monkeypatch):
    lib = _library("native")
    lens = torch.tensor([50, 9, 120, 77, 3, 64], dtype=torch.int32)
    tables = random_block_tables(lens.tolist(), 16, 8, 40)
    k_cache, v_cache = torch.randn(40, 16, 3, 64), torch.randn(40, 16, 3, 64)
    q = torch.randn(6, 9, 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, lib=lib)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(cpu_ops, "PARALLEL_MIN_SCORES", 1)
    assert torch.equal(cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, lib=lib), one)


def test_decode_attention_refuses_a_block_outside_the_cache():
    lib = _library("native")
    k_cache = torch.randn(4, 16, 3, 64)
    tables = torch.tensor([[1, 4]], dtype=torch.int32)
    with pytest.raises(IndexError, match="block id"):
        cpu_ops.paged_decode_attention(
            torch.randn(1, 9, 64),
            k_cache,
            k_cache.clone(),
            tables,
            torch.tensor([20], dtype=torch.int32),
            0.125,
            lib=lib,
        )


def test_dispatch_runs_the_c_ops_on_the_cpu_tensors_they_read_and_the_reference_otherwise(monkeypatch):
    if cpu_ops.library() is None:
        pytest.skip("no C compiler here")
    calls = []
    for name in ("rms_norm", "rope_neox", "store_kv", "paged_decode_attention"):
        real = getattr(cpu_ops, name)
        monkeypatch.setattr(
            cpu_ops, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    x, weight = torch.randn(2, 64), torch.ones(64)
    dispatch.fused_add_rms_norm(x, x.clone(), weight, 1e-6)
    dispatch.rms_norm(x.half(), weight.half(), 1e-6)  # float16: the reference
    q, k, cos_sin, positions = _rope_inputs(torch.float32, tokens=2)
    dispatch.rotary_embedding(positions, q, k, cos_sin)
    dispatch.rotary_embedding(positions, q, k, cos_sin, is_neox_style=False)  # GPT-J style: the reference
    cache = torch.zeros(4, 16, 3, 64)
    dispatch.store_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, 1]))
    tables, lens = torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    dispatch.paged_decode_attention(q, cache, cache.clone(), tables, lens, 0.125)
    wide = torch.zeros(len(tables), 64, dtype=torch.int32)  # a large round (1024 table tokens a request) too
    dispatch.paged_decode_attention(q, cache, cache.clone(), wide, lens, 0.125)
    half = cache.half()
    dispatch.paged_decode_attention(q.half(), half, half.clone(), tables, lens, 0.125)  # float16: the reference
    assert calls == ["rms_norm", "rope_neox", "store_kv", "paged_decode_attention", "paged_decode_attention"]


def test_without_a_compiler_every_op_runs_the_torch_reference(monkeypatch):
    monkeypatch.setattr(cpu_ops, "library", lambda: None)
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64)
    out, summed = dispatch.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(summed, ref_summed)
    q, k, cos_sin, positions = _rope_inputs(torch.float32)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            dispatch.rotary_embedding(positions, q, k, cos_sin), rotary_embedding_ref(positions, q, k, cos_sin)
        )
    )
    assert not torch.isnan(dispatch.rms_norm(nan_like(x).nan_to_num(1.0), weight, 1e-6)).any()
