"""Service settings: typed, frozen, built once in `main()` from the mesh config file, the command
line and the environment. Nothing else in the services reads the environment.

Precedence: command-line flag > mesh config file (`--config`, the operator's ConfigMap
`mesh.json`: mesh, model {name, source}, redis_url, ports {grpc, http, metrics}) > default.
Environment (Kubernetes downward API / Secret): POD_NAME (worker id), POD_IP (advertised host),
MOEMESH_REDIS_PASSWORD, OTEL_EXPORTER_OTLP_ENDPOINT (the OTLP collector, if no flag names one).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded", "kv_aware")
WORKER_ROLES = ("prefill", "decode", "both", "expert")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
SPECULATIVE_SCHEDULING = ("fixed", "confidence")


class SettingsError(ValueError):
    """A setting is missing or out of range (the CLI prints it and exits with status 2)."""


@dataclass(frozen=True)
class MeshSettings:
    """Where the shared state lives and how often workers refresh it."""

    mesh: str = "local"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: str | None = None
    heartbeat_ttl_s: float = 15.0  # registry + prefix-index TTL; heartbeats every ttl / 3
    trace_file: str | None = None  # append finished spans as JSON lines (None: no export)
    otlp_endpoint: str | None = None  # export spans over OTLP/gRPC to this collector (host:port)
    parent_pid: int | None = None  # stop when this process (a launcher) is gone

    def __post_init__(self):
        _check(bool(self.mesh) and " " not in self.mesh, f"mesh must be a non-empty id, got {self.mesh!r}")
        _check(self.heartbeat_ttl_s > 0, f"heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")


@dataclass(frozen=True)
class SpeculationSettings:
    """Speculative decoding of a decode worker or `moemesh generate` (see SpecConfig)."""

    method: str = "none"
    num_speculative_tokens: int = 4
    scheduling: str = "confidence"
    draft_model: str | None = None  # GGUF / HF dir sharing the target's tokenizer (method draft)

    def __post_init__(self):
        method, draft = self.method, self.draft_model
        _check(method in SPECULATIVE_METHODS,
               f"--speculative-method must be one of {SPECULATIVE_METHODS}, got {method!r}")  # fmt: skip
        scheduling = self.scheduling
        _check(scheduling in SPECULATIVE_SCHEDULING,
               f"--speculative-scheduling must be one of {SPECULATIVE_SCHEDULING}, got {scheduling!r}")  # fmt: skip
        k = self.num_speculative_tokens
        _check(1 <= k <= 16, f"--num-speculative-tokens must be in [1, 16], got {k}")
        if method == "draft":
            _check(bool(draft), "--speculative-method draft needs --draft-model PATH (a GGUF file or HF directory)")
            _check(os.path.exists(draft), f"--draft-model {draft!r} does not exist")
        else:
            _check(not draft, f"--draft-model is only used with --speculative-method draft, not {method!r}")

    def spec_config(self):
        """The engine's SpecConfig for these settings."""
        from moemesh.engine.config import SpecConfig

        return SpecConfig(method=self.method, num_speculative_tokens=self.num_speculative_tokens,
                          scheduling=self.scheduling, draft_model=self.draft_model)  # fmt: skip


def speculation_settings(args) -> SpeculationSettings:
    return SpeculationSettings(
        method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        scheduling=args.speculative_scheduling,
        draft_model=args.draft_model,
    )


def add_speculation_arguments(parser) -> None:
    """`--speculative-*` and `--draft-model` (moemesh generate, decode / both workers)."""
    parser.add_argument("--speculative-method", default="none", choices=SPECULATIVE_METHODS,
                        help="draft tokens by prompt n-gram lookup or with a draft model (default none)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per request and round (1-16)")
    parser.add_argument("--speculative-scheduling", default="confidence", choices=SPECULATIVE_SCHEDULING,
                        help="verify every draft (fixed) or DSpark's confidence-scheduled prefix (default)")
    parser.add_argument("--draft-model", default=None, help="draft GGUF / HF dir sharing the target's tokenizer")


