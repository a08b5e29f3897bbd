"""The KV connector interface (engine/connectors/base.py) carries an offload tier with no change to
the scheduler or the engine: `HostStore`, a test connector built on the interface alone, keeps the
full prompt blocks of finished requests in host memory (an asynchronous save: their blocks are held
until copied) and loads a later request's stored prefix from there, asynchronously (the request
waits, parked, until the load is reported) or within the round that admits it. Loaded requests give
the all-local greedy output (the oracle: the same engine with nothing stored); an abort while a load
is in flight frees every block; nothing stays held or tracked."""

from __future__ import annotations

import queue
from dataclasses import dataclass

import pytest
import torch

from moemesh.contracts.finish_reason import FinishReason
from moemesh.engine.connectors.base import (
    NO_METADATA,
    FinishedLoad,
    FinishedTransfers,
    KVCacheGroup,
    KVCaches,
    KVConnector,
    KVConnectorMetadata,
    KVLoadFinished,
    KVLoadStarted,
    NullConnector,
)
from moemesh.engine.core.request import RequestStatus
from moemesh.engine.sampling_params import SamplingParams
from tests.engine.factories import make_request, make_scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@dataclass(frozen=True)
class _Loads(KVConnectorMetadata):
    loads: tuple[tuple[str, list[int], int, int, tuple[int, ...]], ...]  # (id, block ids, start, end, prompt)


