"""Chaos on a local cluster (its own Redis; 1 prefill + 2 decode workers, supervised like `moemesh
up`): greedy streams run while a decode worker, the prefill worker and Redis are SIGKILLed in
turn (benchmarks/chaos.py's harness, on a shorter schedule). Every request completes with the
fault-free output, every process comes back, and nothing leaks: no KV block stays used, the
registry and the prefix index name only live workers. Then a ~5k-token prompt goes through the
disaggregated path."""

from __future__ import annotations

import openai
import pytest

from benchmarks.chaos import PROMPTS, metric_total, run_chaos
from moemesh.common import registry
from moemesh.common.prefix_index import PrefixIndex
from moemesh.common.redis_client import connect
from moemesh.engine.sampling_params import SamplingParams
from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster
from tests.services.cluster_helpers import ROUTER_ARGS, WORKER_ARGS, load_any, wait_until

MESH = "chaos"
MAX_TOKENS = 16
# this module's workers also hold a ~5k-token prompt (8k context, 400 blocks of 16)
LONG_ARGS = (*WORKER_ARGS, "--max-model-len", "8192", "--num-blocks", "400")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = ClusterSpec(num_prefill=1, num_decode=2, http_port=0, mesh=MESH, num_threads=1, worker_args=LONG_ARGS,
                       router_args=(*ROUTER_ARGS, "--max-model-len", "8192"), heartbeat_ttl_s=3.0, log_dir=str(tmp_path_factory.mktemp("chaos")),
                       start_timeout_s=240, restart_backoff_s=0.5)  # fmt: skip
    with LocalCluster(spec) as cluster:
        yield cluster


def test_streams_survive_a_decode_worker_the_prefill_worker_and_redis_being_killed(cluster, offline_llm):
    expected = {p: o.text for p, o in zip(PROMPTS, offline_llm.generate(PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS)))}  # fmt: skip
    result = run_chaos(cluster, ["decode-0", "prefill-0", "redis"], num_streams=8, duration_s=28.0,
                       kill_every_s=9.0, max_tokens=MAX_TOKENS)  # fmt: skip
    assert [victim for _, victim in result.kills] == ["decode-0", "prefill-0", "redis"]
    assert result.failures == [] and len(result.samples) > 16
    assert result.mismatches(expected) == []
    for name in ("decode-0", "prefill-0"):
        assert any(line.startswith(f"{name} restarted") for line in result.restarts), result.restarts
    assert any(line.startswith("redis exited") for line in result.restarts), result.restarts

    def recovered() -> bool:
        cluster.supervise()
        return all(service.alive for service in cluster.services.values())

    wait_until(recovered, message="every process back")
    workers = [s for s in cluster.services.values() if s.role != "router"]

    def quiet() -> bool:  # no block left used (held KV exports released) and every worker registered again
        if any(load_any(w).num_blocks_used for w in workers):
            return False
        client = connect(cluster.redis_url)
        try:
            listed = {r.worker_id for r in registry.list_workers(client, MESH)}
            indexed = set(PrefixIndex(client, MESH).indexed_workers())
        finally:
            client.close()
        return listed == set(cluster.services) and indexed <= {w.name for w in workers}

    wait_until(quiet, message="no used KV blocks; registry and prefix index = the live workers")


def test_a_5k_token_prompt_completes_through_the_disaggregated_path(cluster):
    """The remote-prefill wait grows with the prompt: no local fallback, no first-token timeout."""
    prefill = cluster.services["prefill-0"]
    prefills = f"http://127.0.0.1:{prefill.metrics_port}/metrics"
    before = metric_total(prefills, "moemesh:prefills_total")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=900)
    prompt = " ".join(f"item {i} is {i * 7 % 13}." for i in range(520)) + "\nThe last item is"
    response = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=4,
                                         temperature=0)  # fmt: skip
    assert response.usage.prompt_tokens > 4500 and response.choices[0].finish_reason == "length"
    assert metric_total(prefills, "moemesh:prefills_total") == before + 1  # prefilled by the prefill worker, once
