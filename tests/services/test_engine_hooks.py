"""The disaggregated-serving connector (connectors/remote_prefill.py) at the scheduler's hooks: a
request parked for remote KV (blocks allocated, nothing computed), finished with injected KV + first
token, or falling back to a local prefill; a prefill request that keeps its blocks until its KV is
exported; KV events for the index."""

from __future__ import annotations

import pytest
import torch

from moemesh.engine.connectors.base import KVCacheGroup, KVCaches, KVLoadStarted, NullConnector
from moemesh.engine.connectors.kv_transfer import ExportedKV, FirstToken, KVPiece, RemoteKV
from moemesh.engine.connectors.remote_prefill import KVExportParams, RemotePrefillConnector, RemotePrefillParams
from moemesh.engine.core.request import RequestStatus
from moemesh.engine.sampling_params import SamplingParams
from tests.engine.factories import make_request, make_scheduler


def remote_request(request_id: str, num_tokens: int, min_remote_tokens: int = 1, start: int = 0):
    request = make_request(request_id, num_tokens, start=start, max_tokens=4)
    request.kv_transfer_params = RemotePrefillParams(min_remote_tokens)
    return request


def pd_scheduler(num_blocks: int = 16, block_size: int = 4):
    """A scheduler with the P/D connector over a tiny paged KV (one tensor, 2 values per token)."""
    connector = RemotePrefillConnector()
    connector.register_kv_caches(KVCaches("m", (KVCacheGroup(block_size, (torch.zeros(num_blocks, block_size, 2),)),)))
    return make_scheduler(num_blocks=num_blocks, block_size=block_size, kv_connector=connector)


def transfer_ends(scheduler, request_id: str, num_tokens: int, first_token_id: int | None = None) -> int:
    """The parked request's transfer ends after the KV of `num_tokens` tokens (and the first token);
    the scheduler learns it as at a step's start. Returns the number of tokens kept."""
    connector, request = scheduler.kv_connector, scheduler.waiting_for_kv[request_id]
    kv = RemoteKV(request.num_computed_tokens, request.num_prompt_tokens, connector.layout.bytes_per_token)
    if num_tokens:
        kv.add(KVPiece(kv.start, num_tokens, torch.zeros(num_tokens * kv.bytes_per_token, dtype=torch.uint8)))
    if first_token_id is not None:
        kv.add(FirstToken(first_token_id, None, 0))
    num_kept = connector.receive(request_id, kv)
    scheduler.update_from_connector(connector.get_finished())
    return num_kept


def test_a_remote_request_gets_all_its_blocks_and_nothing_is_scheduled():
    scheduler = pd_scheduler()
    scheduler.add_request(remote_request("a", 10))
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0
    request = scheduler.waiting_for_kv["a"]
    assert request.status == RequestStatus.WAITING_FOR_EXTERNAL_KV
    assert scheduler.kv.get_block_ids("a") == [1, 2, 3]
    assert scheduler.take_events() == [KVLoadStarted("a", num_computed_tokens=0, num_external_tokens=10)]
    assert scheduler.take_events() == []
    assert scheduler.kv.pool.cached_blocks == {}  # not keyed before the KV arrives


def test_finishing_the_remote_prefill_keys_the_blocks_and_decodes_from_the_first_token():
    scheduler = pd_scheduler()
    scheduler.add_request(remote_request("a", 10))
    scheduler.schedule()
    request = scheduler.requests["a"]
    transfer_ends(scheduler, "a", 10, first_token_id=77)
    assert request.status == RequestStatus.RUNNING and request.output_token_ids == [77]
    assert len(scheduler.kv.pool.cached_blocks) == 2  # the two full prompt blocks
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 10 and new.token_ids[-1] == 77


def test_a_short_uncached_suffix_is_prefilled_locally():
    scheduler = pd_scheduler()
    scheduler.add_request(remote_request("a", 10, min_remote_tokens=11))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 10} and not scheduler.waiting_for_kv


