"""ExpertWorker gRPC servicer: requests <-> replica compute.

`parse_call` checks an ExpertRequest (call.py) against a loaded version (layer range, tensor
shape, groups of slots this worker owns holding the named experts, row ids in range, entry
weights) and returns the compute inputs; `run_call` computes them: with entry weights the worker
combines its own experts (one float32 partial [num_tokens, hidden] back instead of one row per
entry; rounded to the activations' dtype here when the request says it is the sole partial).
`RunExperts` (unary), `RunExpertsStream` (one long-lived bidirectional call per attention
worker, requests matched to responses by sequence id) and the data planes that `OpenDataPlane`
opens (torch-dist groups, dist_server.py; raw-frame sockets, socket_server.py; their serving
threads call `answer_blocking`) share that path. The gRPC calls compute on one dedicated thread
(torch uses its intra-op threads inside it), so health checks and status calls stay responsive;
a data-plane connection computes on its own serving thread, one computation at a time with the
others (a lock). Each call in flight is counted per version (a version is released only when
none is).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from moemesh import kernels
from moemesh.expert.protocol.call import CallError, ExpertReply, ExpertRequest, reply_to_proto, request_from_proto
from moemesh.expert.protocol.wire import WireError
from moemesh.expert.server.replicas import HostedVersion, ReplicaStore
from moemesh.proto.v1 import expert_pb2, expert_pb2_grpc
from moemesh.runtime.metrics import ExpertMetrics


@dataclass(frozen=True)
class ParsedCall:
    hosted: HostedVersion
    layer: int
    x: torch.Tensor  # [num_tokens, hidden]
    row_ids: torch.Tensor  # [num_entries] int64
    group_local: np.ndarray  # [num_groups] local replica of each request group, in order
    group_rows: np.ndarray  # [num_groups] entries of each group
    weights: torch.Tensor | None  # [num_entries] float32 gate weights: combine here; None: one row per entry
    combined_dtype: torch.dtype = torch.float32  # of the combined outputs: float32, or x's (the sole partial)

    @property
    def groups(self) -> tuple[list[int], list[int]]:  # (local replica, entries) of each group, in order
        return self.group_local.tolist(), self.group_rows.tolist()

    @property
    def local(self) -> torch.Tensor:  # [num_entries] int64 local replica of each entry
        return torch.from_numpy(np.repeat(self.group_local, self.group_rows))

    @property
    def local_counts(self) -> np.ndarray:  # [num_local] entries per local replica
        counts = np.bincount(self.group_local, weights=self.group_rows, minlength=self.hosted.slots.size)
        return counts.astype(np.int64)


def _out_of(values: np.ndarray, low: int, high: int) -> bool:
    """Some value is outside [low, high)."""
    return bool(values.size) and (int(values.min()) < low or int(values.max()) >= high)


def parse_call(store: ReplicaStore, request: ExpertRequest) -> ParsedCall:
    """The compute inputs of a request, or CallError. This runs on the dispatch path of each MoE
    layer: the groups and row ids are checked in one C pass (kernels/csrc/moe_dispatch.c) where it is
    built; the numpy checks (`_check_groups`) name what is wrong, and are the path without it."""
    hosted = store.get(request.placement_version)
    if hosted is None:
        raise CallError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"placement version {request.placement_version} is not loaded on expert worker "
            f"{store.worker_id} (loaded: {store.versions()})",
        )
    shape = store.shape
    if not 0 <= request.layer < shape.num_layers:
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"layer {request.layer} is not in [0, {shape.num_layers})")
    x = request.hidden_states
    if x.dim() != 2 or x.shape[1] != shape.hidden_size:
        raise CallError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"hidden_states are {list(x.shape)}, expected [num_tokens, {shape.hidden_size}] (the model's hidden size)",
        )
    slots, experts, sizes = request.group_slots, request.group_experts, request.group_rows
    if not slots.size == experts.size == sizes.size:
        raise CallError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"group_slots, group_experts and group_rows must have one value per group, got "
            f"{slots.size}, {experts.size} and {sizes.size}",
        )
    # one C pass (None without the C library); what it finds wrong, the numpy checks below name
    phy2log, num_rows = hosted.placement.phy2log[request.layer], x.shape[0]
    checked = kernels.check_expert_groups(slots, experts, sizes, request.row_ids, num_rows, hosted.local_index, phy2log)
    if checked is None or isinstance(checked[0], str):
        checked = _check_groups(store, hosted, request)
    group_local, group_rows, row_ids = checked
    weights = request.entry_weights
    if weights is not None and (weights.dtype != torch.float32 or tuple(weights.shape) != (row_ids.size,)):
        raise CallError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"entry_weights must be float32 [{row_ids.size}], got {weights.dtype} {list(weights.shape)}",
        )
    combined_dtype = x.dtype if request.outputs_in_input_dtype else torch.float32
    return ParsedCall(
        hosted, request.layer, x, torch.from_numpy(row_ids), group_local, group_rows, weights, combined_dtype
    )


def _check_groups(store: ReplicaStore, hosted: HostedVersion, request: ExpertRequest):
    """(local replica of each group, entries per group, row ids), all int64; CallError naming what is wrong."""
    slots, experts, sizes, x = request.group_slots, request.group_experts, request.group_rows, request.hidden_states
    placement = hosted.placement
    if _out_of(slots, 0, placement.num_slots) or (sizes.size and int(sizes.min()) < 0):
        raise CallError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"groups name slots outside [0, {placement.num_slots}) or negative row counts",
        )
    local = hosted.local_index[slots]
    if _out_of(local, 0, hosted.slots.size):
        raise CallError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"slots {slots[local < 0].tolist()} are not expert worker {store.worker_id}'s in placement "
            f"{hosted.version}",
        )
    held = placement.phy2log[request.layer, slots]
    if not np.array_equal(held, experts):
        bad = int(np.flatnonzero(held != experts)[0])
        raise CallError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"slot {slots[bad]} holds expert {held[bad]} in layer {request.layer} of placement "
            f"{hosted.version}, not {experts[bad]}",
        )
    row_ids = request.row_ids
    num_entries = int(sizes.sum(dtype=np.int64))
    if row_ids.size != num_entries:
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"{row_ids.size} row ids for groups of {num_entries} rows")
    if _out_of(row_ids, 0, x.shape[0]):
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"row ids must be in [0, {x.shape[0]})")
    return local.astype(np.int64), sizes.astype(np.int64), row_ids.astype(np.int64)


def run_call(call: ParsedCall) -> ExpertReply:
    started = time.perf_counter()
    hosted = call.hosted
    combined = call.weights is not None
    if call.row_ids.numel() == 0:
        rows = call.x.shape[0] if combined else 0
        y = torch.zeros(rows, call.x.shape[1], dtype=call.combined_dtype if combined else call.x.dtype)
    else:
        w13 = hosted.w13[call.layer]  # computed in the weights' dtype, on their device
        x = call.x.to(device=w13.device, dtype=hosted.activation_dtype(call.layer, call.x.dtype))
        row_ids = call.row_ids.to(w13.device)
        if combined:  # [num_tokens, hidden] float32
            local = call.local.to(w13.device) if hosted.fp8_block is not None else None  # only the FP8 path reads it
            y = hosted.run_combined(call.layer, x, row_ids, local, call.weights.to(w13.device), call.groups)
            y = y.to(device="cpu", dtype=call.combined_dtype)  # float32, or the sole partial rounded once here
        else:  # [num_entries, hidden]
            y = hosted.run(call.layer, x, row_ids, call.local.to(w13.device)).to(device="cpu", dtype=call.x.dtype)
    return ExpertReply(y, time.perf_counter() - started)


def decode_request(message: expert_pb2.RunExpertsRequest) -> ExpertRequest:
    """A RunExpertsRequest's call; CallError INVALID_ARGUMENT for inconsistent tensors."""
    try:
        return request_from_proto(message)
    except WireError as e:
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


