"""An LLMEngine driven by its own thread, for asyncio callers (the worker servicers).

The engine thread is the only one that touches the LLMEngine. It loops: run the submitted
commands, `step()` while there is work, then hand every event to the asyncio loop in one
`call_soon_threadsafe`. Callers (in the loop):
- `generate(...)` adds a request and yields its events: a `RequestDelta` per step (what it
  added), up to the finished one, and the KV connector's events (`KVConnectorEvent`: a load
  started or finished, KV handed out, ...), each step's before its delta. Leaving the iteration
  early (cancellation, client gone, `aclose()`) aborts the request and frees its blocks.
- `call(fn)` runs `fn(engine)` between steps and returns its result (or raises its error).
- `stats` is the latest `LLMEngine.stats()`, refreshed after every step, read without locking.
- `kv_event_sink(events)` (optional) is called in the loop with each step's prefix-cache
  changes (`KVEvents`), for the prefix-index publisher.
The engine's KV connector is bound to the loop once the engine is built (`KVConnector.bind`): it may
run its I/O there, and wakes the engine thread when a transfer ends.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from moemesh.engine.connectors.base import KVConnectorEvent, KVTransferParams
from moemesh.engine.errors import InvalidRequestError
from moemesh.engine.llm_engine import LLMEngine
from moemesh.engine.outputs import RequestDelta
from moemesh.engine.sampling_params import SamplingParams
from moemesh.engine.step_failure import fail_unfinished_requests, take_expert_error

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


EngineEvent = RequestDelta | KVConnectorEvent


@dataclass(frozen=True)
class RequestFailed:
    """The request was failed by the engine thread (e.g. its experts are unreachable)."""

    request_id: str
    error: Exception


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a crash); no more requests are served."""


class AsyncEngine:
    def __init__(
        self,
        build_engine: Callable[[], LLMEngine],
        loop: asyncio.AbstractEventLoop,
        num_threads: int | None = None,
        kv_event_sink: Callable[[Any], None] | None = None,
    ):
        self._build_engine = build_engine
        self._loop = loop
        self._num_threads = num_threads
        self._kv_event_sink = kv_event_sink
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._ready: asyncio.Future = loop.create_future()
        self._crashed: asyncio.Future = loop.create_future()  # the error that ended the engine thread
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.engine: LLMEngine | None = None  # set once loaded; only the engine thread uses it
        self.stats: dict = {}

    # -- lifecycle (loop side) -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    async def wait_ready(self) -> None:
        """Returns once the model is loaded; raises the load error if loading failed."""
        await asyncio.shield(self._ready)

    async def wait_crashed(self) -> BaseException:
        """Returns (never raises) the error that ended the engine thread after it was ready; waits
        forever while it runs or after a `stop()`. A worker whose engine crashed serves nothing
        more, so it exits for its supervisor to restart it."""
        return await asyncio.shield(self._crashed)

    @property
    def is_ready(self) -> bool:
        return self._ready.done() and self._ready.exception() is None

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, timeout_s)

    # -- requests (loop side) --------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        if self._stopping.is_set() or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        future = self._loop.create_future()
        self._commands.put((fn, future))
        return await future

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        kv_transfer_params: KVTransferParams | None = None,
        resume_token_ids: list[int] = (),
    ) -> AsyncIterator[EngineEvent]:
        events: asyncio.Queue = asyncio.Queue()
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self._queues[request_id] = events
        done = False
        try:
            await self.call(
                lambda e: e.add_request(
                    prompt_token_ids,
                    params,
                    request_id,
                    kv_transfer_params=kv_transfer_params,
                    detokenize=False,
                    resume_token_ids=resume_token_ids,
                )
            )
            while not done:
                event = await events.get()
                if isinstance(event, EngineDeadError):
                    raise event
                if isinstance(event, RequestFailed):
                    done = True
                    raise event.error
                done = isinstance(event, RequestDelta) and event.finished
                yield event
        finally:
            self._queues.pop(request_id, None)
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request in any state (no-op if unknown or finished); does not wait."""
        if self._thread.is_alive():
            self._commands.put((lambda e: self._dispatch_now(e.abort_request([request_id])), None))

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        try:
            self.engine = self._build_engine()
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits for readiness
            logger.exception("engine failed to load")
            self._loop.call_soon_threadsafe(_set_exception, self._ready, e)
            return
        self.engine.kv_connector.bind(self._loop, self._wake)
        self.stats = self.engine.stats()
        self._loop.call_soon_threadsafe(_set_result, self._ready, None)
        try:
            while not self._stopping.is_set():
                self._loop_once(self.engine)
        except BaseException as e:
            logger.exception("engine thread crashed")
            self._loop.call_soon_threadsafe(_set_result, self._crashed, e)
            raise
        finally:
            self._stopping.set()
            self.engine.shutdown()
            self._loop.call_soon_threadsafe(self._fail_all)

    def _loop_once(self, engine: LLMEngine) -> None:
        idle = not engine.has_steppable_work
        self._run_commands(engine, block=idle)
        events: list = []
        if engine.has_steppable_work:
            outputs = engine.step()
            error = take_expert_error(engine)
            if error is not None:  # remote experts failed: see step_failure.py
                failed = {o.request_id for o in outputs} | set(fail_unfinished_requests(engine))
                logger.error("step failed, %d requests failed: %s", len(failed), error)
                events.extend(RequestFailed(request_id, error) for request_id in sorted(failed))
                outputs = []
            # after a failure (a failed request reads no further); before the outputs: a load's end
            # precedes the first token it brought, KV handed out precedes its request's last delta
            events.extend(engine.take_connector_events())
            events.extend(outputs)
        kv_events = engine.kv_cache_manager.drain_events()
        self.stats = engine.stats()
        if events or kv_events:
            self._loop.call_soon_threadsafe(self._dispatch, events, kv_events)

    def _run_commands(self, engine: LLMEngine, block: bool) -> None:
        try:
            item = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            try:
                result = fn(engine)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                if future is None:
                    logger.exception("engine command failed")
                else:
                    self._loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                if future is not None:
                    self._loop.call_soon_threadsafe(_set_result, future, result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
        self._stopping.set()  # None: stop

    def _wake(self) -> None:
        """Thread-safe: end the engine thread's idle wait (a connector's transfer ended)."""
        self._commands.put((_nothing, None))

    def _dispatch_now(self, outputs: list[RequestDelta]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs, None)

    # -- back in the loop ------------------------------------------------------------------
    def _dispatch(self, events: list, kv_events) -> None:
        for event in events:
            target = self._queues.get(event.request_id)
            if target is not None:
                target.put_nowait(event)
        if kv_events and self._kv_event_sink is not None:
            self._kv_event_sink(kv_events)

    def _fail_all(self) -> None:
        for target in self._queues.values():
            target.put_nowait(EngineDeadError("the engine stopped"))


def _nothing(engine: LLMEngine) -> None:
    return None


def _set_result(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
