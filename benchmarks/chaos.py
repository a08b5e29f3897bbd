"""Chaos: concurrent greedy streams against a local cluster while a seeded schedule SIGKILLs one
process every few seconds (a decode worker, the prefill worker, Redis, ...), and the cluster's
supervisor restarts each one, as `moemesh up` and a kubelet do.

    python benchmarks/chaos.py [--streams 64] [--duration 60] [--kill-every 10] [--seed 0]
                               [--decode 2] [--max-tokens 32]

Printed: requests, migrations, 429s and client-visible failures, greedy outputs that differ from
the fault-free reference, and p50/p99 TTFT and inter-token latency of requests that started
without a fault nearby vs within `--recovery` seconds after a kill. The same harness
(`run_chaos`) runs in tests/services/test_chaos.py on a shorter schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import httpx

PROMPTS = [
    "List three uses of copper:",
    "The main ingredients of bread are",
    "Explain what a compiler does in one sentence:",
    "The tallest mountain on Earth is",
    "Translate 'good morning' into Spanish:",
    "A healthy breakfast could include",
]


@dataclass
class Sample:
    started: float
    ttft: float | None
    itls: list[float]
    text: str
    error: str | None  # None: completed; "429"; else what failed
    prompt: str


@dataclass
class ChaosResult:
    samples: list[Sample] = field(default_factory=list)
    kills: list[tuple[float, str]] = field(default_factory=list)  # (time, victim)
    restarts: list[str] = field(default_factory=list)  # the supervisor's lines
    migrations: float = 0.0

    @property
    def failures(self) -> list[Sample]:
        return [s for s in self.samples if s.error not in (None, "429")]

    def mismatches(self, expected: dict[str, str]) -> list[Sample]:
        return [s for s in self.samples if s.error is None and s.text != expected[s.prompt]]

    def near_fault(self, sample: Sample, recovery_s: float) -> bool:
        return any(t <= sample.started <= t + recovery_s for t, _ in self.kills)


def metric_total(metrics_url: str, name: str) -> float:
    """The sum of a metric's samples (all label values) scraped from `metrics_url`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def kill(cluster, victim: str) -> None:
    """SIGKILL a service of the cluster, or its Redis ("redis"); the supervisor restarts it."""
    process = cluster.redis.process if victim == "redis" else cluster.services[victim].process
    os.kill(process.pid, signal.SIGKILL)


async def _stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Sample:
    started = last = time.monotonic()
    sample = Sample(started, None, [], "", None, prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                sample.error = "429" if response.status_code == 429 else f"HTTP {response.status_code}"
                await response.aread()
                return sample
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    sample.error = event["error"]["message"]
                    continue
                now = time.monotonic()
                if sample.ttft is None:
                    sample.ttft = now - started
                else:
                    sample.itls.append(now - last)
                last = now
                sample.text += event["choices"][0]["text"]
    except httpx.HTTPError as e:
        sample.error = f"{type(e).__name__}: {e}"
    return sample


def run_chaos(cluster, schedule: list[str], num_streams: int = 64, duration_s: float = 60.0,
              kill_every_s: float = 10.0, max_tokens: int = 32, prompts: list[str] = PROMPTS) -> ChaosResult:  # fmt: skip
    """`num_streams` clients send greedy streams back to back for `duration_s`; every
    `kill_every_s` the next victim of `schedule` is SIGKILLed. A supervisor thread calls
    `cluster.supervise()` throughout."""
    result = ChaosResult()
    stop = threading.Event()

    def supervise() -> None:
        while not stop.is_set():
            result.restarts += cluster.supervise()
            stop.wait(0.2)

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    migrations_before = metric_total(cluster.url + "/metrics", "moemesh:router_migrations_total")
    model = json.loads(urllib.request.urlopen(cluster.url + "/v1/models", timeout=30).read())["data"][0]["id"]

    async def main() -> None:
        begin = time.monotonic()
        end = begin + duration_s

        async def client_loop(index: int, client: httpx.AsyncClient) -> None:
            i = index
            while time.monotonic() < end:
                result.samples.append(await _stream(client, model, prompts[i % len(prompts)], max_tokens))
                i += num_streams

        async def killer() -> None:
            for n, victim in enumerate(schedule):
                at = begin + (n + 1) * kill_every_s
                if at >= end:
                    return
                await asyncio.sleep(at - time.monotonic())
                await asyncio.to_thread(kill, cluster, victim)
                result.kills.append((time.monotonic(), victim))

        limits = httpx.Limits(max_connections=num_streams + 4)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=httpx.Timeout(600.0), limits=limits) as client:
            await asyncio.gather(killer(), *(client_loop(i, client) for i in range(num_streams)))

    try:
        asyncio.run(main())
    finally:
        stop.set()
        supervisor.join()
    result.migrations = metric_total(cluster.url + "/metrics", "moemesh:router_migrations_total") - migrations_before
    return result


def percentiles(values: list[float]) -> str:
    if not values:
        return "   -   /   -  "
    values = sorted(values)
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    return f"{statistics.median(values) * 1000:6.0f} / {p99 * 1000:6.0f}"


def report(result: ChaosResult, expected: dict[str, str] | None, recovery_s: float) -> None:
    print(f"requests {len(result.samples)}  migrations {result.migrations:.0f}  "
          f"429s {sum(s.error == '429' for s in result.samples)}  failures {len(result.failures)}"
          + (f"  differing outputs {len(result.mismatches(expected))}" if expected else ""))  # fmt: skip
    print("kills: " + ", ".join(f"{victim}" for _, victim in result.kills))
    print(f"{'requests':<26}{'n':>6}  {'TTFT p50/p99 ms':>16}  {'ITL p50/p99 ms':>16}")
    for label, near in (("without faults", False), (f"within {recovery_s:g} s of a kill", True)):
        group = [s for s in result.samples if s.error is None and result.near_fault(s, recovery_s) == near]
        print(f"{label:<26}{len(group):>6}  {percentiles([s.ttft for s in group if s.ttft]):>16}  "
              f"{percentiles([x for s in group for x in s.itls]):>16}")  # fmt: skip
    for failure in result.failures[:5]:
        print(f"  failed: {failure.prompt!r}: {failure.error}")


def main() -> None:
    from moemesh import LLM, SamplingParams
    from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--recovery", type=float, default=10.0, help="seconds after a kill that count as 'faulty'")
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    llm = LLM(max_model_len=1024, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    expected = {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
    del llm
    logs = tempfile.mkdtemp(prefix="moemesh-chaos-")
    spec = ClusterSpec(num_prefill=1, num_decode=args.decode, http_port=0, heartbeat_ttl_s=3.0, log_dir=logs,
                       worker_args=("--max-model-len", "1024"), router_args=("--max-model-len", "1024"))  # fmt: skip
    rng = random.Random(args.seed)  # the seeded schedule: decode worker, prefill worker, Redis, ...
    roles = ["decode", "prefill", "redis"]
    schedule = [f"decode-{rng.randrange(args.decode)}" if roles[n % 3] == "decode" else
                "prefill-0" if roles[n % 3] == "prefill" else "redis"
                for n in range(int(args.duration // args.kill_every))]  # fmt: skip
    with LocalCluster(spec) as cluster:
        print(f"{args.streams} streams for {args.duration:g} s, kills every {args.kill_every:g} s: "
              f"{', '.join(schedule)} (logs: {logs})")  # fmt: skip
        result = run_chaos(cluster, schedule, args.streams, args.duration, args.kill_every, args.max_tokens)
        report(result, expected, args.recovery)


if __name__ == "__main__":
    main()
