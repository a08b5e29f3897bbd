"""A remote prefill streams its KV as the chunked prefill progresses, and a transfer that fails
part-way resumes: the decode side keeps the KV it received and prefills only the rest, with the
offline engine's greedy output (the oracle, itself checked against Hugging Face).

One engine (the session's offline engine, with the P/D connector) plays the prefill worker, with a
small round budget so its prompt takes several rounds, and then the decode worker: in the engine
directly (the test ends each transfer through the connector), and behind the real DecodeServicer
with a KV transport that delivers some pieces and then fails.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from moemesh.contracts.block_hash import hash_block_chain
from moemesh.engine.async_engine import AsyncEngine
from moemesh.engine.connectors.base import KVLoadStarted, NullConnector
from moemesh.engine.connectors.kv_transfer import (
    ExportedKV,
    FirstToken,
    KVPiece,
    KVTransferError,
    KVTransport,
    RemoteKV,
    split_kv,
)
from moemesh.engine.connectors.remote_prefill import KVExportParams, RemotePrefillConnector, RemotePrefillParams
from moemesh.engine.sampling_params import SamplingParams
from moemesh.proto.v1 import common_pb2, decode_pb2
from moemesh.runtime.metrics import WorkerMetrics
from moemesh.worker.decode_servicer import DecodeServicer

BUDGET = 48  # tokens per round on the prefill side: 3 blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture()
def engine(offline_llm, expected):  # the oracle runs first: its prompt leaves the cache
    engine = offline_llm.engine
    assert engine.kv_cache_manager.pool.reset_prefix_cache()
    engine.set_kv_connector(RemotePrefillConnector())
    engine.take_connector_events()  # none of an earlier test's
    yield engine
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.num_used_blocks == 0
    engine.set_kv_connector(NullConnector())


@pytest.fixture(scope="module")
def prompt(offline_llm) -> list[int]:
    prompt = offline_llm.engine.tokenizer.encode("Resume me: the quick brown fox jumps over the lazy dog, again. " * 10)
    assert 150 < len(prompt) < 200 and len(prompt) % 16
    return prompt


@pytest.fixture(scope="module")
def expected(offline_llm, prompt) -> list[int]:
    """The offline engine's greedy output for the prompt, prefilled locally."""
    (output,) = offline_llm.generate([prompt], GREEDY)
    return output.token_ids


