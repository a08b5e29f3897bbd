"""Remote experts on one GPU at DeepSeek-V3 shapes: per-MoE-layer latency of the routed experts run
in-process (`LocalExpertExecutor`, the Triton fused MoE) vs on expert worker processes on the same
GPU over each expert transport (the issue's GPU check; CI never runs it).

    python benchmarks/expert_dispatch_gpu.py [--tokens 32 128] [--workers 1 2]
        [--transports torch-dist:nccl torch-dist:gloo grpc-stream] [--iters 30]

One MoE layer (default hidden 7168, 256 experts of 2048, top-8: DeepSeek-V3's routed experts,
22.5 GiB of bf16 per copy) with seeded random weights: each expert's tensors come from its own
seed, so the attention side (local row) and every expert worker hold the same numbers. Each
worker is this script's `serve` command in its own process: the real `ReplicaStore`,
`ExpertServicer` (grpc.aio) and `DistDataPlane`, its share of the experts (an even placement)
on the GPU. The attention side runs the real `RemoteExpertExecutor` over the real transport on a
bf16 hidden state on the GPU, with random top-k routing; the output is compared with the local
row's. Columns: "layer ms" = median wall time of one MoE layer (GPU synchronised), "vs local" =
that minus the local row's; "worker compute" = the slowest worker's compute per layer as the
workers report it; "overhead" = layer minus that compute (grouping, the copies to and from the
host, serialization, transport). A transport that fails (NCCL refuses two ranks on one GPU)
gets its error in the row.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(__file__))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import print_table  # noqa: E402

from moemesh.contracts.placement import make_placement  # noqa: E402
from moemesh.engine.errors import ExpertUnavailableError  # noqa: E402
from moemesh.engine.layers.expert_executor import ExpertPlacement, LocalExpertExecutor  # noqa: E402
from moemesh.expert.client.remote_executor import RemoteExpertExecutor, RemotePlacement  # noqa: E402
from moemesh.expert.transports.factory import make_transport  # noqa: E402
from moemesh.proto.v1 import expert_pb2  # noqa: E402

VERSION = 1
READY_TIMEOUT_S = 600  # a worker generates its weights on the GPU, then listens
FAILURES: list[str] = []  # the errors of failed rows, printed under the table


def expert_tensors(e: int, hidden: int, inter: int, device, dtype, seed: int):
    """Expert `e`'s (w13, w2), the same on every process."""
    gen = torch.Generator(device=device).manual_seed(seed * 100_003 + e)
    w13 = torch.randn(2 * inter, hidden, generator=gen, device=device, dtype=dtype) * hidden**-0.5
    w2 = torch.randn(hidden, inter, generator=gen, device=device, dtype=dtype) * inter**-0.5
    return w13, w2


def placement(args, num_workers: int):
    workers = [f"expert-{i}" for i in range(num_workers)]
    return make_placement(VERSION, np.arange(args.experts)[None, :], workers, args.experts)


def serve(args) -> None:
    from moemesh.expert.server.dist_server import DistDataPlane
    from moemesh.expert.server.replicas import ReplicaStore
    from moemesh.expert.server.servicer import ExpertServicer
    from moemesh.expert.server.weights import MoEShape
    from moemesh.proto.v1 import expert_pb2_grpc

    device, dtype = torch.device("cuda" if torch.cuda.is_available() else "cpu"), getattr(torch, args.dtype)
    shape = MoEShape("bench", (0,), args.experts, args.hidden, args.intermediate)

    def read(wanted):
        return {
            (layer, e): expert_tensors(e, args.hidden, args.intermediate, device, dtype, args.seed)
            for layer, e in wanted
        }

    store = ReplicaStore(args.worker_id, shape, read)
    store.load(placement(args, args.num_workers))

    async def main():
        servicer = ExpertServicer(store, lambda: expert_pb2.ExpertStatus(worker_id=args.worker_id))
        servicer.data_plane = DistDataPlane("127.0.0.1", args.worker_id, servicer.answer_blocking)
        server = grpc.aio.server()
        expert_pb2_grpc.add_ExpertWorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(args.port_file + ".tmp", args.port_file)  # the parent sees the whole port at once
        await server.wait_for_termination()

    import grpc

    asyncio.run(main())


def start_workers(args, num_workers: int, tmp: str) -> tuple[list[subprocess.Popen], dict[str, str]]:
    procs, files = [], []
    for i in range(num_workers):
        files.append(os.path.join(tmp, f"expert-{i}.port"))
        cmd = [
            sys.executable,
            __file__,
            "serve",
            "--worker-id",
            f"expert-{i}",
            "--num-workers",
            str(num_workers),
            "--port-file",
            files[-1],
            *shape_args(args),
        ]
        procs.append(subprocess.Popen(cmd))
    deadline = time.monotonic() + READY_TIMEOUT_S
    endpoints = {}
    for i, (proc, path) in enumerate(zip(procs, files)):
        while not os.path.exists(path):
            if proc.poll() is not None:
                raise RuntimeError(f"expert-{i} exited with {proc.returncode} before listening")
            if time.monotonic() > deadline:
                raise RuntimeError(f"expert-{i} did not listen within {READY_TIMEOUT_S} s")
            time.sleep(0.2)
        with open(path) as f:
            endpoints[f"expert-{i}"] = f"127.0.0.1:{f.read()}"
    return procs, endpoints


