"""A prefill / decode / both worker process: one engine, its gRPC servicers, health, metrics,
registry heartbeats and prefix-index events.

Start-up: the gRPC server starts at once with health NOT_SERVING and refuses the worker's own
calls with UNAVAILABLE (`AdmissionGate`); the engine loads in its own thread (with remote experts,
the executor is installed once a placement is active); then the worker resyncs its (empty)
prefix-index entry, opens the gate, heartbeats into the registry and turns SERVING. Shutdown
(SIGTERM / SIGINT): refuse new Generate / Prefill calls (UNAVAILABLE: a router whose view still
lists this worker retries elsewhere), NOT_SERVING, leave the registry and the index (so routers
stop choosing it), stop the server with a grace period (in-flight requests finish or are
cancelled, which aborts them and frees their blocks), stop the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import redis
from prometheus_client import start_http_server

from moemesh.contracts import redis_client, registry
from moemesh.contracts.prefix_index import PrefixIndex
from moemesh.engine.async_engine import AsyncEngine
from moemesh.engine.connectors.base import KVConnector
from moemesh.engine.connectors.kv_transfer import NullKVTransport
from moemesh.engine.connectors.remote_prefill import RemotePrefillConnector
from moemesh.expert.client.attach import NoRemoteExperts, RemoteExperts
from moemesh.proto.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from moemesh.runtime import telemetry
from moemesh.runtime.engine_config import EngineConfig, with_default_model
from moemesh.runtime.grpc_util import AdmissionGate, ChannelPool, HealthReporter, create_server
from moemesh.runtime.lifecycle import serve_until_signalled
from moemesh.runtime.metrics import WorkerMetrics
from moemesh.runtime.model_source_resolver import default_model_path
from moemesh.runtime.settings import served_model_name
from moemesh.worker.decode_servicer import DecodeServicer
from moemesh.worker.kv_client import GrpcKVTransport
from moemesh.worker.prefill_servicer import PrefillServicer
from moemesh.worker.prefix_publisher import PrefixIndexPublisher
from moemesh.worker.settings import EngineSettings, WorkerSettings

logger = logging.getLogger(__name__)


def engine_config(settings: EngineSettings, remote_experts: bool = False) -> EngineConfig:
    """The worker engine's EngineConfig: its settings' (validated when they were resolved), the
    model unset: the default model. With `remote_experts` the routed experts' weights are not
    loaded (expert workers hold them)."""
    config = with_default_model(settings.config)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, load_routed_experts=not remote_experts))


def build_engine(settings: EngineSettings, remote_experts: bool = False, kv_connector: KVConnector | None = None):
    from moemesh.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config(settings, remote_experts), show_progress=False, kv_connector=kv_connector)


class Worker:
    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        self.publisher: PrefixIndexPublisher | None = None
        self.channels = ChannelPool()
        self.redis = redis_client.connect(settings.mesh.redis_url, settings.mesh.redis_password)
        self._redis_ok = True
        self._tasks: list[asyncio.Task] = []
        self.experts = (
            RemoteExperts(self.redis, settings.mesh.mesh, settings.expert, settings.advertise_host)
            if settings.expert.remote
            else NoRemoteExperts()
        )

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until `stop` is set (returns 0) or the engine thread crashes (returns 1)."""
        s = self.settings
        loop = asyncio.get_running_loop()
        self.engine = AsyncEngine(
            lambda: build_engine(s.engine, s.expert.remote, self.kv_connector),
            loop,
            s.engine.num_threads,
            self._on_kv_events,
        )
        model_name = served_model_name(s.served_model_name, s.engine.model or default_model_path())
        self.metrics = WorkerMetrics(model_name, s.worker_id, lambda: self.engine.stats)
        self.kv_connector = self._kv_connector()  # before the engine thread builds the engine with it
        names, new_work = [], []
        if s.role in ("decode", "both"):
            names.append(decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name)
            new_work.append(f"/{names[-1]}/Generate")
        if s.role in ("prefill", "both"):
            names.append(prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name)
            new_work.append(f"/{names[-1]}/Prefill")
        self.health = HealthReporter(names)
        self.gate = AdmissionGate(f"worker {s.worker_id}", tuple(new_work))
        server, port = create_server(s.host, s.grpc_port, self.health, (self.gate,))
        self._add_servicers(server)
        await self.health.set_serving(False)
        await server.start()
        metrics_server = None
        if s.metrics_port is not None:
            metrics_server, _ = start_http_server(s.metrics_port, addr=s.host, registry=self.metrics.registry)
        logger.info("worker %s (%s) listening on %s:%d; loading the model", s.worker_id, s.role, s.host, port)
        self.engine.start()
        try:
            await _first(self.engine.wait_ready(), stop.wait())
            if stop.is_set():
                return 0
            await self.experts.install(self.engine, stop)  # remote experts: waits for an active placement
            if stop.is_set():
                return 0
            engine = self.engine.engine
            self.publisher = PrefixIndexPublisher(
                PrefixIndex(self.redis, s.mesh.mesh),
                s.worker_id,
                engine.budget.block_size,
                engine.model_id,
                snapshot=lambda: self.engine.call(lambda e: e.kv_cache_manager.cached_block_hashes()),
                ttl_s=s.mesh.heartbeat_ttl_s,
            )
            self._tasks = [
                asyncio.create_task(self.publisher.run()),
                asyncio.create_task(self._heartbeats()),
                asyncio.create_task(self.experts.watch()),
            ]
            await self.publisher.flush()
            self.gate.open()  # before the heartbeat: routers may pick it from then on
            await self._heartbeat_once()
            await self.health.set_serving(True)
            logger.info("worker %s serving on %s", s.worker_id, s.endpoint)
            await _first(stop.wait(), self.engine.wait_crashed())
            if not stop.is_set():  # serving nothing more: exit non-zero, to be restarted
                logger.error("worker %s: the engine thread crashed; exiting with status 1", s.worker_id)
                return 1
        finally:
            await self._shutdown(server, metrics_server)
        return 0

    def _kv_connector(self) -> RemotePrefillConnector:
        """P/D: a decode end ('decode', 'both') fetches remote KV over gRPC; a prefill end hands
        its KV out through its servicer ('both' does both, also for itself)."""
        s = self.settings
        transport = GrpcKVTransport(self.channels) if s.role in ("decode", "both") else NullKVTransport()
        return RemotePrefillConnector(
            transport, self.metrics, s.kv_transfer_timeout_s, s.kv_transfer_timeout_per_token_s
        )

    def _add_servicers(self, server) -> None:
        s = self.settings
        if s.role in ("decode", "both"):
            decode = DecodeServicer(
                self.engine, s.worker_id, s.role, self.metrics, s.min_remote_prefill_tokens, s.max_queued_requests
            )
            decode_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, server)
        if s.role in ("prefill", "both"):
            prefill = PrefillServicer(
                self.engine, self.kv_connector, s.worker_id, s.role, self.metrics, s.kv_chunk_bytes
            )
            prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, server)

    def _on_kv_events(self, events) -> None:
        if self.publisher is not None:
            self.publisher.add(events)

    # -- registry --------------------------------------------------------------------------
    def _record(self) -> registry.WorkerRecord:
        stats, s = self.engine.stats, self.settings
        return registry.WorkerRecord(
            worker_id=s.worker_id,
            role=s.role,
            endpoint=s.endpoint,
            model=self.engine.engine.model_id,
            num_queued=stats.get("num_waiting", 0) + stats.get("num_waiting_for_kv", 0),
            num_running=stats.get("num_running", 0),
            kv_usage=min(1.0, stats.get("kv_usage", 0.0)),
            num_blocks_total=stats.get("num_blocks_total", 0),
            num_blocks_used=stats.get("num_blocks_used", 0),
            ttft_p90_s=self.metrics.ttft_window.quantile(0.9),
            itl_p90_s=self.metrics.itl_window.quantile(0.9),
        )

    async def _heartbeat_once(self) -> None:
        ttl = self.settings.mesh.heartbeat_ttl_s
        try:
            await asyncio.to_thread(registry.heartbeat, self.redis, self.settings.mesh.mesh, self._record(), ttl)
            await asyncio.to_thread(PrefixIndex(self.redis, self.settings.mesh.mesh).reap_expired)
        except redis.RedisError as e:
            if self._redis_ok:
                logger.warning("registry: Redis unreachable (%s); serving on, heartbeats resume when it returns", e)
                self._redis_ok = False
        else:
            if not self._redis_ok:
                logger.info("registry: Redis is back")
                self._redis_ok = True
        if self.publisher is not None:
            await self.publisher.heartbeat()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.mesh.heartbeat_ttl_s / 3)
            await self._heartbeat_once()

    # -- shutdown --------------------------------------------------------------------------
    async def _shutdown(self, server, metrics_server) -> None:
        s = self.settings
        logger.info("worker %s stopping", s.worker_id)
        self.gate.drain()  # first: until it leaves the registry, routers may still pick it
        await self.health.set_serving(False)
        for task in self._tasks:
            task.cancel()
        try:
            await asyncio.to_thread(registry.deregister, self.redis, s.mesh.mesh, s.worker_id)
        except redis.RedisError:
            pass
        if self.publisher is not None:
            await self.publisher.close()
        await server.stop(s.mesh.drain_s)  # in-flight calls finish (then are cancelled)
        await self.health.shutdown()
        await self.engine.stop()
        self.experts.close()
        await self.channels.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        self.redis.close()
        logger.info("worker %s stopped", s.worker_id)


async def _first(*aws) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in done:
        task.result()


def main(settings: WorkerSettings) -> int:
    """Run a worker until SIGTERM / SIGINT; returns the exit status."""
    telemetry.setup_tracing(f"moemesh-{settings.role}", settings.mesh.trace_file, settings.mesh.otlp_endpoint)

    return serve_until_signalled(Worker(settings).run, settings.mesh.parent_pid)