@dataclass(frozen=True)
class EngineSettings:
    model: str | None = None  # GGUF / HF dir; None: the default SmolLM2
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_gib: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    async_scheduling: bool = True  # execution overlap (off with speculation)
    max_model_len: int | None = None
    num_threads: int | None = None  # torch intra-op threads of the engine thread
    seed: int = 0
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)


@dataclass(frozen=True)
class ExpertSettings:
    """Expert workers (role 'expert') and the remote ExpertExecutor of prefill/decode workers."""

    remote: bool = False  # prefill/decode: routed experts run on the expert workers
    call_timeout_s: float = 10.0  # one RunExperts call
    retry_down_s: float = 2.0  # a failed expert worker is routed around this long
    placement_poll_s: float = 0.1  # how often placement versions (and endpoints) are read
    load_window_s: float = 10.0  # expert worker: telemetry window of token counts
    release_grace_s: float = 2.0  # expert worker: keep a superseded version this long after its last call

    def __post_init__(self):
        for name in ("call_timeout_s", "retry_down_s", "placement_poll_s", "load_window_s"):
            _check(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _check(self.release_grace_s >= 0, f"release_grace_s must be >= 0, got {self.release_grace_s}")


@dataclass(frozen=True)
class WorkerSettings:
    role: str
    worker_id: str
    host: str = "0.0.0.0"  # bind address
    advertise_host: str = "127.0.0.1"  # what the registry publishes
    grpc_port: int = 50051
    metrics_port: int | None = 9090  # None: no Prometheus endpoint
    min_remote_prefill_tokens: int = 64  # decode: prefill remotely only if this many are uncached
    kv_transfer_timeout_s: float = 30.0
    kv_chunk_bytes: int = 1 << 20  # well under gRPC's 4 MiB message limit
    max_queued_requests: int = 256  # decode: more waiting -> RESOURCE_EXHAUSTED (HTTP 429)
    shutdown_grace_s: float = 10.0
    mesh: MeshSettings = field(default_factory=MeshSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    expert: ExpertSettings = field(default_factory=ExpertSettings)

    def __post_init__(self):
        _check(self.role in WORKER_ROLES, f"worker role must be one of {WORKER_ROLES}, got {self.role!r}")
        _check(bool(self.worker_id) and ":" not in self.worker_id, f"bad worker id {self.worker_id!r}")
        _check(0 < self.kv_chunk_bytes <= 3 << 20, f"kv_chunk_bytes must be in (0, 3 MiB], got {self.kv_chunk_bytes}")
        _check(self.min_remote_prefill_tokens >= 1, "min_remote_prefill_tokens must be >= 1")
        spec = self.engine.speculation
        _check(
            not (self.expert.remote and spec.method != "none" and spec.scheduling == "confidence"),
            "--speculative-scheduling confidence is not available with remote experts (its cost table is "
            "measured before the remote executor is installed); use --speculative-scheduling fixed",
        )

    @property
    def endpoint(self) -> str:
        return f"{self.advertise_host}:{self.grpc_port}"


@dataclass(frozen=True)
class RoutingSettings:
    """kv_aware cost = prefill_weight * prefill_blocks + decode_blocks + queue_weight * queued
    (see moemesh.router.policy)."""

    policy: str = "kv_aware"
    prefill_weight: float = 2.0
    queue_weight: float = 4.0
    disaggregated: bool = True  # False: aggregated (decode workers prefill locally)

    def __post_init__(self):
        _check(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        _check(self.prefill_weight >= 0 and self.queue_weight >= 0, "routing weights must be >= 0")


@dataclass(frozen=True)
class RouterSettings:
    router_id: str = "router"
    host: str = "0.0.0.0"
    advertise_host: str = "127.0.0.1"  # what the registry publishes
    http_port: int = 8000
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
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    mesh: MeshSettings = field(default_factory=MeshSettings)


def read_config_file(path: str | None) -> dict:
    if path is None:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SettingsError(f"cannot read mesh config {path!r}: {e}") from e
    if not isinstance(data, dict):
        raise SettingsError(f"mesh config {path!r} must be a JSON object")
    return data


def mesh_settings(args, config: dict, env: Mapping[str, str]) -> MeshSettings:
    return MeshSettings(
        mesh=_pick(args.mesh, config.get("mesh"), "local"),
        redis_url=_pick(args.redis_url, config.get("redis_url"), MeshSettings.redis_url),
        redis_password=env.get("MOEMESH_REDIS_PASSWORD") or None,
        heartbeat_ttl_s=_pick(args.heartbeat_ttl, None, MeshSettings.heartbeat_ttl_s),
        trace_file=args.trace_file,
        otlp_endpoint=_pick(args.otlp_endpoint, config.get("otlp_endpoint"), env.get("OTEL_EXPORTER_OTLP_ENDPOINT")),
        parent_pid=args.parent_pid,
    )


def _model(args, config: dict) -> str | None:
    source = (config.get("model") or {}).get("source")
    return args.model or (source if source and os.path.exists(source) else None)


def worker_settings(args, env: Mapping[str, str] = os.environ) -> WorkerSettings:
    config = read_config_file(args.config)
    ports = config.get("ports") or {}
    role = args.role
    worker_id = args.worker_id or env.get("POD_NAME") or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return WorkerSettings(
        role=role,
        worker_id=worker_id,
        host=args.host or "0.0.0.0",
        advertise_host=args.advertise_host or env.get("POD_IP") or "127.0.0.1",
        grpc_port=_pick(args.grpc_port, ports.get("grpc"), 50051),
        metrics_port=None if args.metrics_port == 0 else _pick(args.metrics_port, ports.get("metrics"), 9090),
        min_remote_prefill_tokens=_pick(args.min_remote_prefill_tokens, None, 64),
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        kv_chunk_bytes=args.kv_chunk_bytes,
        max_queued_requests=args.max_queued_requests,
        mesh=mesh_settings(args, config, env),
        engine=EngineSettings(
            model=_model(args, config),
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_memory_gib=args.kv_memory_gib,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            async_scheduling=not args.no_async_scheduling,
            max_model_len=args.max_model_len,
            num_threads=args.num_threads,
            speculation=speculation_settings(args) if role in ("decode", "both") else SpeculationSettings(),
        ),
        expert=expert_settings(args, config),
    )


def expert_settings(args, config: dict) -> ExpertSettings:
    """Remote experts when asked (`--remote-experts`) or when the mesh config lists expert workers."""
    return ExpertSettings(
        remote=bool(args.remote_experts or config.get("expert_worker_ids")) and args.role != "expert",
        call_timeout_s=args.expert_timeout,
        placement_poll_s=args.placement_poll,
        load_window_s=args.expert_load_window,
        release_grace_s=args.replica_release_grace,
    )


def router_settings(args, env: Mapping[str, str] = os.environ) -> RouterSettings:
    config = read_config_file(args.config)
    ports = config.get("ports") or {}
    return RouterSettings(
        router_id=args.worker_id or env.get("POD_NAME") or f"router-{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
        host=args.host or "0.0.0.0",
        advertise_host=args.advertise_host or env.get("POD_IP") or "127.0.0.1",
        http_port=_pick(args.http_port, ports.get("http"), 8000),
        grpc_port=None if args.grpc_port == 0 else _pick(args.grpc_port, ports.get("grpc"), 50051),
        model=_model(args, config),
        served_model_name=args.served_model_name or (config.get("model") or {}).get("name"),
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        decode_endpoints=tuple(args.decode_endpoint),
        prefill_endpoints=tuple(args.prefill_endpoint),
        max_in_flight=args.max_in_flight,
        routing=RoutingSettings(
            policy=args.policy,
            prefill_weight=args.prefill_weight,
            queue_weight=args.queue_weight,
            disaggregated=not args.aggregated,
        ),
        mesh=mesh_settings(args, config, env),
    )


def add_serve_arguments(parser) -> None:
    """The `moemesh serve` flags (every role; each uses the ones that apply to it)."""
    parser.add_argument("--role", required=True, choices=("router", *WORKER_ROLES))
    parser.add_argument("--config", default=None, help="mesh config JSON (the operator mounts /etc/moemesh/mesh.json)")
    parser.add_argument("--mesh", default=None, help="mesh id (Redis key namespace); default 'local'")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--heartbeat-ttl", type=float, default=None, help="registry TTL in seconds (default 15)")
    parser.add_argument("--trace-file", default=None, help="write OpenTelemetry spans as JSON lines here")
    parser.add_argument("--otlp-endpoint", default=None,
                        help="export spans over OTLP/gRPC to this collector (default: $OTEL_EXPORTER_OTLP_ENDPOINT)")
    parser.add_argument("--parent-pid", type=int, default=None, help="stop when this process exits (launchers)")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default=None, help="bind address (default 0.0.0.0)")
    parser.add_argument("--grpc-port", type=int, default=None, help="gRPC port (router: client API, 0 = off)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    worker = parser.add_argument_group("prefill / decode workers")
    parser.add_argument("--worker-id", default=None, help="registry id (default: $POD_NAME or role-host-random)")
    parser.add_argument("--advertise-host", default=None, help="host in the registry (default: $POD_IP or 127.0.0.1)")
    worker.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0 = off; default 9090)")
    worker.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    worker.add_argument("--device", default="cpu", help="torch device of the engine (cpu, cuda)")
    worker.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: by memory)")
    worker.add_argument("--kv-memory-gib", type=float, default=1.0)
    worker.add_argument("--max-num-seqs", type=int, default=64)
    worker.add_argument("--max-num-batched-tokens", type=int, default=2048)
    worker.add_argument("--no-async-scheduling", action="store_true",
                        help="run rounds one after another (no execution overlap)")
    worker.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine")
    worker.add_argument("--min-remote-prefill-tokens", type=int, default=None,
                        help="decode: prefill remotely only when this many prompt tokens are uncached (default 64)")
    worker.add_argument("--kv-transfer-timeout", type=float, default=30.0)
    worker.add_argument("--kv-chunk-bytes", type=int, default=1 << 20, help="prefill: KV chunk size (<= 3 MiB)")
    worker.add_argument("--max-queued-requests", type=int, default=256)
    add_speculation_arguments(parser.add_argument_group("speculative decoding (decode / both workers)"))
    expert = parser.add_argument_group("expert workers / remote experts")
    expert.add_argument("--remote-experts", action="store_true",
                        help="prefill/decode: run the routed experts on the expert workers of the placement")
    expert.add_argument("--expert-timeout", type=float, default=ExpertSettings.call_timeout_s,
                        help="seconds per expert call before the expert worker counts as down")
    expert.add_argument("--placement-poll", type=float, default=ExpertSettings.placement_poll_s,
                        help="seconds between reads of the placement version")
    expert.add_argument("--expert-load-window", type=float, default=ExpertSettings.load_window_s,
                        help="expert worker: seconds per published window of token counts")
    expert.add_argument("--replica-release-grace", type=float, default=ExpertSettings.release_grace_s,
                        help="expert worker: seconds a superseded placement's replicas stay after their last call")
    router = parser.add_argument_group("router")
    router.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (default 8000)")
    router.add_argument("--served-model-name", default=None)
    router.add_argument("--policy", default="kv_aware", choices=POLICIES)
    router.add_argument("--prefill-weight", type=float, default=RoutingSettings.prefill_weight)
    router.add_argument("--queue-weight", type=float, default=RoutingSettings.queue_weight)
    router.add_argument("--aggregated", action="store_true", help="decode workers prefill locally (no prefill workers)")
    router.add_argument("--decode-endpoint", action="append", default=[], help="static decode worker host:port")
    router.add_argument("--prefill-endpoint", action="append", default=[], help="static prefill worker host:port")
    router.add_argument("--max-in-flight", type=int, default=1024)


def _pick(flag, from_config, default):
    if flag is not None:
        return flag
    return from_config if from_config is not None else default


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)
