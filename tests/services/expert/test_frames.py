"""The socket transport's wire: frames carry requests and replies exactly (every dtype, empty
arrays, errors), refuse headers that do not parse, a drained write cannot deadlock against a peer
that writes at the same time, and the expert side closes connections that name no opened session
or send garbage while it keeps serving the others."""

from __future__ import annotations

import dataclasses
import gc
import socket
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from moemesh.expert.protocol.call import CallError, ExpertReply, ExpertRequest
from moemesh.expert.protocol.frame_socket import FrameSocket
from moemesh.expert.protocol.frames import (
    MAX_PAYLOAD_BYTES,
    REPLY,
    REQUEST,
    REQUEST_MAGIC,
    FrameError,
    decode_reply,
    decode_request,
    encode_error,
    encode_hello,
    encode_reply,
    encode_request,
    parse_reply_header,
    parse_request_header,
    status_name,
)
from moemesh.expert.server.socket_server import SocketDataPlane


def joined(buffers) -> bytearray:
    return bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in buffers))


def round_trip_request(sequence_id: int, request: ExpertRequest) -> tuple[int, ExpertRequest]:
    data = joined(encode_request(sequence_id, request))
    header = parse_request_header(data[: REQUEST.size])
    assert len(data) == REQUEST.size + header.payload_bytes
    return header.sequence_id, decode_request(header, data[REQUEST.size :])


def random_request(
    dtype: torch.dtype, num_tokens: int, weights: bool, seed: int = 0, in_input_dtype: bool = False
) -> ExpertRequest:
    gen = np.random.default_rng(seed)
    x = torch.randn(num_tokens, 24, generator=torch.Generator().manual_seed(seed)).to(dtype)
    sizes = gen.integers(0, 4, size=5).astype(np.int32)
    row_ids = gen.integers(0, max(num_tokens, 1), size=int(sizes.sum())).astype(np.int32)
    w = torch.from_numpy(gen.random(row_ids.size).astype(np.float32)) if weights else None
    return ExpertRequest(
        3,
        2**40 + 7,
        x,
        np.arange(5, dtype=np.int32) * 3,
        np.arange(5, dtype=np.int32) + 100,
        sizes,
        row_ids,
        w,
        in_input_dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_tokens, weights, in_input_dtype", [(7, True, False), (7, True, True), (7, False, False), (0, True, False)]
)
def test_a_request_frame_carries_every_field_exactly(dtype, num_tokens, weights, in_input_dtype):
    sent = random_request(dtype, num_tokens, weights, in_input_dtype=in_input_dtype)
    sequence_id, got = round_trip_request(2**63 + 5, sent)
    assert sequence_id == 2**63 + 5
    assert (got.layer, got.placement_version) == (sent.layer, sent.placement_version)
    assert got.outputs_in_input_dtype == in_input_dtype
    assert got.hidden_states.dtype == dtype and torch.equal(got.hidden_states, sent.hidden_states)
    for name in ("group_slots", "group_experts", "group_rows", "row_ids"):
        assert getattr(got, name).tolist() == getattr(sent, name).tolist(), name
    if weights:
        assert torch.equal(got.entry_weights, sent.entry_weights)
    else:
        assert got.entry_weights is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_weights_after_an_odd_sized_half_precision_x_arrive_exactly(dtype):
    """7 x 5 bf16 values end 2 bytes past a 4-byte boundary: the weights are copied, not viewed unaligned."""
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(3)).to(dtype)
    i32 = lambda v: np.array(v, dtype=np.int32)  # noqa: E731
    weights = torch.tensor([0.25, 0.5, 1.0 / 3.0])
    _, got = round_trip_request(1, ExpertRequest(0, 1, x, i32([2]), i32([2]), i32([3]), i32([6, 0, 3]), weights))
    assert torch.equal(got.hidden_states, x) and torch.equal(got.entry_weights, weights)
    assert got.row_ids.tolist() == [6, 0, 3] and got.group_rows.tolist() == [3]


