"""A local cluster (router + 1 prefill + 2 decode workers, real Redis, gRPC on loopback) against
the official `openai` client and the offline engine as the oracle."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import openai
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from prometheus_client.parser import text_string_to_metric_families

from moemesh.contracts.prefix_index import PrefixIndex
from moemesh.contracts.redis_client import connect
from moemesh.engine.sampling_params import SamplingParams
from moemesh.proto.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.services.cluster_helpers import (
    ROUTER_ARGS,
    decode_workers,
    generate,
    load,
    load_any,
    metrics_port,
    test_cluster,
    wait_until,
    workers,
)
from tests.services.otlp_collector import OtlpCollector
from tests.services.structured_cases import CASES as STRUCTURED_CASES

MESH = "api"
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the ocean:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "A good way to learn a new language is",
    "The largest planet in the solar system is",
]


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector() as collector:
        yield collector


@pytest.fixture(scope="module")
def cluster(redis_server, tmp_path_factory, collector):
    logs = tmp_path_factory.mktemp("cluster-api")
    with test_cluster(redis_server.url, MESH, logs, otlp_endpoint=collector.endpoint) as cluster:
        routers = [
            cluster.add_router("router-rr", "round_robin", ROUTER_ARGS, wait=False),
            cluster.add_router("router-agg", "round_robin", (*ROUTER_ARGS, "--aggregated"), wait=False),
        ]
        for router in routers:
            cluster.wait_http(router)
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aggregated_client(cluster):
    """Through a router whose decode workers prefill locally (the main router disaggregates)."""
    base_url = cluster.services["router-agg"].http_url + "/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def offline(offline_llm, prompt, max_tokens: int, **params):
    params = {"temperature": 0.0, **params}
    (output,) = offline_llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **params))
    return output


def test_models_lists_the_served_model(client, model):
    assert [m.id for m in client.models.list().data] == [model] == ["SmolLM2-135M-Instruct.Q4_1"]


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completions_equal_the_offline_engine_with_exact_usage(client, model, offline_llm, tokenizer, stream):
    for prompt in PROMPTS[:3]:
        expected = offline(offline_llm, prompt, 16)
        if stream:
            chunks = list(
                client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=16,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
        else:
            response = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
            text, finish, usage = response.choices[0].text, [response.choices[0].finish_reason], response.usage
        assert text == expected.text
        assert finish == [expected.finish_reason]
        assert usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert usage.completion_tokens == len(expected.token_ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_equals_the_offline_chat(client, model, offline_llm, stream):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a fruit."}]
    (expected,) = offline_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=20))
    if stream:
        chunks = list(
            client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0, stream=True)
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
        text = response.choices[0].message.content
        assert response.usage.completion_tokens == len(expected.token_ids)
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert text == expected.text


def test_stop_strings_cut_the_text_like_the_offline_engine(client, model, offline_llm):
    prompt = "List three animals: cat, dog,"
    expected = offline(offline_llm, prompt, 24, stop=(",",))
    response = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[","])
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_penalties_bias_min_tokens_and_many_stop_strings_equal_the_offline_engine(
    client, model, offline_llm, tokenizer, stream
):
    """Every vLLM sampling field travels router -> decode -> prefill (this prompt is prefilled
    remotely, so the first token is sampled by the prefill worker under the same bias)."""
    prompt = "Count: one, two, three, four, five,"
    banned = offline(offline_llm, prompt, 1).token_ids[0]
    stop = [" ten", " eleven", " twelve", "zz", "qq", "xx"]  # more than OpenAI's 4
    params = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2, "min_tokens": 6}
    expected = offline(offline_llm, prompt, 16, logit_bias={banned: -100.0}, stop=tuple(stop), **params)
    kwargs = dict(
        model=model,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stop=stop,
        logit_bias={str(banned): -100},
        presence_penalty=0.5,
        frequency_penalty=0.3,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 6},
    )
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert text == expected.text
    assert banned not in expected.token_ids


def test_parse_returns_objects_valid_against_the_sent_schema_disaggregated_and_aggregated_streamed(
    cluster, client, aggregated_client, model
):
    """openai's `parse` (non-streaming, disaggregated: the prefill worker samples the first token
    under the grammar, the decode worker continues its matcher) on ten schemas and `stream`
    (aggregated) on five of them, all at once; every raw output validates with jsonschema against
    the schema sent."""
    prefill = next(s for s in workers(cluster) if s.role == "prefill")
    prefills_before = load_any(prefill).prefix_cache_queries

    def parse(case):
        prompt, schema = case
        completion = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format=schema,
            max_tokens=64,
            temperature=0,
        )
        return completion.choices[0].message.content, completion.choices[0].message.parsed

    def stream(case):
        prompt, schema = case
        with aggregated_client.chat.completions.stream(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format=schema,
            max_tokens=64,
            temperature=0,
        ) as events:
            deltas = "".join(e.delta for e in events if e.type == "content.delta")
            message = events.get_final_completion().choices[0].message
        assert deltas == message.content
        return message.content, message.parsed

    with ThreadPoolExecutor(len(STRUCTURED_CASES) + 5) as pool:
        parsed = pool.map(parse, STRUCTURED_CASES)
        streamed = pool.map(stream, STRUCTURED_CASES[::2])
        results = [*zip(STRUCTURED_CASES, parsed), *zip(STRUCTURED_CASES[::2], streamed)]
    for (_, schema), (raw, obj) in results:
        jsonschema.validate(json.loads(raw), type_to_response_format_param(schema)["json_schema"]["schema"])
        assert isinstance(obj, schema) and obj == schema.model_validate_json(raw)
    assert load_any(prefill).prefix_cache_queries >= prefills_before + 1  # the disaggregated path ran


def test_json_object_choice_and_regex_constraints_and_bad_ones_get_400(client, aggregated_client, model):
    def chat(c, prompt, **kwargs):
        messages = [{"role": "user", "content": prompt}]
        return c.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0, **kwargs)

    choices = ["yes", "no", "maybe"]
    with ThreadPoolExecutor(6) as pool:
        objects = [
            pool.submit(chat, c, "Give the name and age of a person as JSON.", response_format={"type": "json_object"})
            for c in (client, aggregated_client)
        ]
        picks = [
            pool.submit(chat, client, "Is the sea salty?", extra_body={"guided_choice": choices}),
            pool.submit(
                chat, aggregated_client, "Is fire cold?", extra_body={"structured_outputs": {"choice": choices}}
            ),
        ]
        code = pool.submit(
            client.completions.create,
            model=model,
            prompt="My phone number is",
            max_tokens=12,
            temperature=0,
            extra_body={"guided_regex": r"\d{3}-\d{4}"},
        )
        for future in objects:
            choice = future.result().choices[0]
            assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
        assert all(f.result().choices[0].message.content in choices for f in picks)
        assert re.fullmatch(r"\d{3}-\d{4}", code.result().choices[0].text)
    for extra, param in [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "Hi", extra_body=extra)
        assert e.value.body["param"] == param, e.value.body


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_a_two_turn_get_weather_conversation_with_a_required_tool_call(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=model, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=48, temperature=0)

    def streamed_call():
        name, arguments, ids, finish = "", "", set(), None
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kwargs):
            for piece in chunk.choices[0].delta.tool_calls or []:
                assert piece.index == 0
                ids |= {piece.id} - {None}
                name += piece.function.name or ""
                arguments += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return name, arguments, ids, finish

    with ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(streamed_call)
        first = client.chat.completions.create(messages=messages, **kwargs).choices[0]
        name, arguments, ids, finish = streaming.result()
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    assert (name, json.loads(arguments), len(ids), finish) == (
        call.function.name,
        json.loads(call.function.arguments),
        1,
        "tool_calls",
    )
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius"})},
    ]
    second = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=24, temperature=0
    ).choices[0]
    assert second.message.content and not second.message.tool_calls
    assert second.finish_reason in ("stop", "length")


def test_logprobs_and_n_and_seed(client, model, offline_llm, tokenizer):
    response = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(
        len(top) == 2 and max(top.values()) == pytest.approx(first, abs=1e-5)
        for top, first in zip(lp.top_logprobs, lp.token_logprobs)
    )
    expected = offline(offline_llm, PROMPTS[0], 4, logprobs=2)
    assert lp.token_logprobs == pytest.approx([x.logprob for x in expected.logprobs], abs=1e-3)
    sampled = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=3, seed=7)
    again = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=3, seed=7)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert len({c.text for c in sampled.choices}) > 1  # each choice has its own seed
    assert sampled.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[1]))  # counted once for n choices
    assert 3 <= sampled.usage.completion_tokens <= 24


def test_repeated_prompt_reports_cached_prompt_tokens(client, model):
    prompt = "Tell me about the history of the bicycle. " * 12
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_disaggregated_equals_aggregated_equals_offline_on_8_prompts(cluster, offline_llm, tokenizer):
    decode_a, decode_b = decode_workers(cluster)
    prefill = cluster.services["prefill-0"]
    with ThreadPoolExecutor(2) as pool:  # one request at a time per worker, the two workers at once
        for i, text in enumerate(PROMPTS):
            prompt = tokenizer.encode(f"Request {i} of the parity test. {text}")
            disaggregated = pool.submit(call_decode, decode_a, prompt, prefill.grpc_endpoint, f"disagg-{i}")
            aggregated = pool.submit(call_decode, decode_b, prompt, "", f"agg-{i}")
            expected = offline(offline_llm, prompt, 12)
            (disaggregated, remote), (aggregated, local) = disaggregated.result(), aggregated.result()
            assert remote == len(prompt) and local == 0  # KV really came from the prefill worker
            assert disaggregated == aggregated == expected.token_ids


def test_seeded_sampling_is_the_same_disaggregated_aggregated_and_offline(cluster, offline_llm, tokenizer):
    """The prefill worker samples the first token from the seed; the decode worker continues
    the seed's stream (its generator is fast-forwarded past that draw)."""
    decode_a, decode_b = decode_workers(cluster)
    prefill = cluster.services["prefill-0"]
    for i in range(3):
        prompt = tokenizer.encode(f"Seeded request {i}: tell me a story about a dragon and a knight.")
        expected = offline(offline_llm, prompt, 12, temperature=1.0, seed=40 + i)
        sampling = {"temperature": 1.0, "seed": 40 + i}
        disaggregated, remote = call_decode(decode_a, prompt, prefill.grpc_endpoint, f"seeded-d{i}", **sampling)
        aggregated, _ = call_decode(decode_b, prompt, "", f"seeded-a{i}", **sampling)
        assert remote == len(prompt)
        assert disaggregated == aggregated == expected.token_ids


