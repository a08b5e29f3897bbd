"""The C routed-expert kernel of kernels/csrc/cpu_moe.c against a float64 oracle built here and against
the torch reference (kernels/moe.py's grouped_moe_ref), for each build this machine can run
(native, AVX2 only, scalar); its refusals; and dispatch.py's choice between it and the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import C_BUILDS as BUILDS
from kernel_testing import TOLERANCES, assert_close_f64, built_library

from moemesh.kernels import cpu_moe, dispatch
from moemesh.kernels.moe import grouped_moe_ref

HIDDEN, INTER, NUM_EXPERTS = 96, 64, 7
DTYPES = [torch.float32, torch.bfloat16]


def _library(build: str):
    return built_library(cpu_moe.build, build)


def _inputs(dtype, sizes=(1, 4, 5, 9, 16, 3), seed=0):
    """x with strided rows; groups over experts (one repeated, as replicas of a worker are), rows
    repeated across groups and in any order inside one."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = 20
    x = torch.randn(num_tokens, 2 * HIDDEN, generator=gen).to(dtype)[:, :HIDDEN]
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5).to(dtype)
    experts = [int(e) for e in torch.randint(0, NUM_EXPERTS, (len(sizes),), generator=gen)]
    experts[-1] = experts[0]
    row_ids = torch.cat([torch.randperm(num_tokens, generator=gen)[:n] for n in sizes])
    weights = torch.rand(row_ids.numel(), generator=gen) + 0.1
    return x, w13, w2, row_ids, experts, list(sizes), weights