def shape_args(args) -> list[str]:
    return [
        "--hidden",
        str(args.hidden),
        "--intermediate",
        str(args.intermediate),
        "--experts",
        str(args.experts),
        "--dtype",
        args.dtype,
        "--seed",
        str(args.seed),
    ]


def routing(num_tokens: int, args, device):
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, args.hidden, generator=gen, device=device).to(getattr(torch, args.dtype))
    logits = torch.randn(num_tokens, args.experts, generator=gen, device=device)
    weights, ids = torch.softmax(logits, -1).topk(args.top_k, dim=-1)
    return x, ids, weights.float()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layer(executor, x, ids, weights, iters: int, device) -> tuple[float, torch.Tensor]:
    out = executor.forward(0, x, ids, weights)  # warm-up: kernels compiled, transport open
    for _ in range(2):
        executor.forward(0, x, ids, weights)
    sync(device)
    executor.compute_s = 0.0  # the remote executor's sum of per-layer worker compute: timed calls only
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        executor.forward(0, x, ids, weights)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="one expert worker (started by the benchmark)")
    s.add_argument("--worker-id", required=True)
    s.add_argument("--num-workers", type=int, required=True)
    s.add_argument("--port-file", required=True)
    for parser in (p, s):
        parser.add_argument("--hidden", type=int, default=7168)
        parser.add_argument("--intermediate", type=int, default=2048)
        parser.add_argument("--experts", type=int, default=256)
        parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
        parser.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[32, 128])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--transports", nargs="+", default=["torch-dist:nccl", "torch-dist:gloo", "grpc-stream"])
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    if args.command == "serve":
        return serve(args)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"# {name}, torch {torch.__version__}, {args.dtype}; one MoE layer: hidden {args.hidden}, "
        f"{args.experts} experts of {args.intermediate}, top-{args.top_k}; median of {args.iters}"
    )
    tensors = [expert_tensors(e, args.hidden, args.intermediate, device, dtype, args.seed) for e in range(args.experts)]

    layer = types.SimpleNamespace(w13=torch.stack([t[0] for t in tensors]), w2=torch.stack([t[1] for t in tensors]))
    del tensors
    local = LocalExpertExecutor([layer], ExpertPlacement.from_placement(placement(args, 1)))
    rows, reference = [], {}
    for n in args.tokens:
        x, ids, weights = routing(n, args, device)
        ms, reference[n] = time_layer(local, x, ids, weights, args.iters, device)
        rows.append(["local", "-", n, f"{ms:.2f}", "-", "-", "-", "-"])
        print("  ", *rows[-1], flush=True)
    local_ms = {n: float(r[3]) for n, r in zip(args.tokens, rows)}
    del local, layer
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the workers need the memory

    with tempfile.TemporaryDirectory() as tmp:
        for num_workers in args.workers:
            procs, endpoints = start_workers(args, num_workers, tmp)
            try:
                for spec in args.transports:
                    kind, _, backend = spec.partition(":")
                    for n in args.tokens:
                        rows.append(
                            remote_row(
                                args,
                                spec,
                                kind,
                                backend or "gloo",
                                endpoints,
                                num_workers,
                                n,
                                reference[n],
                                local_ms[n],
                                device,
                            )
                        )
                        print("  ", *rows[-1], flush=True)  # progress: a crash still leaves the rows so far
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
                for path in os.listdir(tmp):
                    os.remove(os.path.join(tmp, path))
    print_table(
        ["experts", "transport", "tokens", "layer ms", "vs local", "worker compute", "overhead", "max |diff|"], rows
    )
    for i, failure in enumerate(FAILURES, 1):
        print(f"({i}) {failure}")


def remote_row(args, spec, kind, backend, endpoints, num_workers, n, reference, local_ms, device) -> list:
    transport = make_transport(kind, endpoints, "127.0.0.1", backend)
    executor = RemoteExpertExecutor(transport, RemotePlacement(placement(args, num_workers)), timeout_s=120.0)
    x, ids, weights = routing(n, args, device)
    label = f"x{num_workers}"
    try:
        ms, out = time_layer(executor, x, ids, weights, args.iters, device)
    except ExpertUnavailableError as e:
        FAILURES.append(f"{label} {spec}, {n} tokens: {e}")
        return [label, spec, n, f"failed ({len(FAILURES)})", "-", "-", "-", "-"]
    finally:
        compute = executor.compute_s
        executor.close()
    compute_ms = compute / args.iters * 1e3
    diff = (out.float() - reference.float()).abs().max().item()
    return [
        label,
        spec,
        n,
        f"{ms:.2f}",
        f"{ms - local_ms:+.2f}",
        f"{compute_ms:.2f}",
        f"{ms - compute_ms:.2f}",
        f"{diff:.2e}",
    ]


if __name__ == "__main__":
    main()
