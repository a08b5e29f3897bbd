"""`moemesh up`: the command line of the local cluster (`local_cluster.py`): refuses a busy port
before loading anything, prints every service's endpoints and metrics URL, then supervises the
processes (restarts with back-off, said on the console) until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import sys
import time
from typing import NamedTuple

from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster
from moemesh.launcher.ports import port_in_use
from moemesh.runtime import engine_args
from moemesh.runtime.engine_config import BY_NAME, OPTIONS
from moemesh.runtime.settings import SettingsError
from moemesh.worker.settings import EXPERT_TRANSPORTS, engine_settings


def add_up_arguments(parser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    parser.add_argument("--aggregated", action="store_true", help="workers prefill and decode (no prefill workers)")
    parser.add_argument("--policy", default="kv_aware", choices=("round_robin", "least_loaded", "kv_aware"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="router HTTP port (0: any free port)")
    parser.add_argument("--grpc-port", type=int, default=0, help="router gRPC port (0: any free port)")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    parser.add_argument("--log-dir", default=None, help="write each service's log here instead of the terminal")
    parser.add_argument("--otlp-endpoint", default=None, help="every service exports traces over OTLP/gRPC here")
    parser.add_argument(
        "--experts",
        type=int,
        default=0,
        help="expert workers (MoE models): the routed experts run there, placed evenly (default 0)",
    )
    parser.add_argument(
        "--expert-replicas",
        type=int,
        default=1,
        help="with --experts: copies of each expert, each on another expert worker, so that one can die (default 1)",
    )
    parser.add_argument(
        "--expert-transport",
        default="grpc-stream",
        choices=EXPERT_TRANSPORTS,
        help="with --experts: the expert data plane of the workers (default grpc-stream)",
    )
    # every service gets --model; the other engine flags given go to the services whose role reads them
    engine_args.add_engine_arguments(parser.add_argument_group("engine (as moemesh serve takes them)"), "serve")


class ServiceArgs(NamedTuple):
    """The engine flags given to `moemesh up`, for each kind of service."""

    worker: tuple[str, ...]  # prefill, decode and aggregated workers (each reads those of its role)
    expert: tuple[str, ...]
    router: tuple[str, ...]


def service_args(args) -> ServiceArgs:
    """The engine flags given, checked here first as a worker would (SettingsError), split by the
    roles that read them; --model goes to every service apart (ClusterSpec.model)."""
    engine_settings(args, {}, "both")
    given = engine_args.given(args) - {"model"}
    values = {o.name: o.parse(getattr(args, o.name)) for o in OPTIONS if o.name in given}

    def of(*roles: str) -> tuple[str, ...]:
        return tuple(engine_args.argv({n: v for n, v in values.items() if BY_NAME[n].roles & set(roles)}))

    return ServiceArgs(worker=of("prefill", "decode", "both"), expert=of("expert"), router=of("router"))


def print_endpoints(cluster: LocalCluster) -> None:
    for service in cluster.services.values():
        metrics = service.metrics_port
        where = service.http_url or service.grpc_endpoint
        host = where.split("//")[-1].rsplit(":", 1)[0]
        print(
            f"  {service.name:<12} {service.role:<8} {where}"
            + (f"  metrics http://{host}:{metrics}/metrics" if metrics else ""),
            flush=True,
        )


def run_up(args) -> int:
    try:
        flags = service_args(args)
    except SettingsError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    spec = ClusterSpec(
        num_prefill=args.prefill,
        num_decode=args.decode,
        aggregated=args.aggregated,
        policy=args.policy,
        host=args.host,
        http_port=args.port,
        router_grpc_port=args.grpc_port,
        redis_url=args.redis_url,
        model=args.model,
        num_threads=args.num_threads,
        worker_args=flags.worker,
        router_args=flags.router,
        log_dir=args.log_dir,
        otlp_endpoint=args.otlp_endpoint,
        num_experts=args.experts,
        expert_replicas=args.expert_replicas,
        expert_transport=args.expert_transport,
        expert_args=flags.expert,
    )
    if args.prefill < 0 or args.decode < 1 or args.experts < 0:
        print("moemesh: error: need --decode >= 1, --prefill >= 0 and --experts >= 0", file=sys.stderr)
        return 2
    if not 1 <= args.expert_replicas <= max(args.experts, 1):
        print(
            f"moemesh: error: --expert-replicas {args.expert_replicas} needs 1 <= replicas <= --experts "
            f"({args.experts})",
            file=sys.stderr,
        )
        return 2
    busy = [port for port in (args.port, args.grpc_port) if port and port_in_use(args.host, port)]
    if busy:  # before anything loads (another cluster may answer on it)
        print(
            f"moemesh: error: port {busy[0]} on {args.host} is in use (another moemesh up?); choose another "
            f"with --port / --grpc-port",
            file=sys.stderr,
        )
        return 2
    cluster = LocalCluster(spec)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        cluster.start()
        router = cluster.services["router"]
        print(
            f"moemesh is up: OpenAI API at {cluster.url}/v1 (gRPC Generate at {router.grpc_endpoint}); Ctrl-C stops it",
            flush=True,
        )
        print_endpoints(cluster)
        while not stopping:
            for event in cluster.supervise():  # a crashed process comes back, as a kubelet would do
                print(f"moemesh: {event}", file=sys.stderr, flush=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 1
    finally:
        print("moemesh: stopping", flush=True)
        cluster.stop()
    return 0
