"""Router settings (`moemesh serve --role router`): routing policy, ports, the tokenizer's model."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from moemesh.router.api_keys import ENV_VAR as API_KEY_ENV
from moemesh.router.api_keys import keys_from
from moemesh.router.http_guard import OPEN_PATHS, GuardSettings
from moemesh.router.tool_parsers import PARSER_NAMES
from moemesh.runtime import engine_args
from moemesh.runtime.settings import (
    MeshSettings,
    check,
    mesh_settings,
    metrics_port,
    model_path,
    pick,
    read_config_file,
)

POLICIES = ("round_robin", "least_loaded", "kv_aware")


@dataclass(frozen=True)
class RoutingSettings:
    """kv_aware cost = prefill_weight * prefill_blocks + decode_blocks + queue_weight * queued
    (see moemesh.router.policy)."""

    policy: str = "kv_aware"
    prefill_weight: float = 2.0
    queue_weight: float = 4.0
    disaggregated: bool = True  # False: aggregated (decode workers prefill locally)

    def __post_init__(self):
        check(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        check(self.prefill_weight >= 0 and self.queue_weight >= 0, "routing weights must be >= 0")


@dataclass(frozen=True)
class RouterSettings:
    router_id: str = "router"
    host: str = "0.0.0.0"
    advertise_host: str = "127.0.0.1"  # what the registry publishes
    http_port: int = 8000
    metrics_port: int | None = 9090  # Prometheus /metrics here too (it is also on the HTTP port); None: off
    grpc_port: int | None = 50051  # client Generate API; None: off
    model: str | None = None  # checkpoint for the tokenizer and chat template
    served_model_name: str | None = None  # None: the checkpoint file's name
    block_size: int = 16  # must equal the workers' block size (prefix hashing)
    cache_salt: str = ""  # must equal the workers' cache salt
    max_model_len: int | None = None  # None: the checkpoint's context length
    decode_endpoints: tuple[str, ...] = ()  # static workers, used with or without Redis
    prefill_endpoints: tuple[str, ...] = ()
    refresh_interval_s: float = 0.5  # registry poll
    max_in_flight: int = 1024  # more concurrent requests -> HTTP 429
    first_token_timeout_s: float = 120.0
    max_migrations: int = 3  # per request: resumptions on another decode worker after a mid-stream failure
    guard: GuardSettings = field(default_factory=GuardSettings)  # API keys, open paths, body limit
    tool_call_parser: str = "auto"  # how tool calls are read from replies (router/tool_parsers.py)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    mesh: MeshSettings = field(default_factory=MeshSettings)

    def __post_init__(self):
        check(self.max_migrations >= 0, f"max_migrations must be >= 0, got {self.max_migrations}")
        check(self.max_in_flight > 0, f"max_in_flight must be > 0, got {self.max_in_flight}")


def router_settings(args, env: Mapping[str, str] = os.environ) -> RouterSettings:
    config = read_config_file(args.config)
    ports = config.get("ports") or {}
    model = model_path(args, config)
    # the mesh-wide engine options the router must share with the workers (block size, cache salt,
    # context): flag > mesh.json engine section > default, as the workers resolve them
    engine = engine_args.resolve(args, config, "router", fixed={"model": model})
    return RouterSettings(
        router_id=args.worker_id or env.get("POD_NAME") or f"router-{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
        host=args.host or "0.0.0.0",
        advertise_host=args.advertise_host or env.get("POD_IP") or "127.0.0.1",
        http_port=pick(args.http_port, ports.get("http"), 8000),
        grpc_port=None if args.grpc_port == 0 else pick(args.grpc_port, ports.get("grpc"), 50051),
        metrics_port=metrics_port(args, config),
        model=model,
        served_model_name=args.served_model_name or (config.get("model") or {}).get("name"),
        block_size=engine.cache.block_size,
        cache_salt=engine.cache.cache_salt,
        max_model_len=engine.model.max_model_len,
        decode_endpoints=tuple(args.decode_endpoint),
        prefill_endpoints=tuple(args.prefill_endpoint),
        max_in_flight=args.max_in_flight,
        max_migrations=args.max_migrations,
        guard=GuardSettings(
            api_keys=keys_from(args.api_key, env.get(API_KEY_ENV)),
            open_paths=tuple(args.open_path) if args.open_path is not None else OPEN_PATHS,
            max_body_bytes=args.max_request_bytes,
        ),
        tool_call_parser=args.tool_call_parser,
        routing=RoutingSettings(
            policy=args.policy,
            prefill_weight=args.prefill_weight,
            queue_weight=args.queue_weight,
            disaggregated=not args.aggregated,
        ),
        mesh=mesh_settings(args, config, env),
    )


def add_router_arguments(parser) -> None:
    router = parser.add_argument_group("router")
    router.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (default 8000)")
    router.add_argument("--served-model-name", default=None)
    router.add_argument("--policy", default="kv_aware", choices=POLICIES)
    router.add_argument("--prefill-weight", type=float, default=RoutingSettings.prefill_weight)
    router.add_argument("--queue-weight", type=float, default=RoutingSettings.queue_weight)
    router.add_argument("--aggregated", action="store_true", help="decode workers prefill locally (no prefill workers)")
    router.add_argument("--decode-endpoint", action="append", default=[], help="static decode worker host:port")
    router.add_argument("--prefill-endpoint", action="append", default=[], help="static prefill worker host:port")
    router.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=PARSER_NAMES,
        help="format of the model's tool calls (auto: from its chat template)",
    )
    router.add_argument("--max-in-flight", type=int, default=1024)
    router.add_argument(
        "--max-migrations",
        type=int,
        default=RouterSettings.max_migrations,
        help="per request: how often a stream may move to another decode worker when its "
        "worker fails mid-stream (0: never)",
    )
    router.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"a key clients must send as 'Authorization: Bearer <key>' (repeat for several; also "
        f"${API_KEY_ENV}, comma-separated)",
    )
    router.add_argument(
        "--open-path",
        action="append",
        default=None,
        help=f"a path served without a key (repeat; default {' '.join(OPEN_PATHS)}; --open-path '' keeps none open)",
    )
    router.add_argument(
        "--max-request-bytes", type=int, default=GuardSettings.max_body_bytes, help="larger request bodies get 413"
    )