def test_frames_carry_strided_tensors_and_keep_temporaries_alive_until_sent():
    """The frame's buffers view the tensors' memory: a strided tensor is framed from a dense
    copy, and bf16 gate weights from their float32 copy, which nothing else holds."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 48, generator=gen)[:, ::2]  # strided rows
    weights = torch.rand(4, generator=gen).to(torch.bfloat16)
    i32 = lambda v: np.array(v, dtype=np.int32)  # noqa: E731
    buffers = encode_request(1, ExpertRequest(0, 1, x, i32([0]), i32([0]), i32([4]), i32([0, 1, 2, 5]), weights))
    gc.collect()
    torch.randn(64, 1024)  # reuse freed memory, if the float32 copy had been freed
    header = parse_request_header(joined(buffers)[: REQUEST.size])
    got = decode_request(header, joined(buffers)[REQUEST.size :])
    assert torch.equal(got.hidden_states, x) and torch.equal(got.entry_weights, weights.float())
    y = torch.randn(24, 5, generator=gen).t()  # not contiguous
    data = joined(encode_reply(3, ExpertReply(y)))
    assert torch.equal(decode_reply(parse_reply_header(data[: REPLY.size]), data[REPLY.size :]).outputs, y)
    with pytest.raises(ValueError, match="meta tensor cannot be framed"):
        encode_reply(4, ExpertReply(torch.empty(2, 3, device="meta")))


def test_reply_frames_carry_outputs_exactly_and_errors_with_their_status():
    y = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    data = joined(encode_reply(9, ExpertReply(y, compute_s=0.25)))
    header = parse_reply_header(data[: REPLY.size])
    reply = decode_reply(header, data[REPLY.size :])
    assert (header.sequence_id, header.status, reply.compute_s) == (9, 0, 0.25) and torch.equal(reply.outputs, y)
    data = joined(encode_error(10, grpc.StatusCode.FAILED_PRECONDITION, "placement 3 is not loaded"))
    header = parse_reply_header(data[: REPLY.size])
    assert (header.sequence_id, status_name(header)) == (10, "FAILED_PRECONDITION")
    assert bytes(data[REPLY.size :]).decode() == "placement 3 is not loaded"


def test_headers_that_do_not_parse_are_refused():
    good = joined(encode_request(1, random_request(torch.float32, 3, True)))[: REQUEST.size]
    with pytest.raises(FrameError, match="not a request frame"):
        parse_request_header(b"XXXX" + good[4:])
    with pytest.raises(FrameError, match="unknown dtype code 9"):
        parse_request_header(REQUEST.pack(REQUEST_MAGIC, 1, 0, 1, 9, 1, 0, 1, 8, 0, 0))
    with pytest.raises(FrameError, match="announces sizes"):
        parse_request_header(REQUEST.pack(REQUEST_MAGIC, 1, 0, 1, 1, 1, 0, -1, 8, 0, 0))
    with pytest.raises(FrameError, match="announces sizes"):  # more than a frame may carry
        parse_request_header(REQUEST.pack(REQUEST_MAGIC, 1, 0, 1, 1, 0, 0, 2**16, MAX_PAYLOAD_BYTES // 2**16, 0, 0))
    with pytest.raises(FrameError, match="not a reply frame"):
        parse_reply_header(good[: REPLY.size])


def test_a_drained_write_never_deadlocks_against_a_peer_writing_at_the_same_time():
    """Each side writes 16 MB before it reads (ping-pong: a second request while the first
    reply is being written); the kernel buffers hold far less, so without draining both block."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        b = FrameSocket(socket.create_connection(listener.getsockname()))
        a = FrameSocket(listener.accept()[0])
    size = 16 << 20
    payload_a, payload_b = np.full(size, 1, np.uint8), np.full(size, 2, np.uint8)
    got: dict = {}

    def side_b():  # the attention side: a plain write, then a read
        b.send([payload_b])
        got["b"] = b.read_exact(size)

    thread = threading.Thread(target=side_b, daemon=True)
    thread.start()
    a.send([payload_a], drain=True)  # the expert side: reads ahead while b's window is full
    got["a"] = a.read_exact(size)  # what it read ahead comes first
    thread.join(120)
    assert not thread.is_alive(), "the two writers deadlocked"
    assert bytes(got["a"]) == payload_b.tobytes() and bytes(got["b"]) == payload_a.tobytes()
    a.close()
    b.close()


