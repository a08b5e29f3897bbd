"""The router process: HTTP (uvicorn) and gRPC servers in one asyncio loop, plus the worker
pool's refresh task. Built once from RouterSettings; stops on SIGTERM / SIGINT (uvicorn's
handlers), then stops the gRPC server and closes the worker channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis
import uvicorn
from prometheus_client import start_http_server

from moemesh.contracts import redis_client, registry
from moemesh.contracts.block_hash import HashExtra
from moemesh.proto.v1 import generate_pb2, generate_pb2_grpc
from moemesh.router.api_keys import ApiKeys
from moemesh.router.dispatcher import Dispatcher
from moemesh.router.frontend import Frontend
from moemesh.router.grpc_api import GenerateServicer
from moemesh.router.http_api import build_app
from moemesh.router.policy import make_policy
from moemesh.router.settings import RouterSettings, RoutingSettings
from moemesh.router.token_ids_only import TokenIdsOnlyTokenizer
from moemesh.router.worker_pool import DECODE_ROLES, WorkerPool
from moemesh.runtime import telemetry
from moemesh.runtime.grpc_util import ChannelPool, HealthReporter, create_server
from moemesh.runtime.lifecycle import watch_parent
from moemesh.runtime.metrics import RouterMetrics
from moemesh.runtime.model_source_resolver import default_model_path
from moemesh.runtime.settings import served_model_name
from moemesh.text.model_text import open_model_text

logger = logging.getLogger(__name__)


def build_frontend(settings: RouterSettings, client: redis.Redis, channels: ChannelPool) -> tuple[Frontend, WorkerPool]:
    path = settings.model or default_model_path()
    checkpoint = open_model_text(path)  # config, tokenizer + chat template only; never the weights
    name = served_model_name(settings.served_model_name, path)
    max_len = settings.max_model_len or int(checkpoint.hf_config.get("max_position_embeddings") or 1 << 30)
    metrics = RouterMetrics(name)
    routing = settings.routing
    pool = WorkerPool(
        client,
        settings.mesh.mesh,
        make_policy(routing),
        make_policy(
            RoutingSettings("kv_aware" if routing.policy == "kv_aware" else "least_loaded", routing.prefill_weight, 0.0)
        ),
        settings.block_size,
        routing.disaggregated,
        settings.decode_endpoints,
        settings.prefill_endpoints,
        settings.refresh_interval_s,
        missing_grace_s=settings.mesh.heartbeat_ttl_s,
        self_id=settings.router_id,
    )
    extra = HashExtra(model_id=checkpoint.model_id, cache_salt=settings.cache_salt)
    tokenizer = checkpoint.tokenizer or TokenIdsOnlyTokenizer()  # no tokenizer.json: token-id prompts only
    dispatcher = Dispatcher(
        pool,
        channels,
        tokenizer,
        extra,
        metrics,
        first_token_timeout_s=settings.first_token_timeout_s,
        max_migrations=settings.max_migrations,
    )
    # the model's vocabulary (a checkpoint without a tokenizer still has its config's)
    vocab = int(
        checkpoint.hf_config.get("vocab_size") or (checkpoint.tokenizer.vocab_size if checkpoint.tokenizer else 0)
    )
    frontend = Frontend(
        dispatcher, tokenizer, name, max_len, vocab, metrics, settings.max_in_flight, settings.tool_call_parser
    )
    return frontend, pool


# An idle kept-alive HTTP connection stays open this long. Clients drop their idle connections
# sooner (httpx, and with it the openai client: 5 s; aiohttp: 15 s), so a client never sends a
# request on a connection the router is closing at that moment: uvicorn's default of 5 s equals
# httpx's, and a stream sent as the two expired together failed with a ReadError (1 of 2344
# requests in the chaos test). Longer than a cloud load balancer's idle timeout (60 s) too.
HTTP_KEEP_ALIVE_S = 75


def http_server_config(app, settings: RouterSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.http_port,
        log_level="warning",
        timeout_keep_alive=HTTP_KEEP_ALIVE_S,
        timeout_graceful_shutdown=max(1, round(settings.mesh.drain_s)),
    )


async def serve(settings: RouterSettings) -> None:
    client = redis_client.connect(settings.mesh.redis_url, settings.mesh.redis_password)
    channels = ChannelPool()
    frontend, pool = build_frontend(settings, client, channels)
    await pool.refresh()
    frontend.metrics.redis_up.set_function(lambda: 1.0 if pool.redis_ok else 0.0)
    refresh = asyncio.create_task(pool.run())
    grpc_server = None
    if settings.grpc_port is not None:
        health = HealthReporter([generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name])
        grpc_server, port = create_server(settings.host, settings.grpc_port, health)
        generate_pb2_grpc.add_GenerateServicer_to_server(
            GenerateServicer(frontend, ApiKeys(settings.guard.api_keys)), grpc_server
        )
        await grpc_server.start()
        await health.set_serving(True)
        logger.info("gRPC Generate API on %s:%d", settings.host, port)
    app = build_app(frontend, lambda: len(pool.live(DECODE_ROLES)), settings.guard)
    config = http_server_config(app, settings)
    logger.info(
        "OpenAI API for %r on http://%s:%d/v1 (policy %s, %s)",
        frontend.model_name,
        settings.host,
        settings.http_port,
        settings.routing.policy,
        "disaggregated" if settings.routing.disaggregated else "aggregated",
    )
    heartbeats = asyncio.create_task(_heartbeats(settings, client, frontend))
    metrics_server = None
    if settings.metrics_port is not None:  # the pod's declared `metrics` port (also /metrics on HTTP)
        metrics_server, _ = start_http_server(
            settings.metrics_port, addr=settings.host, registry=frontend.metrics.registry
        )
    server = uvicorn.Server(config)
    orphaned = asyncio.Event()
    watchdog = asyncio.create_task(watch_parent(settings.mesh.parent_pid, orphaned))
    orphaned_exit = asyncio.create_task(_exit_when(orphaned, server))
    try:
        await server.serve()
    finally:
        watchdog.cancel()
        orphaned_exit.cancel()
        heartbeats.cancel()
        with contextlib.suppress(redis.RedisError):
            await asyncio.to_thread(registry.deregister, client, settings.mesh.mesh, settings.router_id)
        refresh.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresh
        if grpc_server is not None:
            await grpc_server.stop(2)
        await channels.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        client.close()
        logger.info("router stopped")


async def _heartbeats(settings: RouterSettings, client: redis.Redis, frontend: Frontend) -> None:
    """The router's own registry record (role 'router'), for the operator's telemetry."""
    port = settings.grpc_port or settings.http_port
    while True:
        record = registry.WorkerRecord(
            worker_id=settings.router_id,
            role="router",
            endpoint=f"{settings.advertise_host}:{port}",
            model=frontend.model_name,
            num_running=frontend.in_flight,
        )
        with contextlib.suppress(redis.RedisError):
            await asyncio.to_thread(
                registry.heartbeat, client, settings.mesh.mesh, record, settings.mesh.heartbeat_ttl_s
            )
        await asyncio.sleep(settings.mesh.heartbeat_ttl_s / 3)


async def _exit_when(event: asyncio.Event, server: uvicorn.Server) -> None:
    await event.wait()
    server.should_exit = True


def main(settings: RouterSettings) -> int:
    telemetry.setup_tracing("moemesh-router", settings.mesh.trace_file, settings.mesh.otlp_endpoint)
    asyncio.run(serve(settings))
    return 0