def test_a_failed_kv_transfer_falls_back_to_a_local_prefill_with_the_same_output(cluster, offline_llm, tokenizer):
    decode = decode_workers(cluster)[0]
    prompt = tokenizer.encode("Nobody listens on the prefill endpoint of this request, so it prefills locally.")
    expected = offline(offline_llm, prompt, 12)
    token_ids, remote = call_decode(decode, prompt, "127.0.0.1:1", "fallback-1")
    assert (token_ids, remote) == (expected.token_ids, 0)
    wait_until(lambda: load(decode).num_blocks_used == 0, message="the blocks freed")


def call_decode(worker, prompt: list[int], prefill_endpoint: str, request_id: str, **sampling) -> tuple[list[int], int]:
    sampling = {"temperature": 0.0, "max_tokens": 12, **sampling}
    request = decode_pb2.WorkerGenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        prefill_endpoint=prefill_endpoint,
        sampling=common_pb2.SamplingParams(**sampling),
    )
    token_ids, remote = [], None
    with grpc.insecure_channel(worker.grpc_endpoint) as channel:
        for message in decode_pb2_grpc.DecodeWorkerStub(channel).Generate(request, timeout=60):
            token_ids += message.token_ids
            remote = message.num_remote_prefill_tokens if remote is None else remote
    return token_ids, remote


