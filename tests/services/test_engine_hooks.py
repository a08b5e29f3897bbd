"""The engine hooks of disaggregated serving: a request parked for remote KV (blocks allocated,
nothing computed), finished with injected KV + first token, or falling back to a local prefill;
a prefill request that keeps its blocks until its KV is exported; KV events for the index."""

from __future__ import annotations

import pytest

from moemesh.engine.connectors.kv_transfer import RemoteKV
from moemesh.engine.core.request import RemotePrefillParams, RequestStatus
from moemesh.engine.sampling_params import SamplingParams
from tests.engine.factories import make_request, make_scheduler


def remote_request(request_id: str, num_tokens: int, min_remote_tokens: int = 1, start: int = 0):
    request = make_request(request_id, num_tokens, start=start, max_tokens=4)
    request.remote_prefill = RemotePrefillParams(min_remote_tokens)
    return request


def test_a_remote_request_gets_all_its_blocks_and_nothing_is_scheduled():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    scheduler.add_request(remote_request("a", 10))
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0
    request = scheduler.waiting_for_kv["a"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert scheduler.kv.get_block_ids("a") == [1, 2, 3]
    assert [r.request_id for r in scheduler.take_remote_prefills()] == ["a"]
    assert scheduler.take_remote_prefills() == []
    assert scheduler.kv.pool.cached_blocks == {}  # not keyed before the KV arrives


def test_finishing_the_remote_prefill_keys_the_blocks_and_decodes_from_the_first_token():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    scheduler.add_request(remote_request("a", 10))
    scheduler.schedule()
    request = scheduler.finish_remote_prefill("a", token_id=77)
    assert request.status == RequestStatus.RUNNING and request.output_token_ids == [77]
    assert len(scheduler.kv.pool.cached_blocks) == 2  # the two full prompt blocks
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 10 and new.token_ids[-1] == 77


def test_a_short_uncached_suffix_is_prefilled_locally():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    scheduler.add_request(remote_request("a", 10, min_remote_tokens=11))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 10} and not scheduler.waiting_for_kv


def test_a_failed_transfer_falls_back_to_computing_the_suffix_in_the_same_blocks():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    scheduler.add_request(remote_request("a", 10))
    scheduler.schedule()
    scheduler.fallback_to_local_prefill("a")
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 10}
    assert scheduler.kv.get_block_ids("a") == [1, 2, 3]


def test_a_fallback_after_some_kv_computes_only_the_rest_and_keys_the_blocks_it_filled():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    scheduler.add_request(remote_request("a", 10))
    scheduler.schedule()
    scheduler.fallback_to_local_prefill("a", num_kept_tokens=6)  # KV of tokens [0, 6) arrived
    request = scheduler.requests["a"]
    assert request.num_computed_tokens == 6 and request.status == RequestStatus.RUNNING
    assert list(scheduler.kv.pool.cached_blocks) == request.block_hashes[:1]  # block 0 is full, block 1 is not
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 6 and new.block_ids == [1, 2, 3]
    assert list(scheduler.kv.pool.cached_blocks) == request.block_hashes[:2]  # now also block 1, as computed here


def test_aborting_a_request_waiting_for_kv_frees_its_blocks():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    scheduler.add_request(remote_request("a", 10))
    scheduler.schedule()
    from moemesh.engine.core.request import FinishReason

    assert [r.request_id for r in scheduler.finish_requests(["a"], FinishReason.ABORT)] == ["a"]
    assert scheduler.kv.num_used_blocks == 0 and scheduler.num_unfinished_requests == 0


def test_split_kv_cuts_a_transfer_into_the_wire_formats_of_its_token_ranges():
    import torch

    from moemesh.engine.connectors.kv_transfer import KVLayout, gather_kv, split_kv

    source = [torch.randn(8, 4, 2, 3), torch.randn(8, 4, 5)]  # [num_blocks, block_size, *token_shape]
    layout = KVLayout("m", "float32", ((2, 3), (5,)))  # 44 bytes per token
    block_ids = [3, 1, 6, 0]
    pieces = list(split_kv(gather_kv(source, block_ids, 4, 2, 13), layout, 2, max_bytes=4 * 44 + 10))
    assert [first for first, _ in pieces] == [2, 6, 10]
    for first, data in pieces:
        end = first + len(data) // 44
        assert data == gather_kv(source, block_ids, 4, first, end).numpy().tobytes()
    assert len(pieces[-1][1]) == 3 * 44


