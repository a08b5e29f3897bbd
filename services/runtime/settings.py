"""Settings every service shares: typed, frozen, built once in `main()` from the mesh config file,
the command line and the environment. Nothing else in the services reads the environment.

Precedence: command-line flag > mesh config file (`--config`, the operator's ConfigMap
`mesh.json`: mesh, model {name, source}, redis_url, ports {grpc, http, metrics}; engine and
roles.<role>.engine, read by `moemesh.runtime.engine_args`) > default.
Environment (Kubernetes downward API / Secret): POD_NAME (service id), POD_IP (advertised host),
MOEMESH_REDIS_PASSWORD, OTEL_EXPORTER_OTLP_ENDPOINT (the OTLP collector, if no flag names one).

Each service's own settings live beside it (`moemesh.router.settings`, `moemesh.worker.settings`);
this module is below the engine and imports nothing above it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from moemesh.runtime.model_source_resolver import ModelSourceError, resolve_model_path


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
    drain_s: float = 30.0  # on SIGTERM: how long in-flight requests may run on (pods: terminationGracePeriodSeconds)

    def __post_init__(self):
        check(bool(self.mesh) and " " not in self.mesh, f"mesh must be a non-empty id, got {self.mesh!r}")
        check(self.drain_s >= 0, f"drain_s must be >= 0, got {self.drain_s}")
        check(self.heartbeat_ttl_s > 0, f"heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")


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
        mesh=pick(args.mesh, config.get("mesh"), "local"),
        redis_url=pick(args.redis_url, config.get("redis_url"), MeshSettings.redis_url),
        redis_password=env.get("MOEMESH_REDIS_PASSWORD") or None,
        heartbeat_ttl_s=pick(args.heartbeat_ttl, None, MeshSettings.heartbeat_ttl_s),
        trace_file=args.trace_file,
        otlp_endpoint=pick(args.otlp_endpoint, config.get("otlp_endpoint"), env.get("OTEL_EXPORTER_OTLP_ENDPOINT")),
        parent_pid=args.parent_pid,
        drain_s=pick(args.drain_seconds, config.get("drain_seconds"), MeshSettings.drain_s),
    )


def model_path(args, config: dict) -> str | None:
    """`--model`, else the mesh config's model source resolved to a local path (an unresolvable
    source is a SettingsError naming it, never a fallback), else None (the default model)."""
    if args.model:
        return args.model
    source = (config.get("model") or {}).get("source")
    if source is None:
        return None
    if isinstance(source, str):  # a plain path, as written by hand
        source = {"kind": "hostPath", "path": source, "localPath": source}
    try:
        return resolve_model_path(source)
    except ModelSourceError as e:
        raise SettingsError(str(e)) from e


def served_model_name(override: str | None, path: str) -> str:
    """The model's name in the API and every metric label: the override (`--served-model-name`,
    the mesh's spec.model.name), else the checkpoint's file or directory name without extension."""
    return override or os.path.splitext(os.path.basename(path.rstrip("/")))[0]


def add_common_arguments(parser) -> None:
    """The `moemesh serve` flags of every role (the engine's, --model, --block-size, ..., are
    generated from its definition: `moemesh.runtime.engine_args`)."""
    parser.add_argument("--config", default=None, help="mesh config JSON (the operator mounts /etc/moemesh/mesh.json)")
    parser.add_argument("--mesh", default=None, help="mesh id (Redis key namespace); default 'local'")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--heartbeat-ttl", type=float, default=None, help="registry TTL in seconds (default 15)")
    parser.add_argument("--trace-file", default=None, help="write OpenTelemetry spans as JSON lines here")
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="export spans over OTLP/gRPC to this collector (default: $OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="stop when this process exits (launchers)")
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=None,
        help="on SIGTERM: stop taking requests and let in-flight ones finish this long (default 30; "
        "the router migrates what is left)",
    )
    parser.add_argument("--host", default=None, help="bind address (default 0.0.0.0)")
    parser.add_argument("--grpc-port", type=int, default=None, help="gRPC port (router: client API, 0 = off)")
    parser.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus /metrics port (0 = off; default 9090)"
    )
    parser.add_argument("--worker-id", default=None, help="registry id (default: $POD_NAME or role-host-random)")
    parser.add_argument("--advertise-host", default=None, help="host in the registry (default: $POD_IP or 127.0.0.1)")


def metrics_port(args, config: dict) -> int | None:
    ports = config.get("ports") or {}
    return None if args.metrics_port == 0 else pick(args.metrics_port, ports.get("metrics"), 9090)


def pick(flag, from_config, default):
    if flag is not None:
        return flag
    return from_config if from_config is not None else default


def check(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)