def test_router_hash_chain_equals_the_blocks_the_worker_cached(cluster, tokenizer, redis_server):
    from moemesh.router.main import build_frontend
    from moemesh.router.settings import RouterSettings
    from moemesh.runtime.grpc_util import ChannelPool

    index = PrefixIndex(connect(redis_server.url), MESH)
    router = cluster.services["router"]
    frontend, _ = build_frontend(RouterSettings(), connect(redis_server.url), ChannelPool())  # the router's code path
    prompt = asyncio.run(frontend.tokenize("Parity of block keys between the router and the engine. " * 8))
    assert len(prompt) % 16 != 0
    chain = frontend.dispatcher.block_chain(prompt)
    assert len(chain) == len(prompt) // 16
    _, worker_id, usage = generate(router, prompt, max_tokens=2)
    assert usage.cached_tokens == 0
    wait_until(lambda: set(chain) <= index.worker_blocks(worker_id), message="the worker's blocks in the index")
    _, again_worker, usage = generate(router, prompt, max_tokens=2)
    assert again_worker == worker_id
    assert usage.cached_tokens == len(chain) * 16  # the engine reused exactly those blocks


def test_kv_aware_sends_a_shared_prefix_to_the_worker_holding_it_and_round_robin_does_not(cluster, tokenizer):
    kv_router, rr_router = cluster.services["router"], cluster.services["router-rr"]
    decode = {w.name: w for w in decode_workers(cluster)}

    def run(router, topic: str) -> tuple[list[str], dict[str, int]]:
        system = tokenizer.encode(f"You are an expert on {topic}. Answer every question about {topic} carefully. " * 6)
        hits_before = {name: load(w).prefix_cache_hits for name, w in decode.items()}
        served = [generate(router, system + tokenizer.encode(f" Question {q}:"), max_tokens=2)[1] for q in range(6)]
        hits = {name: load(w).prefix_cache_hits - hits_before[name] for name, w in decode.items()}
        return served, hits, len(system)

    served, hits, prefix_len = run(kv_router, "volcanoes")
    assert len(set(served)) == 1
    holder = served[0]
    assert hits[holder] >= 5 * (prefix_len // 16) * 16  # every later request reused the prefix
    assert sum(hits.values()) == hits[holder]
    served, hits, prefix_len = run(rr_router, "glaciers")
    assert set(served) == set(decode)  # spread over both workers, holder or not
    assert sum(hits.values()) < 5 * (prefix_len // 16) * 16


def test_bad_input_gets_openai_errors_and_the_service_keeps_serving(cluster, client, model):
    raw = httpx.post(
        cluster.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    cases = [
        (404, "model", lambda: client.completions.create(model="no-such-model", prompt="hi")),
        (400, "max_tokens", lambda: client.completions.create(model=model, prompt="hi", max_tokens=-3)),
        (400, "prompt", lambda: client.completions.create(model=model, prompt="word " * 1100, max_tokens=4)),
        (400, "messages", lambda: client.chat.completions.create(model=model, messages=[])),
        (400, "temperature", lambda: client.completions.create(model=model, prompt="hi", temperature=-1)),
    ]
    for status, param, call in cases:
        with pytest.raises(openai.APIStatusError) as error:
            call()
        assert (error.value.status_code, error.value.body["param"]) == (status, param), error.value.body
        assert error.value.body["message"]
    assert client.completions.create(model=model, prompt="Still alive?", max_tokens=2).choices[0].text


def test_health_and_prometheus_metrics_on_every_service(cluster, client, model, tokenizer):
    decodes = decode_workers(cluster)

    def decode_samples() -> dict:
        totals: dict = {}
        for worker in decodes:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(worker)}/metrics").read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    key = (sample.name, sample.labels.get("finished_reason"))
                    totals[key] = totals.get(key, 0.0) + sample.value
        return totals

    before = decode_samples()
    client.completions.create(
        model=model, prompt=PROMPTS[3], max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    after = decode_samples()

    def moved(name: str, reason: str | None = None) -> float:
        return after.get((name, reason), 0.0) - before.get((name, reason), 0.0)

    assert moved("vllm:request_success_total", "length") == 1
    assert moved("vllm:prompt_tokens_total") == len(tokenizer.encode(PROMPTS[3]))
    assert moved("vllm:generation_tokens_total") == 2
    for name in (
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
        "request_inference_time",
        "time_to_first_token",
    ):
        assert moved(f"vllm:{name}_seconds_count") == 1, name
    assert moved("vllm:e2e_request_latency_seconds_sum") >= moved("vllm:request_decode_time_seconds_sum") > 0
    assert moved("vllm:request_generation_tokens_sum") == 2

    health = json.loads(urllib.request.urlopen(cluster.url + "/health").read())
    assert health == {"status": "ok", "decode_workers": 2}
    router_metrics = urllib.request.urlopen(cluster.url + "/metrics").read().decode()
    for name in (
        "moemesh:router_time_to_first_token_seconds_bucket",
        "moemesh:router_routed_total",
        "moemesh:router_redis_up",
        "moemesh:router_decision_seconds_bucket",
    ):
        assert name in router_metrics
    for worker in workers(cluster):
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(worker)}/metrics").read().decode()
        for name in (
            "vllm:num_requests_waiting{",
            "vllm:num_requests_running{",
            "vllm:kv_cache_usage_perc{",
            "vllm:prefix_cache_hits_total{",
            "vllm:time_to_first_token_seconds_bucket{",
        ):
            assert name in text, (worker.name, name)
        assert 'vllm:time_to_first_token_seconds_bucket{le="2560.0"' in text  # vLLM's TTFT range
        assert f'model_name="{model}"' in text  # the router's label
    decode_text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(decodes[0])}/metrics").read()
    assert b"vllm:inter_token_latency_seconds_bucket{" in decode_text


def test_traces_follow_a_request_from_router_to_decode_to_prefill(cluster):
    spans = []
    for service in cluster.services.values():
        with open(service.log_path.replace(".log", ".jsonl")) as f:
            spans += [json.loads(line) for line in f]
    by_id = {s["span_id"]: s for s in spans}

    def service_of_parent(span):
        parent = by_id.get(span["parent_id"])
        return (parent["service"], parent["name"]) if parent else None

    prefill = [s for s in spans if s["name"] == "prefill"]
    assert prefill, "no prefill spans"
    chains = []
    for span in prefill:
        transfer = by_id.get(span["parent_id"])
        decode = by_id.get(transfer["parent_id"]) if transfer else None
        router = by_id.get(decode["parent_id"]) if decode else None
        if router:
            chains.append(
                (
                    router["service"],
                    router["name"],
                    decode["service"],
                    decode["name"],
                    transfer["name"],
                    span["service"],
                )
            )
            assert router["trace_id"] == decode["trace_id"] == span["trace_id"]
    assert (
        "moemesh-router",
        "router.generate",
        "moemesh-decode",
        "decode.generate",
        "kv_transfer",
        "moemesh-prefill",
    ) in chains
    assert {"queue", "queue+prefill", "decode"} <= {s["name"] for s in spans if s["service"] == "moemesh-decode"}


def test_every_service_exports_its_spans_over_otlp_to_a_collector(cluster, collector):
    """The same spans reach a real OTLP/gRPC collector, with the trace linked across services."""

    def linked_chain():
        spans = collector.snapshot()
        by_id = {s.span_id: s for s in spans}
        for span in spans:
            if span.name != "prefill":
                continue
            transfer = by_id.get(span.parent_id)
            decode = by_id.get(transfer.parent_id) if transfer else None
            router = by_id.get(decode.parent_id) if decode else None
            if router and router.trace_id == decode.trace_id == span.trace_id:
                return router.service, decode.service, transfer.name, span.service
        return None

    chain = wait_until(linked_chain, message="a linked router -> decode -> prefill trace over OTLP")
    assert chain == ("moemesh-router", "moemesh-decode", "kv_transfer", "moemesh-prefill")


def test_no_blocks_or_requests_leak_after_200_requests_including_cancelled_ones(cluster, model):
    async def scenario():
        client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        semaphore = asyncio.Semaphore(12)

        async def one(i: int) -> str:
            async with semaphore:
                prompt = f"Request number {i}: tell me something about the number {i}."
                kind = i % 5
                if kind == 0:  # stream, cancelled after the first chunk
                    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=64, stream=True)
                    async for _ in stream:
                        break
                    await stream.close()
                    return "cancelled"
                if kind == 1:  # plain request, client gives up before the end
                    impatient = client.with_options(timeout=0.3)
                    try:
                        await impatient.completions.create(
                            model=model, prompt=prompt, max_tokens=200, extra_body={"ignore_eos": True}
                        )
                    except openai.APITimeoutError:
                        return "timed out"
                    return "finished"
                stop = ["e"] if kind == 2 else None
                response = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=4, stop=stop, temperature=0.7, stream=kind == 3
                )
                if kind == 3:
                    async for _ in response:
                        pass
                return "finished"

        outcomes = await asyncio.gather(*[one(i) for i in range(200)])
        await client.close()
        return outcomes

    outcomes = asyncio.run(scenario())
    assert outcomes.count("cancelled") == 40 and len(outcomes) == 200

    def idle() -> bool:
        reports = [load_any(w) for w in workers(cluster)]
        return all(
            r.num_blocks_used == 0 and r.num_running == 0 and r.num_waiting == 0 and r.num_waiting_for_kv == 0
            for r in reports
        )

    wait_until(idle, message="every worker back to zero blocks in use")
    metrics = urllib.request.urlopen(cluster.url + "/metrics").read().decode()
    assert 'vllm:num_requests_running{model_name="SmolLM2-135M-Instruct.Q4_1"} 0.0' in metrics


