"""An expert worker process: the replicas of its placement slots behind the ExpertWorker gRPC
service, registry heartbeats (role 'expert'), expert-load telemetry and the placement loop.

Start-up: `main()` reads the checkpoint's MoE shape (a non-MoE model is a start-up error); the
gRPC server starts NOT_SERVING and registers, so a launcher or the operator can publish a
placement naming it. The placement loop then polls Redis every `placement_poll_s`:
- a pending version (published, not active) naming this worker: load its replicas (only their
  weights are read; replicas already in memory are copied), then `mark_ready`;
- the active version: load it if missing (a restarted worker), turn SERVING once it is held;
- a version neither active nor pending: released once no call for it is in flight and none came
  for `release_grace_s` (dispatchers switch at their next step boundary; until then calls for
  the previous version keep being answered);
- no placement stored at all while one is active here: Redis lost its keys (a restart without
  persistence). The worker keeps serving the active version, as the dispatchers keep using it,
  until a placement is stored again (the local launcher restores that version).
Heartbeats carry the calls in flight and how many (layer, expert) weights the worker holds: 0 once
a worker that the active placement leaves out has released its replicas (the operator's
scale-down waits for that before the pod goes).
Telemetry: every `load_window_s` the (layer, logical expert) token counts of the window go to
Redis (`publish_expert_load`), the input of the operator's EPLB planner.
Shutdown (SIGTERM / SIGINT): NOT_SERVING, leave the registry and the load index, stop the server
with a grace period (in-flight calls finish), stop the compute thread.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis
import torch
from prometheus_client import start_http_server

from moemesh.contracts import redis_client, redis_keys, registry
from moemesh.contracts.expert_load_records import DEFAULT_TTL_S, publish_expert_load
from moemesh.contracts.placement import PlacementError, PlacementStore
from moemesh.engine.dtype import resolve_dtype
from moemesh.engine.errors import ModelLoadError
from moemesh.engine.loader import default_model_path, open_checkpoint
from moemesh.engine.loader.build import DTYPES
from moemesh.expert.server.dist_server import DistDataPlane
from moemesh.expert.server.replicas import ReplicaStore
from moemesh.expert.server.servicer import ExpertServicer
from moemesh.expert.server.socket_server import SocketDataPlane
from moemesh.expert.server.weights import MoEShape, read_expert_weights, read_moe_shape
from moemesh.expert.settings import ExpertWorkerSettings
from moemesh.proto.v1 import expert_pb2, expert_pb2_grpc
from moemesh.runtime import telemetry
from moemesh.runtime.grpc_util import HealthReporter, create_server
from moemesh.runtime.lifecycle import serve_until_signalled
from moemesh.runtime.metrics import ExpertMetrics
from moemesh.runtime.settings import served_model_name

logger = logging.getLogger(__name__)


class ExpertWorker:
    def __init__(self, settings: ExpertWorkerSettings, checkpoint, shape: MoEShape, clock=time.monotonic):
        self.settings, self.shape, self.clock = settings, shape, clock
        self.model_id = checkpoint.model_id
        device = settings.engine.device
        self.dtype_name = resolve_dtype(settings.engine.dtype, device)  # "auto" resolved as the engine does
        dtype = DTYPES[self.dtype_name]

        def read(wanted):
            weights = read_expert_weights(checkpoint, shape, wanted, dtype)
            return {key: tuple(t.to(device) for t in tensors) for key, tensors in weights.items()}

        self.replicas = ReplicaStore(settings.worker_id, shape, read)
        self.redis = redis_client.connect(settings.mesh.redis_url, settings.mesh.redis_password)
        self.placements = PlacementStore(self.redis, settings.mesh.mesh)
        model_name = served_model_name(settings.served_model_name, settings.engine.model or default_model_path())
        self.metrics = ExpertMetrics(
            model_name, settings.worker_id, lambda: (self.servicer.total_counts, self.active_version)
        )
        self.servicer = ExpertServicer(self.replicas, self._status, settings.engine.num_threads, clock, self.metrics)
        self.active_version = 0
        self._serving = False
        self._marked: set[int] = set()  # versions marked ready
        self._rejected: set[int] = set()  # versions that do not fit the model
        self._retired_at: dict[int, float] = {}  # version -> when it stopped being active / pending
        self._placement_lost = False  # Redis holds no placement while one is active here
        self._redis_ok = True

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        self.health = HealthReporter([expert_pb2.DESCRIPTOR.services_by_name["ExpertWorker"].full_name])
        server, port = create_server(s.host, s.grpc_port, self.health)
        expert_pb2_grpc.add_ExpertWorkerServicer_to_server(self.servicer, server)
        self.servicer.data_plane = DistDataPlane(s.advertise_host, s.worker_id, self.servicer.answer_blocking)
        self.servicer.socket_plane = SocketDataPlane(
            s.host,
            s.data_port,
            s.worker_id,
            self.servicer.answer_blocking,
            s.expert.busy_poll_s,
            self.servicer.rehearse,
        )
        await self.health.set_serving(False)
        await server.start()
        metrics_server = None
        if s.metrics_port is not None:
            metrics_server, _ = start_http_server(s.metrics_port, addr=s.host, registry=self.metrics.registry)
        logger.info(
            "expert worker %s listening on %s:%d (%s, %d MoE layers x %d experts)",
            s.worker_id,
            s.host,
            port,
            self.shape.architecture,
            self.shape.num_layers,
            self.shape.num_experts,
        )
        tasks = [
            asyncio.create_task(self._every(s.mesh.heartbeat_ttl_s / 3, self._heartbeat)),
            asyncio.create_task(self._every(s.expert.placement_poll_s, self._sync_placement)),
            asyncio.create_task(self._every(s.expert.load_window_s, self._publish_load, first_delay=True)),
        ]
        try:
            await stop.wait()
        finally:
            await self._shutdown(server, tasks)
            if metrics_server is not None:
                metrics_server.shutdown()

    # -- placement -------------------------------------------------------------------------
    async def _sync_placement(self) -> None:
        store = self.placements
        current, latest = await asyncio.to_thread(lambda: (store.current_version(), store.latest_version()))
        if not latest and self.active_version:  # nothing stored (current <= latest): Redis lost it
            if not self._placement_lost:
                logger.warning(
                    "no placement in Redis (restarted?); serving placement %d until one is stored", self.active_version
                )
                self._placement_lost = True
            return
        self._placement_lost = False
        for version in sorted({current, latest} - {0}):  # latest >= current always
            if self.replicas.get(version) is None and version not in self._rejected:
                placement = await asyncio.to_thread(store.get, version)
                if placement is None:
                    continue
                try:
                    started = time.perf_counter()
                    hosted = await asyncio.to_thread(self.replicas.load, placement)
                except (PlacementError, ModelLoadError) as e:
                    logger.error("placement %d rejected: %s", version, e)
                    self._rejected.add(version)
                    continue
                logger.info(
                    "placement %d: loaded %d replicas in %.2f s",
                    version,
                    hosted.slots.size,
                    time.perf_counter() - started,
                )
            hosted = self.replicas.get(version)
            if version > current and hosted is not None and version not in self._marked:
                if self.settings.worker_id in hosted.placement.worker_ids:
                    await asyncio.to_thread(store.mark_ready, self.settings.worker_id, version)
                self._marked.add(version)
        if current and self.replicas.get(current) is not None and current != self.active_version:
            logger.info("placement %d is active", current)
            self.active_version = current
        serving = bool(current) and self.replicas.get(current) is not None
        if serving != self._serving:
            await self.health.set_serving(serving)
            self._serving = serving
        self._release({current, latest if latest > current else current})

    def _release(self, keep: set[int]) -> None:
        now = self.clock()
        for version in self.replicas.versions():
            if version in keep:
                self._retired_at.pop(version, None)
                continue
            retired = self._retired_at.setdefault(version, now)
            hosted = self.replicas.get(version)
            quiet_since = max(retired, hosted.last_call_at)
            if hosted.num_in_flight == 0 and now - quiet_since >= self.settings.expert.release_grace_s:
                self.replicas.release(version)
                self._retired_at.pop(version, None)
                logger.info("placement %d: replicas released", version)

    # -- registry and telemetry ------------------------------------------------------------
    async def _heartbeat(self) -> None:
        s = self.settings
        record = registry.WorkerRecord(
            worker_id=s.worker_id,
            role="expert",
            endpoint=s.endpoint,
            model=self.model_id,
            num_running=self.servicer.num_in_flight,
            num_experts_held=len(self.replicas.hosted_experts()),
        )
        await asyncio.to_thread(registry.heartbeat, self.redis, s.mesh.mesh, record, s.mesh.heartbeat_ttl_s)

    async def _publish_load(self) -> None:
        s = self.settings
        counts = self.servicer.take_window()
        ttl = max(DEFAULT_TTL_S, 3 * s.expert.load_window_s)
        await asyncio.to_thread(
            publish_expert_load, self.redis, s.mesh.mesh, s.worker_id, counts, s.expert.load_window_s, ttl
        )

    async def _every(self, interval_s: float, fn, first_delay: bool = False) -> None:
        if first_delay:
            await asyncio.sleep(interval_s)
        while True:
            try:
                await fn()
            except redis.RedisError as e:
                if self._redis_ok:
                    logger.warning("Redis unreachable (%s); serving on with the placement held", e)
                    self._redis_ok = False
            else:
                self._redis_ok = True
            await asyncio.sleep(interval_s)

    def _status(self) -> expert_pb2.ExpertStatus:
        status = expert_pb2.ExpertStatus(
            worker_id=self.settings.worker_id,
            model_id=self.model_id,
            dtype=self.dtype_name,
            num_moe_layers=self.shape.num_layers,
            num_experts=self.shape.num_experts,
            serving=self._serving,
            active_version=self.active_version,
            loaded_versions=self.replicas.versions(),
            num_in_flight=self.servicer.num_in_flight,
            expert_tokens=self.servicer.total_counts.reshape(-1).tolist(),
        )
        for version in self.replicas.versions():
            hosted = self.replicas.get(version)
            for layer in range(hosted.token_counts.shape[0]):
                for i, slot in enumerate(hosted.slots):
                    status.replicas.add(
                        version=version,
                        layer=layer,
                        slot=int(slot),
                        expert=int(hosted.placement.phy2log[layer, slot]),
                        num_tokens=int(hosted.token_counts[layer, i]),
                    )
        for layer, expert in sorted(self.replicas.hosted_experts()):
            status.hosted_experts.add(layer=layer, expert=expert)
        return status

    # -- shutdown --------------------------------------------------------------------------
    async def _shutdown(self, server, tasks) -> None:
        s = self.settings
        logger.info("expert worker %s stopping", s.worker_id)
        await self.health.set_serving(False)
        for task in tasks:
            task.cancel()
        mesh = s.mesh.mesh
        try:
            await asyncio.to_thread(registry.deregister, self.redis, mesh, s.worker_id)
            await asyncio.to_thread(
                redis_keys.drop_expiring,
                self.redis,
                redis_keys.expert_load_index_key(mesh),
                s.worker_id,
                redis_keys.expert_load_key(mesh, s.worker_id),
            )
        except redis.RedisError:
            pass
        self.servicer.stop_streams()
        self.servicer.data_plane.close()
        self.servicer.socket_plane.close()
        await server.stop(s.mesh.drain_s)  # in-flight calls finish (then are cancelled)
        await self.health.shutdown()
        self.servicer.close()
        self.redis.close()
        logger.info("expert worker %s stopped", s.worker_id)


def main(settings: ExpertWorkerSettings) -> int:
    """Run an expert worker until SIGTERM / SIGINT; returns the exit status. A checkpoint that
    is missing or not a MoE model raises ModelLoadError (the CLI exits with status 2)."""
    telemetry.setup_tracing("moemesh-expert", settings.mesh.trace_file, settings.mesh.otlp_endpoint)
    checkpoint = open_checkpoint(settings.engine.model or default_model_path())
    shape = read_moe_shape(checkpoint)
    if settings.engine.num_threads:
        torch.set_num_threads(settings.engine.num_threads)

    return serve_until_signalled(ExpertWorker(settings, checkpoint, shape).run, settings.mesh.parent_pid)