def _oracle(x, w13, w2, row_ids, experts, sizes, weights) -> torch.Tensor:
    """One entry at a time in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    entry = 0
    for e, n in zip(experts, sizes):
        for _ in range(n):
            row = int(row_ids[entry])
            gate_up = w13[e].double() @ x[row].double()
            act = F.silu(gate_up[:INTER]) * gate_up[INTER:]
            out[row] += float(weights[entry]) * (w2[e].double() @ act)
            entry += 1
    return out


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_moe_matches_float64_and_the_reference(build, dtype):
    lib = _library(build)
    args = _inputs(dtype)
    out = cpu_moe.grouped_moe(*args, lib=lib)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    assert_close_f64(out, _oracle(*args), dtype)
    torch.testing.assert_close(out, grouped_moe_ref(*args), **TOLERANCES[dtype])
    untouched = torch.ones(args[0].shape[0], dtype=torch.bool)
    untouched[args[3]] = False
    assert not out[untouched].any()  # rows no entry names stay zero


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_result_does_not_depend_on_the_thread_count(dtype):
    lib = _library("native")
    args = _inputs(dtype, sizes=(2, 7, 1, 12), seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_moe.grouped_moe(*args, lib=lib)
        torch.set_num_threads(3)  # parts need not divide the rows evenly
        three = cpu_moe.grouped_moe(*args, lib=lib)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_entry_gives_the_same_bits_whatever_else_shares_its_expert(build, dtype):
    """Ping-pong splits a round's tokens in two: an expert's rows then come in smaller groups. The
    rows of one group of 7, computed as groups of 1, 2 and 4 (and within a group of 11 that has 4
    rows more), give the same bits."""
    lib = _library(build)
    x, w13, w2, _, _, _, _ = _inputs(dtype)
    rows, weights = torch.randperm(x.shape[0])[:11], torch.rand(11) + 0.1
    whole = cpu_moe.grouped_moe(x, w13, w2, rows[:7], [2], [7], weights[:7], lib=lib)
    split = cpu_moe.grouped_moe(x, w13, w2, rows[:7], [2, 2, 2], [1, 2, 4], weights[:7], lib=lib)
    more = cpu_moe.grouped_moe(x, w13, w2, rows, [2], [11], weights, lib=lib)
    assert torch.equal(whole, split)
    assert torch.equal(whole[rows[:7]], more[rows[:7]])


def test_no_groups_and_empty_groups_give_zeros():
    lib = _library("native")
    x, w13, w2, _, _, _, _ = _inputs(torch.float32)
    empty = torch.zeros(0, dtype=torch.int64)
    assert not cpu_moe.grouped_moe(x, w13, w2, empty, [], [], torch.zeros(0), lib=lib).any()
    assert not cpu_moe.grouped_moe(x, w13, w2, empty, [3, 1], [0, 0], torch.zeros(0), lib=lib).any()


def test_ids_out_of_range_and_inconsistent_groups_are_refused():
    lib = _library("native")
    x, w13, w2, row_ids, experts, sizes, weights = _inputs(torch.float32)
    with pytest.raises(IndexError, match="out of range"):
        cpu_moe.grouped_moe(x, w13, w2, row_ids, [NUM_EXPERTS, *experts[1:]], sizes, weights, lib=lib)
    with pytest.raises(IndexError, match="out of range"):
        cpu_moe.grouped_moe(x, w13, w2, torch.where(row_ids == 0, -1, row_ids), experts, sizes, weights, lib=lib)
    with pytest.raises(IndexError, match="out of range"):
        cpu_moe.grouped_moe(x, w13, w2, row_ids + x.shape[0], experts, sizes, weights, lib=lib)
    with pytest.raises(ValueError, match="entries"):
        cpu_moe.grouped_moe(x, w13, w2, row_ids, experts, [*sizes[:-1], sizes[-1] + 1], weights, lib=lib)


def test_dispatch_takes_the_c_kernel_for_every_group_size(monkeypatch):
    """Large groups too (a prefill round's): were they torch's matmuls, an entry's bits would depend
    on how many other tokens its round gave its expert, and ping-pong's micro-batches (half the
    tokens) could change greedy tokens."""
    if cpu_moe.library() is None:
        pytest.skip("no C compiler here")
    calls = []
    original = cpu_moe.grouped_moe
    monkeypatch.setattr(cpu_moe, "grouped_moe", lambda *a: calls.append(a[5]) or original(*a))  # the groups' sizes
    args = _inputs(torch.bfloat16)
    torch.testing.assert_close(dispatch.grouped_moe(*args), grouped_moe_ref(*args), **TOLERANCES[torch.bfloat16])
    assert calls == [args[5]]
    x, w13, w2, _, _, _, _ = _inputs(torch.bfloat16)
    rows, weights = torch.randperm(x.shape[0]), torch.rand(x.shape[0]) + 0.1  # one group of 20 rows
    whole = dispatch.grouped_moe(x, w13, w2, rows, [3], [20], weights)
    halves = dispatch.grouped_moe(x, w13, w2, rows[:4], [3], [4], weights[:4]) + dispatch.grouped_moe(
        x, w13, w2, rows[4:], [3], [16], weights[4:]
    )  # each row is in one half: the sum adds zeros
    assert calls[1:] == [[20], [4], [16]]
    assert torch.equal(whole, halves)
    assert_close_f64(whole, _oracle(x, w13, w2, rows, [3], [20], weights), torch.bfloat16)
    odd = _inputs(torch.float32)
    narrow = (odd[0][:, : HIDDEN - 8], odd[1][:, :, : HIDDEN - 8].contiguous(), odd[2][:, : HIDDEN - 8].contiguous())
    assert torch.equal(dispatch.grouped_moe(*narrow, *odd[3:]), grouped_moe_ref(*narrow, *odd[3:]))  # not 32-aligned
    assert len(calls) == 4
    # the engine's local experts: fused_moe groups the top-k entries and takes the same kernel
    x, w13, w2 = args[:3]
    topk_ids = torch.stack([torch.randperm(NUM_EXPERTS)[:3] for _ in range(x.shape[0])])
    topk_ids[2, 1] = -1  # a skipped slot
    topk_weights = torch.rand(topk_ids.shape)
    out = dispatch.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert len(calls) == 5 and out.dtype == x.dtype
    oracle = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(3):
            if topk_ids[t, j] >= 0:
                e = int(topk_ids[t, j])
                gate_up = w13[e].double() @ x[t].double()
                act = F.silu(gate_up[:INTER]) * gate_up[INTER:]
                oracle[t] += float(topk_weights[t, j]) * (w2[e].double() @ act)
    assert_close_f64(out, oracle, torch.bfloat16)
