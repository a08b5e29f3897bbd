"""Worker settings (`moemesh serve --role prefill|decode|both|expert`): the engine's config
(resolved from the one definition, `moemesh.runtime.engine_config`), KV transfer and expert
options. The engine's flags are generated (`moemesh.runtime.engine_args`); this module adds the
worker's own."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from moemesh.expert.settings import EXPERT_DIST_BACKENDS, EXPERT_TRANSPORTS, ExpertSettings
from moemesh.runtime import engine_args
from moemesh.runtime.engine_config import DTYPES, EngineConfig
from moemesh.runtime.settings import (
    MeshSettings,
    check,
    mesh_settings,
    metrics_port,
    model_path,
    pick,
    read_config_file,
)

WORKER_ROLES = ("prefill", "decode", "both", "expert")
DTYPE_CHOICES = DTYPES


@dataclass(frozen=True)
class EngineSettings:
    """A worker's engine: its EngineConfig, resolved for the worker's role (flag > mesh config >
    default; the model unset: the default model), and the torch threads of the engine thread (a
    process setting, not the engine's). An expert worker reads model, dtype, device, threads."""

    config: EngineConfig = field(default_factory=EngineConfig)
    num_threads: int | None = None  # torch intra-op threads of the engine thread

    @property
    def model(self) -> str | None:
        return self.config.model.model

    @property
    def dtype(self) -> str:
        return self.config.model.dtype

    @property
    def device(self) -> str:
        return self.config.model.device


def engine_settings(args, config: dict, role: str) -> EngineSettings:
    """The engine options of `role` from the flags and the mesh config (SettingsError names the flag
    or the mesh config key of a bad value); a draft model must exist here."""
    engine = engine_args.resolve(args, config, role, fixed={"model": model_path(args, config)})
    draft = engine.spec.draft_model
    if draft is not None:
        check(
            os.path.exists(draft), f"{engine_args.source(args, config, role, 'draft_model')} {draft!r} does not exist"
        )
    return EngineSettings(config=engine, num_threads=args.num_threads)


@dataclass(frozen=True)
class WorkerSettings:
    role: str
    worker_id: str
    host: str = "0.0.0.0"  # bind address
    advertise_host: str = "127.0.0.1"  # what the registry publishes
    grpc_port: int = 50051
    data_port: int = 0  # expert worker: the socket transport's listener (0: an ephemeral port)
    metrics_port: int | None = 9090  # None: no Prometheus endpoint
    min_remote_prefill_tokens: int = 64  # decode: prefill remotely only if this many are uncached
    kv_transfer_timeout_s: float = 30.0  # a remote prefill fails with no KV for this long, or after this ...
    kv_transfer_timeout_per_token_s: float = 0.02  # ... plus this per uncached prompt token (long prompts)
    kv_chunk_bytes: int = 1 << 20  # well under gRPC's 4 MiB message limit
    max_queued_requests: int = 256  # decode: more waiting -> RESOURCE_EXHAUSTED (HTTP 429)
    mesh: MeshSettings = field(default_factory=MeshSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    expert: ExpertSettings = field(default_factory=ExpertSettings)
    served_model_name: str | None = None  # the mesh's model name (metric labels match the router's)

    def __post_init__(self):
        check(self.role in WORKER_ROLES, f"worker role must be one of {WORKER_ROLES}, got {self.role!r}")
        check(bool(self.worker_id) and ":" not in self.worker_id, f"bad worker id {self.worker_id!r}")
        check(0 < self.kv_chunk_bytes <= 3 << 20, f"kv_chunk_bytes must be in (0, 3 MiB], got {self.kv_chunk_bytes}")
        check(self.min_remote_prefill_tokens >= 1, "min_remote_prefill_tokens must be >= 1")
        check(0 <= self.data_port <= 65535, f"data port must be in [0, 65535], got {self.data_port}")
        spec = self.engine.config.spec
        check(
            not (self.expert.remote and spec.method != "none" and spec.scheduling == "confidence"),
            "--speculative-scheduling confidence is not available with remote experts (its cost table is "
            "measured before the remote executor is installed); use --speculative-scheduling fixed",
        )
        check(
            not (
                self.expert.remote
                and self.expert.transport == "torch-dist"
                and self.expert.dist_backend == "nccl"
                and not self.engine.device.startswith("cuda")
            ),
            "--expert-dist-backend nccl moves GPU tensors: it needs --device cuda (use gloo on the CPU)",
        )

    @property
    def endpoint(self) -> str:
        return f"{self.advertise_host}:{self.grpc_port}"


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
        grpc_port=pick(args.grpc_port, ports.get("grpc"), 50051),
        data_port=pick(args.data_port, ports.get("data"), 0),
        metrics_port=metrics_port(args, config),
        min_remote_prefill_tokens=pick(args.min_remote_prefill_tokens, None, 64),
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        kv_transfer_timeout_per_token_s=args.kv_transfer_timeout_per_token,
        kv_chunk_bytes=args.kv_chunk_bytes,
        max_queued_requests=args.max_queued_requests,
        mesh=mesh_settings(args, config, env),
        engine=engine_settings(args, config, role),
        expert=expert_settings(args, config),
        served_model_name=(config.get("model") or {}).get("name"),
    )


def expert_settings(args, config: dict) -> ExpertSettings:
    """Remote experts when asked (`--remote-experts`) or when the mesh config lists expert workers."""
    return ExpertSettings(
        remote=bool(args.remote_experts or config.get("expert_worker_ids")) and args.role != "expert",
        call_timeout_s=args.expert_timeout,
        placement_poll_s=args.placement_poll,
        load_window_s=args.expert_load_window,
        release_grace_s=args.replica_release_grace,
        transport=pick(args.expert_transport, config.get("expert_transport"), ExpertSettings.transport),
        dist_backend=args.expert_dist_backend,
        busy_poll_s=args.expert_busy_poll,
    )


def add_worker_arguments(parser) -> None:
    worker = parser.add_argument_group("prefill / decode workers")
    worker.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine")
    worker.add_argument(
        "--min-remote-prefill-tokens",
        type=int,
        default=None,
        help="decode: prefill remotely only when this many prompt tokens are uncached (default 64)",
    )
    worker.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        help="decode: seconds a remote prefill may go without sending KV, and the base of its "
        "deadline: this plus --kv-transfer-timeout-per-token per uncached prompt token; then "
        "the worker prefills the tokens whose KV did not arrive locally",
    )
    worker.add_argument("--kv-transfer-timeout-per-token", type=float, default=0.02)
    worker.add_argument("--kv-chunk-bytes", type=int, default=1 << 20, help="prefill: KV chunk size (<= 3 MiB)")
    worker.add_argument("--max-queued-requests", type=int, default=256)
    expert = parser.add_argument_group("expert workers / remote experts")
    expert.add_argument(
        "--remote-experts",
        action="store_true",
        help="prefill/decode: run the routed experts on the expert workers of the placement",
    )
    expert.add_argument(
        "--expert-transport",
        default=None,
        choices=EXPERT_TRANSPORTS,
        help="prefill/decode: the expert data plane: one unary gRPC call per layer and worker, "
        "a persistent bidirectional gRPC stream per expert worker (default), a two-rank "
        "torch.distributed group per expert worker (torch-dist), or one TCP connection per expert "
        "worker carrying raw tensor frames (socket); default: the config file's expert_transport, "
        "else grpc-stream",
    )
    expert.add_argument(
        "--data-port",
        type=int,
        default=None,
        help="expert workers: the port of the socket transport's data connections (default: the config "
        "file's ports.data, else any free port, announced through OpenDataPlane)",
    )
    expert.add_argument(
        "--expert-dist-backend",
        default=ExpertSettings.dist_backend,
        choices=EXPERT_DIST_BACKENDS,
        help="prefill/decode with --expert-transport torch-dist: the torch.distributed backend",
    )
    expert.add_argument(
        "--expert-busy-poll",
        type=float,
        default=ExpertSettings.busy_poll_s,
        help="socket transport: seconds a prefill/decode worker's wait for an expert reply, and an expert "
        "worker's wait for the next request, polls the connection (busy, yielding the CPU) before it "
        "blocks; a core that sleeps while it waits comes back with cold caches, and that costs more "
        "than the transfer. 0: always block",
    )
    expert.add_argument(
        "--expert-timeout",
        type=float,
        default=ExpertSettings.call_timeout_s,
        help="seconds per expert call before the expert worker counts as down",
    )
    expert.add_argument(
        "--placement-poll",
        type=float,
        default=ExpertSettings.placement_poll_s,
        help="seconds between reads of the placement version",
    )
    expert.add_argument(
        "--expert-load-window",
        type=float,
        default=ExpertSettings.load_window_s,
        help="expert worker: seconds per published window of token counts",
    )
    expert.add_argument(
        "--replica-release-grace",
        type=float,
        default=ExpertSettings.release_grace_s,
        help="expert worker: seconds a superseded placement's replicas stay after their last call",
    )