def test_a_prefill_request_holds_its_blocks_until_released():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    request = make_request("p", 10, max_tokens=1)
    request.kv_export_start = 4
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"p": [5]})
    assert request.is_finished and "p" in scheduler.kv_held
    assert scheduler.kv.num_used_blocks == 3
    scheduler.release_held("p")
    assert scheduler.kv.num_used_blocks == 0


def test_kv_events_report_stored_and_evicted_keys():
    scheduler = make_scheduler(num_blocks=4, block_size=4)  # 3 usable blocks
    scheduler.add_request(make_request("a", 9, max_tokens=1))
    scheduler.update_from_output(scheduler.schedule(), {"a": [1]})
    events = scheduler.kv.drain_events()
    assert list(events.changes.values()) == [True, True] and not events.cleared
    scheduler.add_request(make_request("b", 9, start=100, max_tokens=1))
    scheduler.update_from_output(scheduler.schedule(), {"b": [1]})
    events = scheduler.kv.drain_events()
    assert sorted(events.changes.values()) == [False, False, True, True]  # a's two blocks evicted
    assert set(scheduler.kv.cached_block_hashes()) == {h for h, stored in events.changes.items() if stored}


@pytest.mark.parametrize(("start", "end"), [(0, 32), (16, 37), (5, 11), (3, 40), (0, 7)])
def test_gather_then_scatter_moves_exactly_the_kv_of_the_token_range(start, end):
    import torch

    from moemesh.engine.connectors.kv_transfer import gather_kv, scatter_kv

    source = [torch.randn(8, 16, 2, 4), torch.randn(8, 16, 1, 3)]  # [num_blocks, block_size, *token_shape]
    block_ids = [5, 2, 7]
    buffer = gather_kv(source, block_ids, 16, start, end)
    slots = [block_ids[t // 16] * 16 + t % 16 for t in range(start, end)]
    expected = torch.cat([t.view(-1, *t.shape[2:])[slots].reshape(-1) for t in source])  # per-token reference
    assert torch.equal(buffer.view(torch.float32), expected)
    target = [torch.zeros_like(t) for t in source]
    dest_blocks = [1, 3, 6]
    scatter_kv(target, dest_blocks, 16, start, end, buffer)
    dest_slots = [dest_blocks[t // 16] * 16 + t % 16 for t in range(start, end)]
    for src, dst in zip(source, target):
        flat_src, flat_dst = src.view(-1, *src.shape[2:]), dst.view(-1, *dst.shape[2:])
        assert torch.equal(flat_dst[dest_slots], flat_src[slots])
        untouched = torch.ones(flat_dst.shape[0], dtype=torch.bool)
        untouched[dest_slots] = False
        assert not flat_dst[untouched].any()


@pytest.mark.parametrize("num_hit_blocks", [0, 2])
def test_kv_exported_by_one_engine_and_injected_into_another_continues_greedy_decoding(offline_llm, num_hit_blocks):
    """One engine plays both sides (prefill export, then decode injection) against its own local run."""
    engine = offline_llm.engine
    prompt = engine.tokenizer.encode(f"Case {num_hit_blocks}: the quick brown fox jumps over the lazy dog. " * 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    (expected,) = offline_llm.generate([prompt], greedy)
    assert engine.kv_cache_manager.pool.reset_prefix_cache()
    if num_hit_blocks:  # the decode side already holds a prefix
        offline_llm.generate([prompt[: num_hit_blocks * 16 + 1]], SamplingParams(temperature=0.0, max_tokens=1))
    engine.add_request(prompt, greedy, "d", remote_prefill=RemotePrefillParams(1))
    engine.step()
    (parked,) = engine.take_remote_prefills()
    assert parked.num_computed_tokens == num_hit_blocks * 16
    first_token_only = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request(prompt, first_token_only, "p", kv_export_start=parked.num_computed_tokens)
    kv = RemoteKV(parked.num_computed_tokens, len(prompt), engine.kv_layout.bytes_per_token)
    while not kv.complete:
        engine.step()
        for exported in engine.take_kv_exports():
            if exported.piece.num_tokens:
                kv.add(exported.piece)
            if exported.first_token is not None:
                kv.add(exported.first_token)
    assert kv.num_received_tokens == len(prompt) - parked.num_computed_tokens
    (first,) = engine.finish_remote_prefill("d", kv)
    token_ids = list(first.token_ids)
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids = output.token_ids
    assert token_ids == expected.token_ids
    assert engine.kv_cache_manager.num_used_blocks == 0