def test_a_failed_transfer_falls_back_to_computing_the_suffix_in_the_same_blocks():
    scheduler = pd_scheduler()
    scheduler.add_request(remote_request("a", 10))
    scheduler.schedule()
    assert transfer_ends(scheduler, "a", 0) == 0
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 10}
    assert scheduler.kv.get_block_ids("a") == [1, 2, 3]


def test_a_fallback_after_some_kv_computes_only_the_rest_and_keys_the_blocks_it_filled():
    scheduler = pd_scheduler()
    scheduler.add_request(remote_request("a", 10))
    scheduler.schedule()
    assert transfer_ends(scheduler, "a", 6) == 6  # KV of tokens [0, 6) arrived
    request = scheduler.requests["a"]
    assert request.num_computed_tokens == 6 and request.status == RequestStatus.RUNNING
    assert list(scheduler.kv.pool.cached_blocks) == request.block_hashes[:1]  # block 0 is full, block 1 is not
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 6 and new.block_ids == [1, 2, 3]
    assert list(scheduler.kv.pool.cached_blocks) == request.block_hashes[:2]  # now also block 1, as computed here


def test_aborting_a_request_waiting_for_kv_frees_its_blocks():
    scheduler = pd_scheduler()
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
    scheduler = pd_scheduler()
    request = make_request("p", 10, max_tokens=1)
    request.kv_transfer_params = KVExportParams(4)
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"p": [5]})
    assert request.is_finished and "p" in scheduler.kv_held
    assert scheduler.kv.num_used_blocks == 3
    connector = scheduler.kv_connector
    connector.save_kv(out.kv_connector_metadata)  # the KV goes out: the connector releases the blocks
    ((exported_id, start, num_tokens, first),) = [
        (e.request_id, e.piece.start, e.piece.num_tokens, e.first_token.token_id) for e in connector.take_events()
    ]
    assert (exported_id, start, num_tokens, first) == ("p", 4, 6, 5)
    scheduler.update_from_connector(connector.get_finished())
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


@pytest.fixture()
def pd_engine(offline_llm):
    """The session's offline engine with the P/D connector (which it drives without an event loop)."""
    engine = offline_llm.engine
    engine.set_kv_connector(RemotePrefillConnector())
    engine.take_connector_events()  # none of an earlier test's
    yield engine
    engine.set_kv_connector(NullConnector())


@pytest.mark.parametrize("num_hit_blocks", [0, 2])
def test_kv_exported_by_one_engine_and_injected_into_another_continues_greedy_decoding(
    offline_llm, pd_engine, num_hit_blocks
):
    """One engine plays both sides (prefill export, then decode injection) against its own local run."""
    engine, connector = pd_engine, pd_engine.kv_connector
    prompt = engine.tokenizer.encode(f"Case {num_hit_blocks}: the quick brown fox jumps over the lazy dog. " * 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    (expected,) = offline_llm.generate([prompt], greedy)
    assert engine.kv_cache_manager.pool.reset_prefix_cache()
    if num_hit_blocks:  # the decode side already holds a prefix
        offline_llm.generate([prompt[: num_hit_blocks * 16 + 1]], SamplingParams(temperature=0.0, max_tokens=1))
    engine.add_request(prompt, greedy, "d", kv_transfer_params=RemotePrefillParams(1))
    engine.step()
    (parked,) = [e for e in engine.take_connector_events() if isinstance(e, KVLoadStarted)]
    assert parked.num_computed_tokens == num_hit_blocks * 16
    first_token_only = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request(prompt, first_token_only, "p", kv_transfer_params=KVExportParams(parked.num_computed_tokens))
    kv = RemoteKV(parked.num_computed_tokens, len(prompt), connector.layout.bytes_per_token)
    while not kv.complete:
        engine.step()
        for exported in [e for e in engine.take_connector_events() if isinstance(e, ExportedKV)]:
            if exported.piece.num_tokens:
                kv.add(exported.piece)
            if exported.first_token is not None:
                kv.add(exported.first_token)
    assert kv.num_received_tokens == len(prompt) - parked.num_computed_tokens
    connector.receive("d", kv)
    token_ids = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids += output.new_token_ids
    assert token_ids == expected.token_ids
    assert engine.kv_cache_manager.num_used_blocks == 0
