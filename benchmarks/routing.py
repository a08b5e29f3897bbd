"""Routing policies on a shared-prefix workload: round_robin vs least_loaded vs kv_aware.

    python benchmarks/routing.py [--decode 2] [--groups 8] [--per-group 8] [--prefix-tokens 1024]
                                 [--concurrency 4] [--num-blocks 384] [--max-num-batched-tokens 256]
                                 [--disaggregated]

Starts Redis and `--decode` workers (aggregated by default: each prefills its own requests, so
TTFT shows where the prefix cache hit; `--disaggregated` adds a prefill worker), then one router
per policy over the same workers. Each policy gets its own workload: `--groups` system prompts of
about `--prefix-tokens` tokens, `--per-group` requests each with a distinct question, in random
order, `--concurrency` in flight, streamed through the official openai client. Each worker's KV
pool (`--num-blocks`) holds only part of all the prefixes, as a loaded server would.

Printed per policy: mean and p90 TTFT (client side), requests/s and output tokens/s, prefix hit
rate (cached prompt tokens / prompt tokens, from usage) and that rate as a share of the best
possible (every request but the first of its group reuses the whole prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import openai  # noqa: E402
from common import TOPICS, print_table  # noqa: E402

from moemesh.engine.loader import default_model_path, open_checkpoint  # noqa: E402
from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster, RedisServer  # noqa: E402

POLICIES = ("round_robin", "least_loaded", "kv_aware")
BLOCK = 16


def system_prompt(tokenizer, policy: str, group: int, num_tokens: int) -> str:
    topic = TOPICS[group % len(TOPICS)]
    sentence = f"[{policy} group {group}] You are a patient expert on {topic}; answer with care and cite facts. "
    text = ""
    while len(tokenizer.encode(text)) < num_tokens:
        text += sentence
    return text


def workload(tokenizer, policy: str, args) -> list[tuple[int, str]]:
    requests = []
    for g in range(args.groups):
        prefix = system_prompt(tokenizer, policy, g, args.prefix_tokens)
        requests += [(g, f"{prefix}\nQuestion {q}: what should a beginner know first?") for q in range(args.per_group)]
    random.Random(hash(policy) % 1000).shuffle(requests)
    return requests


async def run_policy(url: str, model: str, requests: list[tuple[int, str]], concurrency: int, max_tokens: int):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    queue: asyncio.Queue = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)
    results = []

    async def worker() -> None:
        while not queue.empty():
            group, prompt = queue.get_nowait()
            started = time.perf_counter()
            ttft, usage = None, None
            stream = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if ttft is None and chunk.choices:
                    ttft = time.perf_counter() - started
                if chunk.usage is not None:
                    usage = chunk.usage
            results.append((group, ttft, usage))

    started = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    elapsed = time.perf_counter() - started
    await client.close()
    return results, elapsed


def summarize(policy: str, results, elapsed: float, prefix_cached: int) -> list:
    ttfts = sorted(t for _, t, _ in results)
    prompt = sum(u.prompt_tokens for _, _, u in results)
    cached = sum(u.prompt_tokens_details.cached_tokens for _, _, u in results)
    groups = {g for g, _, _ in results}
    best = (len(results) - len(groups)) * prefix_cached  # every request but each group's first
    output = sum(u.completion_tokens for _, _, u in results)
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    return [
        policy,
        f"{statistics.mean(ttfts) * 1e3:.0f}",
        f"{p90 * 1e3:.0f}",
        f"{len(results) / elapsed:.2f}",
        f"{output / elapsed:.1f}",
        f"{cached / prompt:.1%}",
        f"{cached / best:.0%}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=384, help="KV blocks per worker (8 prefixes need 520)")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="per-step token budget (chunked prefill: cache hits need not wait for a long miss)",
    )
    parser.add_argument("--disaggregated", action="store_true", help="add a prefill worker")
    parser.add_argument(
        "--prefill-weight",
        type=float,
        default=None,
        help="kv_aware: weight of prefill blocks (default: the router's, 2)",
    )
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = parser.parse_args()
    tokenizer = open_checkpoint(default_model_path()).tokenizer
    worker_args = (
        "--num-blocks",
        str(args.num_blocks),
        "--max-model-len",
        str(args.prefix_tokens + 256),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    )
    router_args = ("--max-model-len", str(args.prefix_tokens + 256))  # kv_aware's weight; the others ignore it
    if args.prefill_weight is not None:
        router_args += ("--prefill-weight", str(args.prefill_weight))
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        redis = RedisServer().start()
        spec = ClusterSpec(
            num_prefill=1 if args.disaggregated else 0,
            num_decode=args.decode,
            aggregated=not args.disaggregated,
            http_port=0,
            redis_url=redis.url,
            mesh="bench-routing",
            num_threads=args.num_threads,
            worker_args=worker_args,
            log_dir=logs,
            policy=args.policies[0],
            router_args=router_args,
        )
        cluster = LocalCluster(spec)
        try:
            cluster.start()
            urls = {args.policies[0]: cluster.url}
            for policy in args.policies[1:]:
                extra = () if args.disaggregated else ("--aggregated",)
                urls[policy] = cluster.add_router(f"router-{policy}", policy, extra).http_url
            model = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused").models.list().data[0].id
            prefix_cached = args.prefix_tokens // BLOCK * BLOCK
            for policy in args.policies:
                requests = workload(tokenizer, policy, args)
                results, elapsed = asyncio.run(
                    run_policy(urls[policy], model, requests, args.concurrency, args.max_tokens)
                )
                rows.append(summarize(policy, results, elapsed, prefix_cached))
                print(f"  {policy}: done in {elapsed:.1f} s", flush=True)
        finally:
            cluster.stop()
            redis.stop()
    mode = "disaggregated (+1 prefill)" if args.disaggregated else "aggregated"
    print(
        f"{args.groups} groups x {args.per_group} requests, ~{args.prefix_tokens}-token shared prefix, random order, "
        f"{args.concurrency} in flight; {args.decode} decode workers ({mode}), "
        f"{args.num_blocks} KV blocks each"
    )
    print_table(["policy", "mean TTFT ms", "p90 TTFT ms", "req/s", "out tok/s", "hit rate", "of best"], rows)
    by_policy = {r[0]: float(r[1]) for r in rows}
    if "round_robin" in by_policy and "kv_aware" in by_policy:
        print(
            f"kv_aware mean TTFT is {by_policy['round_robin'] / by_policy['kv_aware']:.1f}x lower than round_robin "
            "(target >= 3x); hit-rate target: >= 90% of best"
        )


if __name__ == "__main__":
    main()