class HostStore(KVConnector):
    """An offload tier in host memory: stored blocks are keyed by the prompt prefix they end."""

    def __init__(self, load_async: bool = True, finish_loads: bool = True):
        self.load_async = load_async
        self.finish_loads = finish_loads  # False: loads stay in flight forever
        self.blocks: dict[tuple[int, ...], list[torch.Tensor]] = {}  # prefix -> its last block, per cache tensor
        self.loading: set[str] = set()  # claimed, not reported or forgotten
        self.num_loaded_tokens = 0
        self._pending: list[tuple[str, list[int], int, int, tuple[int, ...]]] = []
        self._loaded: queue.SimpleQueue[tuple[str, int]] = (
            queue.SimpleQueue()
        )  # start_load_kv may run on the runner thread
        self._to_save: list[tuple[str, tuple[int, ...], list[int]]] = []
        self._saved: set[str] = set()

    def register_kv_caches(self, caches: KVCaches) -> None:
        (self.group,) = caches.groups

    # scheduler half
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        size, end = self.group.block_size, num_computed_tokens
        while end + size < request.num_tokens and tuple(request.prompt_token_ids[: end + size]) in self.blocks:
            end += size
        return end - num_computed_tokens, self.load_async and end > num_computed_tokens

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        if num_external_tokens:
            start = request.num_computed_tokens
            prompt = tuple(request.prompt_token_ids)
            self._pending.append((request.request_id, list(block_ids[0]), start, start + num_external_tokens, prompt))
            self.loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        loads, self._pending = tuple(self._pending), []
        return _Loads(loads) if loads else NO_METADATA

    def request_finished(self, request, block_ids) -> bool:
        self.loading.discard(request.request_id)
        num_full = request.num_prompt_tokens // self.group.block_size
        if request.finish_reason == FinishReason.ABORT or num_full == 0:
            return False
        prefix = tuple(request.prompt_token_ids[: num_full * self.group.block_size])
        self._to_save.append((request.request_id, prefix, list(block_ids[0][:num_full])))
        return True  # the copy happens in save_kv: hold the blocks until then

    # worker half
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, _Loads):
            return
        size = self.group.block_size
        for request_id, block_ids, start, end, prompt in metadata.loads:
            if request_id not in self.loading or not self.finish_loads:
                continue
            for t in range(start, end, size):
                for tensor, data in zip(self.group.tensors, self.blocks[prompt[: t + size]]):
                    tensor[block_ids[t // size]].copy_(data)
            self.num_loaded_tokens += end - start
            if self.load_async:
                self._loaded.put((request_id, end - start))  # reported at the next get_finished
            else:
                self.loading.discard(request_id)

    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        size = self.group.block_size
        for request_id, prefix, block_ids in self._to_save:
            for i, block_id in enumerate(block_ids):
                self.blocks.setdefault(prefix[: (i + 1) * size], [t[block_id].clone() for t in self.group.tensors])
            self._saved.add(request_id)
        self._to_save = []

    def get_finished(self) -> FinishedTransfers:
        finished = FinishedTransfers(saved=self._saved)
        self._saved = set()
        while not self._loaded.empty():
            request_id, num_tokens = self._loaded.get_nowait()
            if request_id in self.loading:
                self.loading.discard(request_id)
                finished.loads[request_id] = FinishedLoad(num_tokens)
        return finished

    @property
    def has_finished(self) -> bool:
        return bool(self._saved) or not self._loaded.empty()


# -- at the scheduler (tiny inputs, no model) --------------------------------------------------


def store_with_prefix(prefix: list[int], load_async: bool = True) -> HostStore:
    """A HostStore over a 16-block pool of 4-token blocks holding `prefix` (whole blocks), block i
    filled with i + 1."""
    store = HostStore(load_async)
    store.register_kv_caches(KVCaches("m", (KVCacheGroup(4, (torch.zeros(16, 4, 2),)),)))
    for i in range(len(prefix) // 4):
        store.blocks[tuple(prefix[: (i + 1) * 4])] = [torch.full((4, 2), float(i + 1))]
    return store


def test_an_async_load_parks_the_request_until_reported_then_it_runs_from_the_loaded_tokens():
    store = store_with_prefix(list(range(8)))
    scheduler = make_scheduler(num_blocks=16, block_size=4, kv_connector=store)
    scheduler.add_request(make_request("a", 10))
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0
    assert scheduler.waiting_for_kv["a"].status == RequestStatus.WAITING_FOR_EXTERNAL_KV
    assert scheduler.kv.get_block_ids("a") == [1, 2]  # the claimed tokens' blocks only
    assert scheduler.take_events() == [KVLoadStarted("a", num_computed_tokens=0, num_external_tokens=8)]
    store.start_load_kv(out.kv_connector_metadata)  # the engine, before the round runs
    assert scheduler.update_from_connector(store.get_finished()) == []  # no token came with the KV
    assert scheduler.take_events() == [KVLoadFinished("a", num_tokens=8, with_first_token=False)]
    tensor = store.group.tensors[0]
    assert tensor[1].eq(1).all() and tensor[2].eq(2).all()
    assert len(scheduler.kv.pool.cached_blocks) == 2  # keyed once their KV is there
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 2}
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and new.block_ids == [1, 2, 3]


def test_a_sync_load_counts_as_computed_in_the_round_that_admits_the_request():
    store = store_with_prefix(list(range(8)), load_async=False)
    scheduler = make_scheduler(num_blocks=16, block_size=4, kv_connector=store)
    scheduler.add_request(make_request("a", 10))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 2} and out.total_num_scheduled_tokens == 2
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and new.block_ids == [1, 2, 3]
    assert scheduler.take_events() == [] and not scheduler.waiting_for_kv
    store.start_load_kv(out.kv_connector_metadata)
    assert store.group.tensors[0][2].eq(2).all() and not store.loading


def test_a_request_aborted_while_its_load_is_in_flight_frees_its_blocks_and_is_forgotten():
    store = store_with_prefix(list(range(8)))
    scheduler = make_scheduler(num_blocks=16, block_size=4, kv_connector=store)
    scheduler.add_request(make_request("a", 10))
    out = scheduler.schedule()
    assert scheduler.kv.num_used_blocks == 2 and store.loading == {"a"}
    (aborted,) = scheduler.finish_requests(["a"], FinishReason.ABORT)
    assert aborted.finish_reason == FinishReason.ABORT
    assert scheduler.kv.num_used_blocks == 0 and scheduler.num_unfinished_requests == 0 and not store.loading
    store.start_load_kv(out.kv_connector_metadata)  # the round still runs: the load is skipped
    assert not store.get_finished() and store.num_loaded_tokens == 0


def test_a_finished_request_keeps_its_blocks_until_the_connector_saved_them():
    store = store_with_prefix([])
    scheduler = make_scheduler(num_blocks=16, block_size=4, kv_connector=store)
    scheduler.add_request(make_request("b", 10, max_tokens=1))
    out = scheduler.schedule()
    store.group.tensors[0][1:3] = 7.0  # what the round wrote into its two full blocks
    scheduler.update_from_output(out, {"b": [5]})
    assert "b" in scheduler.kv_held and scheduler.kv.num_used_blocks == 3
    store.save_kv(out.kv_connector_metadata)
    scheduler.update_from_connector(store.get_finished())
    assert not scheduler.kv_held and scheduler.kv.num_used_blocks == 0
    assert sorted(len(prefix) for prefix in store.blocks) == [4, 8]
    assert all(block[0].eq(7).all() for block in store.blocks.values())


# -- in the engine (the session's offline engine) ----------------------------------------------


@pytest.fixture()
def engine(offline_llm):
    engine = offline_llm.engine
    assert engine.kv_cache_manager.pool.reset_prefix_cache()
    engine.take_connector_events()
    yield engine
    engine.set_kv_connector(NullConnector())
    engine.take_connector_events()
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("load_async", [True, False])
def test_a_prefix_loaded_from_host_memory_gives_the_local_greedy_output(engine, offline_llm, load_async):
    store = HostStore(load_async)
    engine.set_kv_connector(store)
    prompt = engine.tokenizer.encode(f"Offload {load_async}: the quick brown fox jumps over the lazy dog. " * 3)
    (expected,) = offline_llm.generate([prompt], GREEDY)  # all local (nothing stored yet), then saved
    assert len(store.blocks) == len(prompt) // 16 and not engine.scheduler.kv_held
    assert engine.kv_cache_manager.pool.reset_prefix_cache()  # every block free: nothing held
    for tensor in store.group.tensors:  # nothing left on the device: the KV must come from the store
        tensor.zero_()
    (loaded,) = offline_llm.generate([prompt], GREEDY)
    num_loaded = (len(prompt) - 1) // 16 * 16  # every stored block before the last prompt token
    assert store.num_loaded_tokens == num_loaded and num_loaded >= 32
    assert loaded.token_ids == expected.token_ids
    assert loaded.num_cached_tokens == 0  # none of it came from the device's prefix cache
    events = [(type(e), e.request_id) for e in engine.take_connector_events()]
    rid = loaded.request_id
    assert events == ([(KVLoadStarted, rid), (KVLoadFinished, rid)] if load_async else [])
    assert not store.loading and engine.kv_cache_manager.num_used_blocks == 0


def test_an_abort_while_a_load_is_in_flight_frees_every_block(engine, offline_llm):
    store = HostStore(finish_loads=False)
    engine.set_kv_connector(store)
    prompt = engine.tokenizer.encode("Abort me while my KV is on its way from host memory, please. " * 3)
    offline_llm.generate([prompt], GREEDY)  # stored
    assert engine.kv_cache_manager.pool.reset_prefix_cache()
    engine.add_request(prompt, GREEDY, "in-flight")
    for _ in range(3):
        engine.step()
    assert list(engine.scheduler.waiting_for_kv) == ["in-flight"] and store.loading == {"in-flight"}
    assert engine.kv_cache_manager.num_used_blocks == (len(prompt) - 1) // 16
    (aborted,) = engine.abort_request("in-flight")
    assert aborted.finished and aborted.finish_reason == FinishReason.ABORT
    while engine.has_steppable_work:  # a round still in flight
        engine.step()
    assert not store.loading and not engine.scheduler.waiting_for_kv
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.num_used_blocks == 0