def test_256_concurrent_streams_against_64_in_flight_each_complete_or_get_429_with_retry_after(cluster, model):
    router = cluster.add_router("router-load", "kv_aware", (*ROUTER_ARGS, "--max-in-flight", "64"))

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 4, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:
                error = json.loads(await response.aread())["error"]
                assert error["type"] == "rate_limit_exceeded" and response.headers["retry-after"] == "1", error
                return "429"
            assert response.status_code == 200, await response.aread()
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and all("error" not in e for e in events), events
            return "ok"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=256)
        timeout = httpx.Timeout(300.0)  # every client gives up eventually: none may hang
        async with httpx.AsyncClient(base_url=router.http_url, limits=limits, timeout=timeout) as client:
            return await asyncio.gather(*(one(client, i) for i in range(256)))

    outcomes = asyncio.run(run())
    assert set(outcomes) <= {"ok", "429"} and outcomes.count("ok") >= 64, collections.Counter(outcomes)
    cluster.stop_service("router-load")


def test_a_20_mb_body_gets_413_and_a_concurrent_stream_keeps_flowing(cluster, model):
    async def run() -> tuple[int, list[float]]:
        started = asyncio.Event()
        times: list[float] = []

        async def stream(client: httpx.AsyncClient) -> None:
            body = {
                "model": model,
                "prompt": PROMPTS[0],
                "max_tokens": 48,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            }
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        times.append(time.monotonic())
                        if len(times) == 4:
                            started.set()

        async def huge(client: httpx.AsyncClient) -> int:
            await started.wait()
            content = json.dumps({"model": model, "prompt": "a" * (20 << 20)}).encode()
            response = await client.post(
                "/v1/completions", content=content, headers={"content-type": "application/json"}
            )
            return response.status_code

        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as client:
            _, status = await asyncio.gather(stream(client), huge(client))
        return status, times

    status, times = asyncio.run(run())
    assert status == 413
    gaps = [b - a for a, b in zip(times[3:], times[4:])]
    assert len(times) > 40 and max(gaps) < 1.0, gaps


def test_a_router_with_api_keys_answers_401_without_one_and_200_with_one(cluster, model):
    router = cluster.add_router("router-keys", "kv_aware", (*ROUTER_ARGS, "--api-key", "sk-one", "--api-key", "sk-two"))
    base = router.http_url + "/v1"
    for key in ("", "sk-wrong"):
        anonymous = openai.OpenAI(base_url=base, api_key=key or "unset", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as denied:
            anonymous.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert denied.value.status_code == 401 and denied.value.body["code"] == "invalid_api_key"
    for key in ("sk-one", "sk-two"):
        allowed = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        assert allowed.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text is not None
    assert urllib.request.urlopen(router.http_url + "/health").status == 200  # probes need no key
    cluster.stop_service("router-keys")
