"""Chaos: concurrent greedy streams against a local cluster while a seeded schedule SIGKILLs one
process every few seconds (a decode worker, the prefill worker, an expert worker, Redis, ...),
and the cluster's supervisor restarts each one, as `moemesh up` and a kubelet do.

    python benchmarks/chaos.py [--model smollm2 | tiny-moe] [--experts 2] [--streams 64]
                               [--duration 60] [--kill-every 10] [--seed 0] [--decode 2]
                               [--max-tokens 32] [--baseline 60]

`--model tiny-moe`: a tiny random DeepSeek-V3 (MLA, grouped routing, a shared expert; built
with transformers, `save_tiny_moe`) with a character tokenizer, its routed experts on
`--experts` expert workers (default 2) that each hold a replica of every expert (two copies
per expert), so the schedule also kills an expert worker. The default model is SmolLM2 (dense).

First a fault-free pass of `--baseline` seconds (0: none), then the chaos pass. Printed per
pass: requests, migrations, 429s and client-visible failures, greedy outputs that differ from
the offline engine's (the fault-free reference), then p50/p99 TTFT and inter-token latency of
the fault-free pass and of the chaos pass's requests that started within `--recovery` seconds
after a kill vs the others. The same harness (`run_chaos`, `seeded_schedule`, `num_kills`) runs
in tests/services/test_chaos.py on this default schedule, without the fault-free pass.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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

VOCAB = 128  # tiny-moe: token id = ASCII code

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


def num_kills(duration_s: float, kill_every_s: float) -> int:
    """How many kills `run_chaos` makes: at `kill_every_s`, 2 * `kill_every_s`, ... < `duration_s`."""
    return math.ceil(duration_s / kill_every_s) - 1


def seeded_schedule(
    seed: int, num_kills: int, decode_ids: list[str], expert_ids: list[str] = (), prefill_id: str = "prefill-0"
) -> list[str]:
    """The victims in turn: a decode worker, the prefill worker, an expert worker (when there are
    any), Redis, again; which decode / expert worker is drawn from `seed`."""
    rng = random.Random(seed)
    draws = {
        "decode": lambda: rng.choice(decode_ids),
        "prefill": lambda: prefill_id,
        "expert": lambda: rng.choice(expert_ids),
        "redis": lambda: "redis",
    }
    roles = ["decode", "prefill", *(["expert"] if expert_ids else []), "redis"]
    return [draws[roles[n % len(roles)]]() for n in range(num_kills)]


def save_tiny_moe(path: str, seed: int = 0) -> str:
    """A tiny random DeepSeek-V3 (transformers' own classes: MLA, 16 routed experts in 4 groups,
    top-4 from 2 groups, a shared expert; layer 0 dense, 2 MoE layers) saved with
    `save_pretrained`, plus a character tokenizer over ASCII (token id = code point, no merges),
    so the OpenAI API takes and returns text. Returns `path`."""
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        initializer_range=0.1,
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    )
    torch.manual_seed(seed)
    DeepseekV3ForCausalLM(config).eval().save_pretrained(path)
    tokenizer = Tokenizer(models.BPE(vocab={chr(i): i for i in range(VOCAB)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    return path


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


def run_chaos(
    cluster,
    schedule: list[str],
    num_streams: int = 64,
    duration_s: float = 60.0,
    kill_every_s: float = 10.0,
    max_tokens: int = 32,
    prompts: list[str] = PROMPTS,
) -> ChaosResult:
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


def report(label: str, result: ChaosResult, expected: dict[str, str]) -> None:
    print(
        f"{label}: requests {len(result.samples)}  migrations {result.migrations:.0f}  "
        f"429s {sum(s.error == '429' for s in result.samples)}  failures {len(result.failures)}  "
        f"differing outputs {len(result.mismatches(expected))}"
        + (f"  kills: {', '.join(victim for _, victim in result.kills)}" if result.kills else "")
    )
    for failure in result.failures[:5]:
        print(f"  failed: {failure.prompt!r}: {failure.error}")


def latency_table(baseline: ChaosResult | None, chaos: ChaosResult, recovery_s: float) -> None:
    rows = [("fault-free pass", baseline.samples if baseline else [])] if baseline else []
    rows += [
        (label, [s for s in chaos.samples if chaos.near_fault(s, recovery_s) == near])
        for label, near in (
            ("chaos: no kill in the last " + f"{recovery_s:g} s", False),
            (f"chaos: <= {recovery_s:g} s after a kill", True),
        )
    ]
    print(f"{'requests':<34}{'n':>6}  {'TTFT p50/p99 ms':>16}  {'ITL p50/p99 ms':>16}")
    for label, samples in rows:
        group = [s for s in samples if s.error is None]
        print(
            f"{label:<34}{len(group):>6}  {percentiles([s.ttft for s in group if s.ttft]):>16}  "
            f"{percentiles([x for s in group for x in s.itls]):>16}"
        )


def main() -> None:
    from moemesh import LLM, SamplingParams
    from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "tiny-moe"))
    parser.add_argument("--experts", type=int, default=2, help="tiny-moe: expert workers (>= 2: each expert twice)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--baseline", type=float, default=60.0, help="seconds of the fault-free pass first (0: none)")
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--recovery", type=float, default=10.0, help="seconds after a kill that count as 'faulty'")
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    logs = tempfile.mkdtemp(prefix="moemesh-chaos-")
    moe = args.model == "tiny-moe"
    model = save_tiny_moe(tempfile.mkdtemp(prefix="moemesh-tiny-moe-")) if moe else None
    max_len = 256 if moe else 1024
    llm = LLM(model, dtype="float32", max_model_len=max_len, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    expected = {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
    del llm
    num_experts = args.experts if moe else 0
    worker_args = ("--dtype", "float32", "--max-model-len", str(max_len))  # float32: as the reference
    spec = ClusterSpec(
        num_prefill=1,
        num_decode=args.decode,
        http_port=0,
        heartbeat_ttl_s=3.0,
        log_dir=logs,
        model=model,
        worker_args=worker_args,
        router_args=("--max-model-len", str(max_len)),
        num_experts=num_experts,
        expert_replicas=min(2, max(num_experts, 1)),
        expert_args=("--dtype", "float32"),
    )
    with LocalCluster(spec) as cluster:
        decode_ids = [name for name, s in cluster.services.items() if s.role == "decode"]
        kills = num_kills(args.duration, args.kill_every)
        schedule = seeded_schedule(args.seed, kills, decode_ids, cluster.expert_ids())
        print(
            f"{args.model}: 1 prefill, {args.decode} decode, {num_experts} expert workers; {args.streams} streams, "
            f"max_tokens {args.max_tokens} (logs: {logs})"
        )
        baseline = None
        if args.baseline > 0:
            baseline = run_chaos(cluster, [], args.streams, args.baseline, args.kill_every, args.max_tokens)
            report(f"fault-free pass, {args.baseline:g} s", baseline, expected)
        print(f"chaos pass, {args.duration:g} s, a kill every {args.kill_every:g} s: {', '.join(schedule)}")
        result = run_chaos(cluster, schedule, args.streams, args.duration, args.kill_every, args.max_tokens)
        report(f"chaos pass, {args.duration:g} s", result, expected)
        for line in result.restarts:
            print(f"  supervisor: {line}")
        latency_table(baseline, result, args.recovery)


if __name__ == "__main__":
    main()
