"""Expert settings: the expert worker process (`moemesh serve --role expert`) and the remote
ExpertExecutor that prefill/decode workers install. Torch-free: the worker's and the CLI's
settings import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from moemesh.runtime.settings import MeshSettings, check

# = moemesh.expert.transports.base.TRANSPORTS (no torch import here)
EXPERT_TRANSPORTS = ("grpc", "grpc-stream", "torch-dist", "socket")
EXPERT_DIST_BACKENDS = ("gloo", "nccl")  # = moemesh.expert.protocol.dist_group.BACKENDS


@dataclass(frozen=True)
class ExpertSettings:
    """Expert workers (role 'expert') and the remote ExpertExecutor of prefill/decode workers."""

    remote: bool = False  # prefill/decode: routed experts run on the expert workers
    call_timeout_s: float = 10.0  # one RunExperts call
    retry_down_s: float = 2.0  # a failed expert worker is routed around this long
    placement_poll_s: float = 0.1  # how often placement versions (and endpoints) are read
    load_window_s: float = 10.0  # expert worker: telemetry window of token counts
    release_grace_s: float = 2.0  # expert worker: keep a superseded version this long after its last call
    transport: str = "grpc-stream"  # prefill/decode: the expert data plane (expert/transports/base.py TRANSPORTS)
    dist_backend: str = "gloo"  # prefill/decode with the torch-dist transport: gloo (CPU tensors) or nccl
    busy_poll_s: float = (
        0.05  # socket transport: a wait for a reply / for the next request polls this long, then blocks
    )

    def __post_init__(self):
        check(
            self.transport in EXPERT_TRANSPORTS,
            f"expert transport must be one of {EXPERT_TRANSPORTS}, got {self.transport!r}",
        )
        check(
            self.dist_backend in EXPERT_DIST_BACKENDS,
            f"dist backend must be one of {EXPERT_DIST_BACKENDS}, got {self.dist_backend!r}",
        )
        for name in ("call_timeout_s", "retry_down_s", "placement_poll_s", "load_window_s"):
            check(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        check(self.release_grace_s >= 0, f"release_grace_s must be >= 0, got {self.release_grace_s}")
        check(self.busy_poll_s >= 0, f"busy_poll_s must be >= 0, got {self.busy_poll_s}")


class ExpertModelSettings(Protocol):
    """The engine options an expert worker reads: which checkpoint, dtype, device, threads."""

    model: str | None
    dtype: str
    device: str
    num_threads: int | None


class ExpertWorkerSettings(Protocol):
    """What the expert worker process reads of its settings (built by the CLI with the other
    workers' `moemesh.worker.settings.worker_settings`, role 'expert')."""

    worker_id: str
    host: str
    advertise_host: str
    grpc_port: int
    data_port: int
    metrics_port: int | None
    mesh: MeshSettings
    engine: ExpertModelSettings
    expert: ExpertSettings
    served_model_name: str | None

    @property
    def endpoint(self) -> str: ...
