"""Chaos on a local MoE cluster, supervised like `moemesh up`: its own Redis, a tiny random
DeepSeek-V3 with a character tokenizer (`save_tiny_moe`), 1 prefill + 2 decode workers whose
routed experts run on 2 expert workers that each hold a replica of every expert. The issue's
schedule, as `python benchmarks/chaos.py --model tiny-moe` runs it (same harness): 64 greedy
streams for 60 s while a seeded schedule SIGKILLs one process every 10 s, a decode worker, the
prefill worker, an expert worker, Redis, then the other decode worker. Every request completes
with the offline engine's output (local experts), every process comes back and the restarted
expert worker serves the placement again, and nothing leaks: no KV block stays used, the
registry and the prefix index name only live workers. About 75 s, most of it the 60 s of
traffic."""

from __future__ import annotations

import pytest

from benchmarks.chaos import PROMPTS, metric_total, num_kills, report, run_chaos, save_tiny_moe, seeded_schedule
from moemesh.contracts import registry
from moemesh.contracts.prefix_index import PrefixIndex
from moemesh.contracts.redis_client import connect
from moemesh.engine.sampling_params import SamplingParams
from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster
from tests.services.cluster_helpers import wait_until
from tests.services.expert.expert_helpers import status

MESH = "chaos"
MAX_TOKENS = 16
NUM_STREAMS, DURATION_S, KILL_EVERY_S = 64, 60.0, 10.0  # kills at 10, 20, 30, 40, 50 s; then 10 s more traffic
MAX_MODEL_LEN = "256"
# float32 like the oracle; remote prefill from 8 uncached tokens on (every prompt), fast placement polls
WORKER_ARGS = (
    "--dtype",
    "float32",
    "--num-blocks",
    "256",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    MAX_MODEL_LEN,
    "--min-remote-prefill-tokens",
    "8",
    "--kv-transfer-timeout",
    "20",
    "--placement-poll",
    "0.05",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_moe(str(tmp_path_factory.mktemp("tiny_moe")))


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    spec = ClusterSpec(
        num_prefill=1,
        num_decode=2,
        http_port=0,
        mesh=MESH,
        model=model,
        num_threads=1,
        worker_args=WORKER_ARGS,
        router_args=("--max-model-len", MAX_MODEL_LEN),
        num_experts=2,
        expert_replicas=2,
        expert_args=("--dtype", "float32", "--placement-poll", "0.05"),
        heartbeat_ttl_s=3.0,
        log_dir=str(tmp_path_factory.mktemp("chaos")),
        start_timeout_s=240,
        restart_backoff_s=0.5,
    )
    with LocalCluster(spec) as cluster:
        yield cluster


def expected_outputs(model: str) -> dict[str, str]:
    """The offline engine on the same checkpoint, experts in-process."""
    from moemesh import LLM

    llm = LLM(model, dtype="float32", num_blocks=64, max_model_len=int(MAX_MODEL_LEN), show_progress=False)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {p: o.text for p, o in zip(PROMPTS, outputs)}


def routed_tokens(service) -> int:
    """Tokens the expert worker computed since it started (all layers and experts)."""
    return sum(status(service).expert_tokens)


def test_streams_survive_a_decode_prefill_and_expert_worker_and_redis_being_killed(cluster, model):
    expected = expected_outputs(model)
    assert len(set(expected.values())) == len(PROMPTS)  # the outputs tell the prompts apart
    decode_ids = [name for name, s in cluster.services.items() if s.role == "decode"]
    schedule = seeded_schedule(0, num_kills(DURATION_S, KILL_EVERY_S), decode_ids, cluster.expert_ids())
    decode, prefill, expert, redis, other_decode = schedule
    assert decode in decode_ids and prefill == "prefill-0" and expert in cluster.expert_ids() and redis == "redis"
    assert other_decode in decode_ids and other_decode != decode  # seed 0: each decode worker once
    assert cluster.placement.replica_counts.min() == 2  # every expert also on the other expert worker

    result = run_chaos(
        cluster,
        schedule,
        num_streams=NUM_STREAMS,
        duration_s=DURATION_S,
        kill_every_s=KILL_EVERY_S,
        max_tokens=MAX_TOKENS,
    )
    report("chaos", result, expected)  # requests, migrations, 429s, failures, kills: shown when it fails
    assert [victim for _, victim in result.kills] == schedule
    assert [s.error for s in result.samples if s.error] == [] and len(result.samples) > 2 * NUM_STREAMS  # no 429 either
    assert result.mismatches(expected) == []
    for name in (decode, prefill, expert, other_decode):
        assert any(line.startswith(f"{name} restarted") for line in result.restarts), result.restarts
    assert any(line.startswith("redis exited") for line in result.restarts), result.restarts
    restored = f"placement {cluster.placement.version} restored (Redis had lost it)"
    assert restored in result.restarts, result.restarts  # so the restarted expert worker finds it

    def recovered() -> bool:
        cluster.supervise()
        return all(service.alive for service in cluster.services.values())

    wait_until(recovered, message="every process back")
    restarted = cluster.services[expert]
    wait_until(
        lambda: status(restarted).serving and status(restarted).active_version == cluster.placement.version,
        message=f"{expert} serving placement {cluster.placement.version} again",
    )
    before = routed_tokens(restarted)

    def dispatched_to_it() -> bool:  # a request's experts ran on it (replicas alternate between the workers)
        assert complete(cluster, PROMPTS[0]) == expected[PROMPTS[0]]
        return routed_tokens(restarted) > before

    wait_until(dispatched_to_it, message=f"the workers dispatching to {expert} again")

    workers = [s for s in cluster.services.values() if s.role in ("prefill", "decode")]

    def quiet() -> bool:  # no block left used (held KV exports released) and every worker registered again
        if any(metric_total(f"http://127.0.0.1:{w.metrics_port}/metrics", "moemesh:kv_blocks_used") for w in workers):
            return False
        client = connect(cluster.redis_url)
        try:
            listed = {r.worker_id for r in registry.list_workers(client, MESH)}
            indexed = set(PrefixIndex(client, MESH).indexed_workers())
        finally:
            client.close()
        return listed == set(cluster.services) and indexed <= {w.name for w in workers}

    wait_until(quiet, message="no used KV blocks; registry and prefix index = the live workers")


def complete(cluster, prompt: str) -> str:
    """One greedy completion through the router's OpenAI API."""
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    response = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    return response.choices[0].text
