"""Remote experts on a prefill/decode worker: plug a RemoteExpertExecutor into the engine's
model and keep its placement and endpoints current.

Callers: the worker (`services/worker/main.py`) calls `install(engine, stop)` once the engine
is loaded (it waits for an active placement: none means the expert workers are not ready yet),
runs `watch()` as a task, and `close()`s at shutdown. `NoRemoteExperts` is the do-nothing
version for workers that run their experts locally.

`watch` polls `PlacementStore.current_version()` every `placement_poll_s` (and the registry for
expert worker endpoints); on a change it hands the new placement to the executor through
`AsyncEngine.call`, i.e. between two engine steps; the executor adopts it at the next forward's
first MoE layer.
"""

from __future__ import annotations

import asyncio
import logging

import redis

from moemesh.contracts import registry
from moemesh.contracts.placement import PlacementStore
from moemesh.engine.async_engine import AsyncEngine
from moemesh.engine.errors import ModelLoadError
from moemesh.expert.client.remote_executor import RemoteExpertExecutor, RemotePlacement
from moemesh.expert.settings import ExpertSettings
from moemesh.expert.transports.factory import make_transport

logger = logging.getLogger(__name__)


class NoRemoteExperts:
    """Experts stay in the worker's process."""

    async def install(self, engine: AsyncEngine, stop: asyncio.Event) -> None:
        return None

    async def watch(self) -> None:
        return None

    def close(self) -> None:
        return None


class RemoteExperts:
    def __init__(self, client: redis.Redis, mesh: str, settings: ExpertSettings, host: str = "127.0.0.1"):
        """`host`: the worker's advertised address (the torch-dist transport binds there)."""
        self.client, self.mesh, self.settings, self.host = client, mesh, settings, host
        self.store = PlacementStore(client, mesh)
        self.executor: RemoteExpertExecutor | None = None
        self._engine: AsyncEngine | None = None
        self._endpoints: dict[str, str] = {}

    async def install(self, engine: AsyncEngine, stop: asyncio.Event) -> None:
        """Wait for an active placement (or `stop`), then install the executor between steps."""
        model = engine.engine.model
        if not getattr(model, "moe_layer_ids", None):
            raise ModelLoadError(f"--remote-experts needs a Mixture-of-Experts model, not {model.cfg.architecture}")
        waited = False
        while not stop.is_set():
            placement = await asyncio.to_thread(self.store.current)
            if placement is not None:
                break
            if not waited:
                logger.info("remote experts: waiting for an active expert placement")
                waited = True
            await asyncio.sleep(self.settings.placement_poll_s)
        else:
            return
        remote = RemotePlacement(placement)
        num_layers, num_experts = len(model.moe_layer_ids), model.moe_layers()[0].gating.num_experts
        if (remote.num_layers, remote.num_experts) != (num_layers, num_experts):
            raise ModelLoadError(
                f"the active placement {placement.version} covers {remote.num_layers} MoE layers x "
                f"{remote.num_experts} experts; this model has {num_layers} x {num_experts}"
            )
        self._endpoints = await asyncio.to_thread(self._read_endpoints)
        transport = make_transport(
            self.settings.transport, self._endpoints, self.host, self.settings.dist_backend, self.settings.busy_poll_s
        )
        executor = RemoteExpertExecutor(
            transport, remote, self.settings.call_timeout_s, self.settings.retry_down_s, on_error="record"
        )
        await engine.call(lambda e: e.model.set_expert_executor(executor))
        self.executor, self._engine = executor, engine
        logger.info("remote experts: placement %d over %d expert workers", placement.version, len(remote.worker_ids))

    async def watch(self) -> None:
        warned = False
        while self.executor is not None:
            await asyncio.sleep(self.settings.placement_poll_s)
            try:
                await self._refresh()
            except redis.RedisError as e:
                if not warned:
                    logger.warning(
                        "remote experts: Redis unreachable (%s); keeping placement %d", e, self.executor.version
                    )
                    warned = True
            else:
                warned = False

    async def _refresh(self) -> None:
        executor = self.executor
        endpoints = await asyncio.to_thread(self._read_endpoints)
        if endpoints != self._endpoints:
            self._endpoints = endpoints
            await self._engine.call(lambda e: executor.set_endpoints(endpoints))
        version = await asyncio.to_thread(self.store.current_version)
        if version and version != executor.version:
            placement = await asyncio.to_thread(self.store.current)
            if placement is not None:
                await self._engine.call(lambda e: executor.set_placement(RemotePlacement(placement)))
                logger.info("remote experts: switching to placement %d", placement.version)

    def _read_endpoints(self) -> dict[str, str]:
        workers = registry.list_workers(self.client, self.mesh, role="expert")
        return {**self._endpoints, **{w.worker_id: w.endpoint for w in workers}}

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None