def socket_pair(busy_poll_s: float) -> tuple[FrameSocket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        writer = socket.create_connection(listener.getsockname())
        reader = FrameSocket(listener.accept()[0], busy_poll_s)
    reader.sock.settimeout(60.0)
    return reader, writer


@pytest.mark.parametrize("late", [False, True])
def test_a_polling_read_takes_bytes_that_arrive_while_it_polls_and_blocks_for_the_rest_after(monkeypatch, late):
    """The first half is there at once, the second is written only once the reader is polling
    (it yielded the CPU); `late`: only after its 1 ms budget too, so the blocking read takes it."""
    from moemesh.expert.protocol import frame_socket

    reader, writer = socket_pair(busy_poll_s=0.001 if late else 60.0)
    polling, yields = threading.Event(), []

    def sched_yield():
        yields.append(1)
        polling.set()

    monkeypatch.setattr(frame_socket.os, "sched_yield", sched_yield)
    payload = np.arange(1 << 16, dtype=np.int32).tobytes()
    half = len(payload) // 2

    def write_rest():
        polling.wait(60)
        if late:
            time.sleep(0.05)
        writer.sendall(payload[half:])

    writer.sendall(payload[:half])
    thread = threading.Thread(target=write_rest, daemon=True)
    thread.start()
    got = reader.read_exact(len(payload))
    thread.join(60)
    assert bytes(got) == payload and yields
    assert reader.sock.gettimeout() == 60.0  # the poll put the timeout back
    writer.close()
    with pytest.raises(ConnectionError, match="closed"):  # a close seen while polling
        reader.read_exact(4)
    reader.close()


def test_a_polling_read_runs_keep_warm_while_it_waits_and_for_at_most_a_tenth_of_the_time():
    from moemesh.expert.protocol.frame_socket import WARM_DUTY

    reader, writer = socket_pair(busy_poll_s=60.0)
    writer.sendall(b"abcd")
    reader.keep_warm = lambda: pytest.fail("keep_warm ran for bytes already in")
    assert bytes(reader.read_exact(4)) == b"abcd"
    starts, ends = [], []

    def keep_warm():
        starts.append(time.perf_counter())
        time.sleep(0.005)
        ends.append(time.perf_counter())
        if len(starts) == 3:  # the frame comes once the reader has rehearsed three times
            threading.Thread(target=writer.sendall, args=(b"efgh",), daemon=True).start()

    reader.keep_warm = keep_warm
    assert bytes(reader.read_exact(4)) == b"efgh"
    assert len(starts) >= 3
    for end, start, took in zip(ends, starts[1:], np.subtract(ends, starts)):
        assert start - end >= took / WARM_DUTY  # the next rehearsal waits ten times what this one took
    failures = []

    def broken():
        failures.append(1)
        threading.Thread(target=writer.sendall, args=(b"ijkl",), daemon=True).start()
        raise RuntimeError("a bug in a rehearsal")

    reader.keep_warm = broken
    assert bytes(reader.read_exact(4)) == b"ijkl"  # the read goes on
    threading.Timer(0.05, writer.sendall, args=(b"mnop",)).start()
    assert bytes(reader.read_exact(4)) == b"mnop" and failures == [1]  # and no rehearsal runs again
    reader.close()
    writer.close()


def test_the_expert_side_rehearses_the_last_request_while_it_polls_and_answers_it_once():
    answered, rehearsed, twice = [], [], threading.Event()

    def answer(request: ExpertRequest, deliver) -> ExpertReply:
        answered.append(request.layer)
        reply = ExpertReply(2 * request.hidden_states)
        deliver(reply)
        return reply

    def rehearse(request: ExpertRequest) -> None:
        rehearsed.append(request)
        if len(rehearsed) >= 2:
            twice.set()
        raise CallError(grpc.StatusCode.FAILED_PRECONDITION, "placement released meanwhile")  # ignored

    plane = SocketDataPlane("127.0.0.1", 0, "expert-0", answer, busy_poll_s=60.0, rehearse=rehearse)
    try:
        connection = FrameSocket(socket.create_connection(("127.0.0.1", plane.open("s")), timeout=60))
        connection.send(encode_hello("s"))
        for sequence_id, layer in ((1, 3), (2, 5)):
            sent = dataclasses.replace(random_request(torch.float32, 4, True, seed=layer), layer=layer)
            connection.send(encode_request(sequence_id, sent))
            header = parse_reply_header(connection.read_exact(REPLY.size))
            reply = decode_reply(header, connection.read_exact(header.payload_bytes))
            assert header.sequence_id == sequence_id and torch.equal(reply.outputs, 2 * sent.hidden_states)
            assert twice.wait(60)  # rehearsals keep coming while the expert side waits
            last = rehearsed[-1]
            assert last.layer == layer and torch.equal(last.hidden_states, sent.hidden_states)
            assert last.row_ids.tolist() == sent.row_ids.tolist()
            twice.clear()
            rehearsed.clear()
        assert answered == [3, 5]  # each request computed once
        connection.close()
    finally:
        plane.close()


def test_a_peer_that_closes_after_the_poll_budget_is_an_error_not_a_short_read():
    reader, writer = socket_pair(busy_poll_s=0.001)
    writer.sendall(b"ab")
    threading.Timer(0.05, writer.close).start()
    with pytest.raises(ConnectionError):
        reader.read_exact(4)
    reader.close()


def test_the_expert_side_closes_connections_without_a_session_or_with_garbage_and_serves_the_rest():
    def answer(request: ExpertRequest, deliver) -> ExpertReply:
        if request.layer < 0:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, "bad layer")
        if request.layer == 7:  # a bug before the reply: answered INTERNAL
            raise RuntimeError("boom")
        reply = ExpertReply(request.hidden_states.float() + 1)
        deliver(reply)
        if request.layer == 8:  # a bug after the reply went out: no second frame for it
            raise RuntimeError("bookkeeping")
        return reply

    plane = SocketDataPlane("127.0.0.1", 0, "expert-0", answer)
    try:
        port = plane.open("s-good")
        plane.open("s-garbage")

        def connect(session: str | None) -> FrameSocket:
            connection = FrameSocket(socket.create_connection(("127.0.0.1", port), timeout=60))
            if session is not None:
                connection.send(encode_hello(session))
            return connection

        for session in ("never-opened", None):  # no hello: garbage where the hello should be
            stranger = connect(session)
            if session is None:
                stranger.send([b"GET / HTTP/1.1\r\n\r\n"])
            with pytest.raises(ConnectionError):
                stranger.read_exact(1)
            stranger.close()
        garbage = connect("s-garbage")
        garbage.send([b"\0" * REQUEST.size])
        with pytest.raises(ConnectionError):
            garbage.read_exact(1)
        garbage.close()
        good = connect("s-good")
        request = random_request(torch.bfloat16, 4, True)
        good.send(encode_request(1, ExpertRequest(-1, 1, request.hidden_states, *[np.zeros(0, np.int32)] * 4)))
        good.send(encode_request(2, request))
        for sequence_id, layer in ((3, 7), (4, 8), (5, 3)):
            good.send(encode_request(sequence_id, dataclasses.replace(request, layer=layer)))
        for sequence_id in (1, 2, 3, 4, 5):
            header = parse_reply_header(good.read_exact(REPLY.size))
            payload = good.read_exact(header.payload_bytes)
            assert header.sequence_id == sequence_id
            if sequence_id == 1:
                assert status_name(header) == "INVALID_ARGUMENT" and bytes(payload) == b"bad layer"
            elif sequence_id == 3:
                assert status_name(header) == "INTERNAL" and bytes(payload) == b"boom"
            else:
                assert torch.equal(decode_reply(header, payload).outputs, request.hidden_states.float() + 1)
        plane.close()  # stops reading: the open connection ends
        with pytest.raises(ConnectionError):
            good.read_exact(1)
        good.close()
        with pytest.raises(ValueError, match="stopping"):
            plane.open("late")
    finally:
        plane.close()