class ExpertServicer(expert_pb2_grpc.ExpertWorkerServicer):
    def __init__(
        self,
        store: ReplicaStore,
        status: Callable[[], expert_pb2.ExpertStatus],
        num_threads: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: ExpertMetrics | None = None,
    ):
        self.store = store
        self.metrics = metrics
        self._status = status
        self._clock = clock
        initializer = (lambda: torch.set_num_threads(num_threads)) if num_threads else None
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moemesh-expert", initializer=initializer)
        self.window_counts = np.zeros((store.shape.num_layers, store.shape.num_experts), dtype=np.int64)
        self.total_counts = np.zeros_like(self.window_counts)  # since start
        self.num_in_flight = 0
        self._counts_lock = threading.Lock()  # counters and in-flight: the event loop and torch-dist threads
        self._compute_lock = threading.Lock()  # one computation at a time, whichever thread runs it
        self.data_plane = None  # dist_server.DistDataPlane of the torch-dist transport, set by the worker
        self.socket_plane = None  # socket_server.SocketDataPlane of the socket transport, set by the worker
        self._closing = asyncio.Event()
        kernels.build_expert_dispatch_kernel()  # the request checks' C pass, built now rather than on the first request
        kernels.build_grouped_moe_kernel()  # and the CPU expert kernel

    async def RunExperts(self, request: expert_pb2.RunExpertsRequest, context: grpc.aio.ServicerContext):
        try:
            return await self._serve(request)
        except CallError as e:
            await context.abort(e.code, str(e))

    async def RunExpertsStream(self, requests, context: grpc.aio.ServicerContext):
        """One response per request, in order, with its sequence id; a refused request is answered
        with its error (the stream stays open for the next layer)."""
        if self._closing.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"expert worker {self.store.worker_id} is stopping")
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                await asyncio.wait({read, closing}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():  # stopping: end the stream between requests (the client reopens elsewhere)
                    read.cancel()
                    return
                request = read.result()
                if request is grpc.aio.EOF:
                    return
                await context.write(await self.answer(request))
        finally:
            closing.cancel()

    async def answer(self, request: expert_pb2.RunExpertsRequest) -> expert_pb2.RunExpertsResponse:
        """The reply of a RunExpertsStream request: a refused request is answered
        with its error code, and the reply carries the request's sequence id."""
        try:
            reply = await self._serve(request)
        except CallError as e:
            reply = expert_pb2.RunExpertsResponse(error_code=e.code.name, error=str(e))
        reply.sequence_id = request.sequence_id
        return reply

    async def OpenDataPlane(self, request: expert_pb2.OpenDataPlaneRequest, context: grpc.aio.ServicerContext):
        plane = self.socket_plane if request.backend == "socket" else self.data_plane
        if self._closing.is_set() or plane is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"expert worker {self.store.worker_id} is stopping")
        try:
            port = await asyncio.to_thread(plane.open, request.session, request.backend)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return expert_pb2.OpenDataPlaneResponse(store_port=port)

    def stop_streams(self) -> None:
        """Caller: the worker at shutdown, before `server.stop(grace)`: open streams end after their
        current request, so the grace period is not spent waiting on idle long-lived calls."""
        self._closing.set()

    async def _serve(self, message: expert_pb2.RunExpertsRequest) -> expert_pb2.RunExpertsResponse:
        """Raises CallError for a request this worker refuses."""
        started = time.perf_counter()
        call = self._begin(message)
        reply = None
        try:
            reply = await asyncio.get_running_loop().run_in_executor(self._compute, self._run, call)
            return reply_to_proto(reply)
        finally:
            self._finish(call, started, ok=reply is not None)

    def answer_blocking(
        self, request: ExpertRequest, deliver: Callable[[ExpertReply], None] | None = None
    ) -> ExpertReply:
        """The reply on the caller's thread (the torch-dist and socket data planes' serving
        threads): no hop to the event loop or the compute thread; computes one at a time with them
        (the compute lock). Raises CallError for a request this worker refuses. `deliver` (the
        data plane's send) gets the reply before its tokens are counted, so the counting runs while
        the reply travels; what it raises propagates (the tokens still count: they were computed)."""
        started = time.perf_counter()
        call = self._begin(request)
        reply = None
        try:
            reply = self._run(call)
            if deliver is not None:
                deliver(reply)
            return reply
        finally:
            self._finish(call, started, ok=reply is not None)

    def rehearse(self, request: ExpertRequest) -> None:
        """`parse_call` of a request already answered, nothing computed or counted: the socket data
        plane keeps the request path warm with it while it polls (frame_socket.py)."""
        parse_call(self.store, request)

    def _begin(self, request: ExpertRequest | expert_pb2.RunExpertsRequest) -> ParsedCall:
        try:
            if isinstance(request, expert_pb2.RunExpertsRequest):
                request = decode_request(request)
            call = parse_call(self.store, request)
        except CallError as e:
            if self.metrics is not None:
                self.metrics.call(e.code.name)
            raise
        with self._counts_lock:
            call.hosted.num_in_flight += 1
            self.num_in_flight += 1
        return call

    def _run(self, call: ParsedCall) -> ExpertReply:
        with self._compute_lock:
            return run_call(call)

    def _finish(self, call: ParsedCall, started: float, ok: bool) -> None:
        """The call left the worker; its tokens count when it computed (`ok`)."""
        hosted = call.hosted
        experts = hosted.placement.phy2log[call.layer, hosted.slots]  # [num_local]
        counts = call.local_counts if ok else None
        with self._counts_lock:
            hosted.num_in_flight -= 1
            self.num_in_flight -= 1
            hosted.last_call_at = self._clock()
            if not ok:
                return
            hosted.token_counts[call.layer] += counts
            np.add.at(self.window_counts[call.layer], experts, counts)
            np.add.at(self.total_counts[call.layer], experts, counts)
        if self.metrics is not None:
            self.metrics.call("OK", time.perf_counter() - started)

    async def GetStatus(self, request, context) -> expert_pb2.ExpertStatus:
        return self._status()

    def take_window(self) -> np.ndarray:
        """Counts since the last call ([num_layers, num_experts]), reset (the telemetry window)."""
        with self._counts_lock:
            counts, self.window_counts = self.window_counts, np.zeros_like(self.window_counts)
        return counts

    def close(self) -> None:
        self._compute.shutdown(wait=True)
