"""KV transfer prefill -> decode over loopback gRPC: bytes/s of the KV stream.

    python benchmarks/kv_transfer.py [--tokens 512 2048 4096] [--repeats 3] [--chunk-mib 1]

Starts Redis and one prefill worker process (the default SmolLM2 model, float32: 45 KiB of KV
per token), then asks it for the KV of a prompt the way a decode worker does (PrefillWorker.Prefill:
KV chunks as the prefill rounds complete, then the first token). The first call per length warms
the prefill worker's prefix cache, so the timed calls compute one round and all the KV follows
it: "stream" is first chunk -> first token (the transfer proper: serialization, loopback),
"to first chunk" is P's work before it (admission, the prefix-cache hit, one block of prefill,
copying the KV out), "end to end" the whole call through `GrpcKVTransport.fetch` (each chunk
copied into its own buffer). Target: >= 1 GB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import grpc  # noqa: E402
from common import print_table  # noqa: E402

from moemesh.engine.connectors.kv_transfer import KVLayout, KVPiece, RemotePrefillTask  # noqa: E402
from moemesh.engine.loader import default_model_path, open_checkpoint  # noqa: E402
from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster, RedisServer  # noqa: E402
from moemesh.proto.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc  # noqa: E402
from moemesh.runtime.grpc_util import ChannelPool  # noqa: E402
from moemesh.worker.convert import layout_to_proto  # noqa: E402
from moemesh.worker.kv_client import GrpcKVTransport  # noqa: E402

# SmolLM2-135M: 30 layers x K,V x 3 KV heads x 64 dims, float32
LAYOUT_SHAPES = ((3, 64),) * 60


async def stream_once(endpoint: str, prompt: list[int], layout: KVLayout, chunk_bytes: int) -> tuple[float, int, float]:
    """(seconds from the first chunk to the first token, bytes, seconds to the first chunk) of one Prefill call."""
    async with grpc.aio.insecure_channel(endpoint, options=[("grpc.max_receive_message_length", 8 << 20)]) as channel:
        stub = prefill_pb2_grpc.PrefillWorkerStub(channel)
        request = prefill_pb2.PrefillRequest(
            request_id=f"bench-{random.random()}",
            prompt_token_ids=prompt,
            layout=layout_to_proto(layout),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1),
            max_chunk_bytes=chunk_bytes,
        )
        first_at, received = None, 0
        started = time.perf_counter()
        async for message in stub.Prefill(request):
            if message.HasField("chunk"):
                first_at = first_at or time.perf_counter()
                received += len(message.chunk.data)
        return time.perf_counter() - first_at, received, first_at - started


async def fetch_once(
    transport: GrpcKVTransport, endpoint: str, prompt: list[int], layout: KVLayout
) -> tuple[float, int]:
    task = RemotePrefillTask(
        endpoint,
        f"bench-{random.random()}",
        prompt,
        common_pb2.SamplingParams(temperature=0.0, max_tokens=1),
        0,
        layout,
        120.0,
        idle_timeout_s=120.0,
    )
    started = time.perf_counter()
    num_bytes = 0
    async for item in transport.fetch(task):
        num_bytes += item.data.numel() if isinstance(item, KVPiece) else 0
    return time.perf_counter() - started, num_bytes


async def measure(endpoint: str, lengths: list[int], repeats: int, chunk_bytes: int, model_id: str) -> list[list]:
    layout = KVLayout(model_id, "float32", LAYOUT_SHAPES)
    transport = GrpcKVTransport(ChannelPool())
    rows = []
    for num_tokens in lengths:
        prompt = [random.randrange(100, 40000) for _ in range(num_tokens)]
        await stream_once(endpoint, prompt, layout, chunk_bytes)  # warm P's prefix cache
        streams = [await stream_once(endpoint, prompt, layout, chunk_bytes) for _ in range(repeats)]
        fetches = [await fetch_once(transport, endpoint, prompt, layout) for _ in range(repeats)]
        stream_s = min(s[0] for s in streams)
        first_chunk_s = min(s[2] for s in streams)
        fetch_s = min(s for s, _ in fetches)
        num_bytes = streams[0][1]
        rows.append(
            [
                num_tokens,
                f"{num_bytes / 2**20:.1f}",
                f"{first_chunk_s * 1e3:.1f}",
                f"{stream_s * 1e3:.1f}",
                f"{num_bytes / stream_s / 1e9:.2f}",
                f"{fetch_s * 1e3:.1f}",
                f"{num_bytes / fetch_s / 1e9:.2f}",
            ]
        )
    await transport.channels.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mib", type=float, default=1.0)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads of the prefill worker")
    args = parser.parse_args()
    num_blocks = max(args.tokens) // 16 * 2 + 64
    model_id = open_checkpoint(default_model_path()).model_id
    with tempfile.TemporaryDirectory() as logs:
        redis = RedisServer().start()
        spec = ClusterSpec(
            redis_url=redis.url,
            mesh="bench-kv",
            log_dir=logs,
            num_threads=args.num_threads,
            worker_args=(
                "--dtype",
                "float32",
                "--num-blocks",
                str(num_blocks),
                "--max-model-len",
                str(max(args.tokens) + 16),
                "--max-num-batched-tokens",
                "4096",
                "--kv-chunk-bytes",
                str(int(args.chunk_mib * 2**20)),
            ),
        )
        cluster = LocalCluster(spec)
        try:
            prefill = cluster.add_worker("prefill-0", "prefill", num_threads=args.num_threads)
            rows = asyncio.run(
                measure(prefill.grpc_endpoint, args.tokens, args.repeats, int(args.chunk_mib * 2**20), model_id)
            )
        finally:
            cluster.stop()
            redis.stop()
    print(f"KV transfer prefill -> decode over loopback gRPC, chunks of {args.chunk_mib} MiB, best of {args.repeats}")
    headers = [
        "prompt tokens",
        "KV MiB",
        "to first chunk ms",
        "stream ms",
        "stream GB/s",
        "end to end ms",
        "end to end GB/s",
    ]
    print_table(headers, rows)
    print("target: >= 1 GB/s")


if __name__ == "__main__":
    main()