def prefill_remotely(engine, prompt: list[int], start: int) -> tuple[list[KVPiece], FirstToken]:
    """Run the prompt as a prefill worker would, `BUDGET` tokens per round; what it hands out,
    round by round (the pieces of each step's `ExportedKV` events)."""
    config = engine.scheduler.config
    engine.scheduler.config = dataclasses.replace(config, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    try:
        params = dataclasses.replace(GREEDY, max_tokens=1)
        engine.add_request(prompt, params, "p", kv_transfer_params=KVExportParams(start))
        pieces, first = [], None
        while first is None:
            engine.step()
            for exported in [e for e in engine.take_connector_events() if isinstance(e, ExportedKV)]:
                pieces += [exported.piece] if exported.piece.num_tokens else []
                first = exported.first_token or first
        while engine.has_steppable_work:  # an empty round may still be in flight
            engine.step()
        return pieces, first
    finally:
        engine.scheduler.config = config


def park(engine, prompt: list[int], params: SamplingParams = GREEDY) -> int:
    """Add the request "d" as a decode worker would; the computed tokens it was parked with."""
    engine.add_request(prompt, params, "d", kv_transfer_params=RemotePrefillParams(1))
    engine.step()
    (parked,) = [e for e in engine.take_connector_events() if isinstance(e, KVLoadStarted)]
    return parked.num_computed_tokens


def bytes_per_token(engine) -> int:
    return engine.kv_connector.layout.bytes_per_token


def run_to_completion(engine, token_ids: list[int]) -> list[int]:
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids = token_ids + output.new_token_ids
    return token_ids


def test_a_prefill_request_hands_out_its_kv_in_whole_blocks_round_by_round(engine, prompt):
    pieces, first = prefill_remotely(engine, prompt, start=16)
    bounds = [16, *range(BUDGET, len(prompt), BUDGET), len(prompt)]  # rounds end at 48, 96, ...; the tail last
    assert [(p.start, p.end) for p in pieces] == list(zip(bounds, bounds[1:]))
    assert all(p.data.numel() == p.num_tokens * bytes_per_token(engine) for p in pieces)
    assert first.token_id >= 0 and first.num_cached_tokens == 0


@pytest.mark.parametrize("num_delivered", [1, 2])
def test_a_decode_request_resumes_after_the_pieces_delivered_with_the_local_greedy_output(
    engine, prompt, expected, num_delivered
):
    engine.add_request(prompt[:33], dataclasses.replace(GREEDY, max_tokens=1), "prefix")  # D holds 2 blocks
    run_to_completion(engine, [])
    start = park(engine, prompt)
    assert start == 32
    pieces, _ = prefill_remotely(engine, prompt, start)
    kv = RemoteKV(start, len(prompt), bytes_per_token(engine))
    for piece in pieces[:num_delivered]:
        kv.add(piece)
    num_kept = engine.kv_connector.receive("d", kv)
    assert num_kept == sum(p.num_tokens for p in pieces[:num_delivered]) == [48, 96][num_delivered - 1]
    assert run_to_completion(engine, []) == expected
    full_blocks = hash_block_chain(prompt[: len(prompt) // 16 * 16], 16, engine.kv_cache_manager.extra)
    assert set(full_blocks) <= set(engine.kv_cache_manager.cached_block_hashes())  # keyed as a local prefill


def test_all_the_kv_without_the_first_token_keeps_all_but_the_piece_with_the_last_token(engine, prompt, expected):
    start = park(engine, prompt)
    pieces, _ = prefill_remotely(engine, prompt, start)
    kv = RemoteKV(start, len(prompt), bytes_per_token(engine))
    for piece in pieces:
        kv.add(piece)
    assert engine.kv_connector.receive("d", kv) == pieces[-1].start  # the last token is computed here
    assert run_to_completion(engine, []) == expected


def test_a_seeded_request_resumes_with_the_seeded_output_of_a_local_run(engine, offline_llm, prompt):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=8)
    (expected,) = offline_llm.generate([prompt], seeded)
    assert engine.kv_cache_manager.pool.reset_prefix_cache()
    start = park(engine, prompt, seeded)
    pieces, _ = prefill_remotely(engine, prompt, start)
    kv = RemoteKV(start, len(prompt), bytes_per_token(engine))
    kv.add(pieces[0])
    assert engine.kv_connector.receive("d", kv) == BUDGET
    assert run_to_completion(engine, []) == expected.token_ids


class FailingTransport(KVTransport):
    """Delivers `pieces` (as the gRPC transport would: cut into messages) and then fails."""

    def __init__(self, pieces: list[KVPiece], layout, max_bytes: int):
        self.pieces, self.layout, self.max_bytes = pieces, layout, max_bytes
        self.num_delivered_tokens = 0

    async def fetch(self, task):
        assert task.idle_timeout_s == 20.0 and task.timeout_s == pytest.approx(20.0 + 0.01 * len(task.prompt_token_ids))
        for piece in self.pieces:
            for first, data in split_kv(piece.data, self.layout, piece.start, self.max_bytes):
                message = KVPiece(first, len(data) // self.layout.bytes_per_token, _tensor(data))
                self.num_delivered_tokens += message.num_tokens
                yield message
        raise KVTransferError("the prefill worker is gone")


class ServicerContext:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def test_the_decode_servicer_resumes_a_failed_transfer_and_counts_the_tokens_it_kept(
    engine, prompt, expected, monkeypatch
):
    pieces, _ = prefill_remotely(engine, prompt, start=0)
    transport = FailingTransport(pieces[:2], engine.kv_connector.layout, max_bytes=10 * bytes_per_token(engine))
    assert engine.kv_cache_manager.pool.reset_prefix_cache()
    monkeypatch.setattr(engine, "shutdown", lambda: None)  # the session's engine keeps its runner thread
    responses, metrics = asyncio.run(serve(engine, transport, prompt))
    assert [t for r in responses for t in r.token_ids] == expected
    assert transport.num_delivered_tokens == 2 * BUDGET  # in messages of 10 tokens: 96 = 9 * 10 + 6
    assert {r.num_remote_prefill_tokens for r in responses} == {2 * BUDGET}
    labels = {"model_name": "m", "worker_id": "d"}
    assert metrics.registry.get_sample_value("moemesh:kv_transfer_resumed_tokens_total", labels) == 2 * BUDGET
    received = metrics.registry.get_sample_value("moemesh:kv_transfer_bytes_total", {**labels, "direction": "received"})
    assert received == 2 * BUDGET * bytes_per_token(engine)


async def serve(engine, transport: KVTransport, prompt: list[int]):
    """One Generate call on a DecodeServicer over `engine`, its connector fetching through
    `transport` (the AsyncEngine stopped afterwards)."""
    async_engine = AsyncEngine(lambda: engine, asyncio.get_running_loop())
    metrics = WorkerMetrics("m", "d", lambda: async_engine.stats)
    engine.set_kv_connector(RemotePrefillConnector(transport, metrics, timeout_s=20.0, timeout_per_token_s=0.01))
    servicer = DecodeServicer(async_engine, "d", "decode", metrics, min_remote_prefill_tokens=1, max_queued_requests=8)
    request = decode_pb2.WorkerGenerateRequest(
        request_id="served",
        prompt_token_ids=prompt,
        prefill_endpoint="prefill:1",
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens),
    )
    async_engine.start()
    try:
        await async_engine.wait_ready()
        return [response async for response in servicer.Generate(request, ServicerContext())], metrics
    finally:
        await async_engine.stop()
        while engine.has_steppable_work:  # a round the engine thread left in flight
            engine.step()


def _tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # [num_bytes]


def test_the_grpc_transport_yields_each_chunk_as_it_comes_and_fails_when_the_prefill_worker_goes_quiet():
    """The KV wait is progress-based: a chunk resets it, `idle_timeout_s` without one fails."""
    import grpc

    from moemesh.engine.connectors.kv_transfer import KVLayout, RemotePrefillTask
    from moemesh.proto.v1 import prefill_pb2, prefill_pb2_grpc
    from moemesh.runtime.grpc_util import ChannelPool
    from moemesh.worker.kv_client import GrpcKVTransport

    layout = KVLayout("m", "float32", ((2, 3),))

    class QuietAfterOneChunk(prefill_pb2_grpc.PrefillWorkerServicer):
        def __init__(self):
            self.cancelled = asyncio.Event()

        async def Prefill(self, request, context):
            context.add_done_callback(lambda _: self.cancelled.set())
            chunk = prefill_pb2.KVChunk(
                start_token=request.num_computed_tokens, num_tokens=2, data=bytes(2 * layout.bytes_per_token)
            )
            yield prefill_pb2.PrefillResponse(chunk=chunk)
            await asyncio.Event().wait()  # never sends again

    async def scenario():
        server, servicer = grpc.aio.server(), QuietAfterOneChunk()
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channels = ChannelPool()
        # the first chunk must also come within the idle timeout: room for a loaded machine
        task = RemotePrefillTask(
            f"127.0.0.1:{port}", "r", [1] * 10, None, 4, layout, timeout_s=60.0, idle_timeout_s=3.0
        )
        received = []
        try:
            with pytest.raises(KVTransferError, match="nothing for 3.0 s"):
                async for item in GrpcKVTransport(channels).fetch(task):
                    received.append(item)
            await asyncio.wait_for(servicer.cancelled.wait(), 30)  # the call was cancelled on the prefill side
        finally:
            await channels.close()
            await server.stop(None)
        return received

    (piece,) = asyncio.run(scenario())
    assert (piece.start, piece.num_tokens, piece.data.numel()) == (4, 2, 2 * layout.bytes_per_token)
