"""The router's boundary, in process (no workers): OpenAI error objects with the right status for
bad input (unknown fields, integers past protobuf's range, lone surrogates, over-context
requests, huge bodies), an unknown model, overload (429) and no healthy worker (503), API keys,
/tokenize and friends, on HTTP and gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import importlib.metadata
import json
import threading
import time

import grpc
import httpx
import pytest
import uvicorn

from moemesh.contracts import registry
from moemesh.contracts.redis_client import connect
from moemesh.proto.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from moemesh.router.api_keys import ApiKeys
from moemesh.router.dispatcher import Delta, WorkerFailedError
from moemesh.router.frontend import ChoiceDelta
from moemesh.router.grpc_api import GenerateServicer
from moemesh.router.http_api import build_app
from moemesh.router.http_guard import GuardSettings
from moemesh.router.main import HTTP_KEEP_ALIVE_S, build_frontend, http_server_config
from moemesh.router.settings import RouterSettings
from moemesh.runtime.grpc_util import ChannelPool, HealthReporter, create_server
from moemesh.runtime.settings import MeshSettings

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def make_frontend(redis_server, max_in_flight: int = 8, max_model_len: int | None = None):
    settings = RouterSettings(
        max_in_flight=max_in_flight,
        max_model_len=max_model_len,
        mesh=MeshSettings(mesh="nobody-here", redis_url=redis_server.url),
    )
    frontend, pool = build_frontend(settings, connect(redis_server.url), ChannelPool())
    return frontend, pool


def post(app, path: str, **kwargs) -> httpx.Response:
    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.post(path, **kwargs)

    return asyncio.run(call())


@pytest.fixture(scope="module")
def app(redis_server):
    frontend, pool = make_frontend(redis_server)
    return build_app(frontend, lambda: len(pool.live(("decode", "both"))))


def assert_error(response: httpx.Response, status: int, param: str | None, error_type: str = "invalid_request_error"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == (error_type, param), error
    assert error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi"}, "model"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", ""]}, "stop"),
        ({"model": MODEL, "prompt": "hi", "echo": True}, "echo"),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": MODEL, "prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
        ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {str(2**31): 1}}, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "min_tokens": 2**31}, "min_tokens"),
        ({"model": MODEL, "prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"model": MODEL, "prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
        ({"model": MODEL, "prompt": "hi", "guided_choice": []}, "guided_choice"),
        ({"model": MODEL, "prompt": "hi", "guided_json": "{oops"}, "guided_json"),
        (
            {"model": MODEL, "prompt": "hi", "guided_regex": "a", "structured_outputs": {"json_object": True}},
            "structured_outputs",
        ),
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": [1, 2, 10**9]}, "prompt"),
        # past protobuf's integer ranges: a 400 naming the field, never a 500
        ({"model": MODEL, "prompt": "hi", "max_tokens": 2**31}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 1e9}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "top_k": 2**31}, "top_k"),
        ({"model": MODEL, "prompt": "hi", "seed": 2**63}, "seed"),
        ({"model": MODEL, "prompt": "hi", "seed": -(2**63) - 1}, "seed"),
        ({"model": MODEL, "prompt": "hi", "stop_token_ids": [2**31]}, "stop_token_ids"),
        # unknown fields, and documented extras with a value that would change something
        ({"model": MODEL, "prompt": "hi", "temprature": 0.5}, "temprature"),
        ({"model": MODEL, "prompt": "hi", "use_beam_search": True}, "use_beam_search"),
        ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ],
)
def test_invalid_completion_requests_get_400_naming_the_field(app, body, param):
    assert_error(post(app, "/v1/completions", json=body), 400, param)


def test_invalid_chat_requests_get_400(app):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(app, "/v1/chat/completions", json={"model": MODEL, "messages": image}), 400, "messages")
    assert_error(
        post(app, "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard"}]}), 400, "messages"
    )
    hi = [{"role": "user", "content": "hi"}]
    assert_error(
        post(app, "/v1/chat/completions", json={"model": MODEL, "messages": hi, "tool_choice": "required"}),
        400,
        "tool_choice",
    )
    bad_call = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
    assert_error(post(app, "/v1/chat/completions", json={"model": MODEL, "messages": bad_call}), 400, "messages")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"model": "%s", "prompt": "\\ud800abc"}', "prompt"),
        ("/v1/completions", '{"model": "%s", "prompt": "hi", "stop": ["\\udfff"]}', "stop"),
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800"}]}', "messages"),
    ],
)
def test_a_lone_surrogate_in_any_text_gets_400_naming_the_field(app, path, body, param):
    response = post(app, path, content=(body % MODEL).encode(), headers={"content-type": "application/json"})
    assert_error(response, 400, param)


def test_documented_extras_with_their_default_values_are_accepted(app):
    body = {
        "model": MODEL,
        "prompt": "hi",
        "skip_special_tokens": True,
        "use_beam_search": False,
        "store": False,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "user": "u",
    }
    assert_error(post(app, "/v1/completions", json=body), 503, None, "service_unavailable")  # validated, then routed


def test_prompt_plus_max_tokens_over_the_context_gets_400_with_both_numbers(redis_server, tokenizer):
    frontend, _ = make_frontend(redis_server, max_model_len=64)
    app = build_app(frontend, lambda: 0)
    prompt = "The capital of France is"
    num_prompt = len(tokenizer.encode(prompt))
    response = post(app, "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 64 - num_prompt + 1})
    assert_error(response, 400, "max_tokens")
    message = response.json()["error"]["message"]
    assert f"{num_prompt} in the prompt" in message and f"{64 - num_prompt + 1} to generate" in message
    assert "holds 64 tokens" in message
    fits = {"model": MODEL, "prompt": prompt, "max_tokens": 64 - num_prompt}
    assert_error(post(app, "/v1/completions", json=fits), 503, None, "service_unavailable")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}  # default: the rest of the context
    assert_error(post(app, "/v1/chat/completions", json=chat), 503, None, "service_unavailable")


def test_a_text_too_long_for_any_tokenization_is_refused_without_tokenizing(redis_server, monkeypatch):
    frontend, _ = make_frontend(redis_server, max_model_len=64)
    app = build_app(frontend, lambda: 0)
    monkeypatch.setattr(frontend.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    longest = max(len(p.encode()) for p in frontend.tokenizer.backend.get_vocab())
    response = post(app, "/v1/completions", json={"model": MODEL, "prompt": "a" * (64 * longest + 1)})
    assert_error(response, 400, "prompt")


def test_bodies_over_the_limit_get_413_declared_or_chunked(redis_server):
    frontend, _ = make_frontend(redis_server)
    app = build_app(frontend, lambda: 0, GuardSettings(max_body_bytes=1000))
    body = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()
    assert_error(post(app, "/v1/completions", content=body, headers={"content-type": "application/json"}), 413, None)

    async def chunks():
        for i in range(0, len(body), 100):
            yield body[i : i + 100]

    response = post(app, "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413, None)


def test_429_and_503_tell_the_client_when_to_retry(redis_server):
    frontend, _ = make_frontend(redis_server, max_in_flight=1)
    app = build_app(frontend, lambda: 0)
    assert post(app, "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2}).headers["retry-after"] == "1"
    assert post(app, "/v1/completions", json={"model": MODEL, "prompt": "hi"}).headers["retry-after"] == "1"


def test_api_keys_guard_every_path_but_the_open_ones_on_http_and_grpc(redis_server):
    frontend, _ = make_frontend(redis_server)
    app = build_app(frontend, lambda: 0, GuardSettings(api_keys=("k1", "k2")))
    body = {"model": MODEL, "prompt": "hi"}
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k1"}, {"authorization": "k1"}):
        response = post(app, "/v1/completions", json=body, headers=headers)
        assert_error(response, 401, None)
        assert response.json()["error"]["code"] == "invalid_api_key"
    for key in ("k1", "k2"):  # a valid key gets through to routing (no worker here: 503)
        response = post(app, "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
        assert_error(response, 503, None, "service_unavailable")
    assert get(app, "/v1/models").status_code == 401
    assert get(app, "/health").status_code == 503 and get(app, "/metrics").status_code == 200  # open
    closed = build_app(frontend, lambda: 0, GuardSettings(api_keys=("k1",), open_paths=()))
    assert get(closed, "/metrics").status_code == 401

    async def grpc_codes():
        server, port = create_server("127.0.0.1", 0, HealthReporter([]))
        generate_pb2_grpc.add_GenerateServicer_to_server(GenerateServicer(frontend, ApiKeys(["k1"])), server)
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generate_pb2_grpc.GenerateStub(channel)
                request = generate_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=4))
                for metadata in ((), (("authorization", "Bearer k1"),)):
                    try:
                        async for _ in stub.Generate(request, metadata=metadata):
                            pass
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
        finally:
            await server.stop(None)
        return codes

    assert asyncio.run(grpc_codes()) == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE]


def test_tokenize_detokenize_and_version(app, tokenizer):
    text = "Hello, wonderful world!"
    response = post(app, "/tokenize", json={"model": MODEL, "prompt": text})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == tokenizer.encode(text) and response.json()["count"] == len(
        tokenizer.encode(text)
    )
    plain = post(app, "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert post(app, "/detokenize", json={"tokens": plain}).json() == {"prompt": text}
    chat = post(app, "/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()["tokens"]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    assert chat == tokenizer.encode(rendered, add_special_tokens=False)
    assert_error(post(app, "/tokenize", json={"prompt": text, "messages": []}), 400, "prompt")
    assert_error(post(app, "/tokenize", json={"prompt": text, "extra": 1}), 400, "extra")
    assert_error(post(app, "/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert get(app, "/version").json()["version"] == importlib.metadata.version("moemesh")


def test_a_stream_that_fails_sends_an_error_event_then_done(redis_server, monkeypatch):
    frontend, _ = make_frontend(redis_server)
    app = build_app(frontend, lambda: 1)

    async def failing_run(inputs):
        yield ChoiceDelta(0, 0, Delta(text="Hi", token_ids=[1]))
        raise WorkerFailedError("decode-0 failed after 1 token")

    monkeypatch.setattr(frontend, "run", failing_run)
    response = post(app, "/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "Hi"
    assert json.loads(events[1])["error"]["type"] == "service_unavailable"
    assert events[2:] == ["[DONE]"]


def test_a_bug_in_a_route_is_an_openai_500_and_the_connection_stays_open(redis_server, monkeypatch):
    frontend, _ = make_frontend(redis_server)

    async def broken(prompt, add_special_tokens=True):
        raise RuntimeError("a bug")

    monkeypatch.setattr(frontend, "tokenize", broken)
    with serve_http(build_app(frontend, lambda: 0)) as port:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = json.dumps({"model": MODEL, "prompt": "hi"})
        connection.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 500 and json.loads(response.read())["error"]["type"] == "server_error"
        assert response.getheader("connection") != "close"
        connection.request("GET", "/v1/models")  # the same kept-alive connection
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["data"][0]["id"] == MODEL
        connection.close()


def test_an_idle_kept_alive_connection_outlives_the_clients_idle_expiry(redis_server):
    """httpx (and the openai client) drop idle connections after 5 s; the router keeps them longer,
    so a request sent on a connection idle for just over 5 s is answered, not reset."""
    frontend, pool = make_frontend(redis_server)
    assert HTTP_KEEP_ALIVE_S > 60
    with serve_http(build_app(frontend, lambda: len(pool.live(("decode", "both"))))) as port:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for idle in (0.0, 6.0):  # uvicorn's own default would have closed it at 5 s
            time.sleep(idle)
            connection.request("GET", "/v1/models")
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["data"][0]["id"] == MODEL
        connection.close()


@contextlib.contextmanager
def serve_http(app):
    """`app` on a real uvicorn server configured as the router's (main.http_server_config) on a
    free loopback port, in a thread."""
    server = uvicorn.Server(http_server_config(app, RouterSettings(host="127.0.0.1", http_port=0)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def get(app, path: str, **kwargs) -> httpx.Response:
    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.get(path, **kwargs)

    return asyncio.run(call())


def test_health_follows_the_registry_ttl_when_the_last_decode_worker_dies_and_comes_back(redis_server):
    ttl = 2.0
    mesh = MeshSettings(mesh="health-ttl", redis_url=redis_server.url, heartbeat_ttl_s=60.0)  # the grace: 60 s
    frontend, pool = build_frontend(
        RouterSettings(router_id="router-h", mesh=mesh), connect(redis_server.url), ChannelPool()
    )
    app = build_app(frontend, lambda: len(pool.live(("decode", "both"))))
    client = connect(redis_server.url)
    registry.heartbeat(client, mesh.mesh, registry.WorkerRecord("router-h", "router", "127.0.0.1:1", MODEL), 60.0)
    decode = registry.WorkerRecord("decode-h", "decode", "127.0.0.1:2", MODEL)

    async def health_after_refresh() -> int:
        await pool.refresh()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            return (await http.get("/health")).status_code

    registry.heartbeat(client, mesh.mesh, decode, ttl)
    last_beat = time.monotonic()
    assert asyncio.run(health_after_refresh()) == 200
    while asyncio.run(health_after_refresh()) == 200:  # the worker is gone: no more heartbeats
        assert time.monotonic() - last_beat < 60, "/health stayed 200"
    assert time.monotonic() - last_beat <= ttl + 4.0  # its TTL, plus slack for a loaded machine (no 60 s grace)
    registry.heartbeat(client, mesh.mesh, decode, 60.0)  # a decode worker comes back
    assert asyncio.run(health_after_refresh()) == 200
    pool.down_s = 0.0  # a failed call: down until the worker heartbeats again, however short down_s is
    pool.mark_down(pool.workers["decode-h"])
    assert asyncio.run(health_after_refresh()) == 503
    registry.heartbeat(client, mesh.mesh, decode, 60.0)
    assert asyncio.run(health_after_refresh()) == 200


def test_malformed_json_gets_400(app):
    response = post(app, "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert_error(response, 400, None)
    assert "JSON" in response.json()["error"]["message"]


def test_unknown_model_gets_404(app):
    response = post(app, "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert_error(response, 404, "model")
    assert response.json()["error"]["code"] == "model_not_found"


def test_no_healthy_worker_gets_503_also_for_streams(app):
    for stream in (False, True):
        response = post(app, "/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": stream})
        assert_error(response, 503, None, "service_unavailable")

    async def health():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.get("/health")

    assert asyncio.run(health()).status_code == 503


def test_too_many_requests_in_flight_gets_429(redis_server):
    frontend, pool = make_frontend(redis_server, max_in_flight=1)
    app = build_app(frontend, lambda: 0)
    response = post(app, "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2})
    assert_error(response, 429, None, "rate_limit_exceeded")


def test_grpc_generate_maps_errors_to_status_codes(redis_server):
    frontend, _ = make_frontend(redis_server)

    async def scenario():
        server, port = create_server("127.0.0.1", 0, HealthReporter([]))
        generate_pb2_grpc.add_GenerateServicer_to_server(GenerateServicer(frontend), server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generate_pb2_grpc.GenerateStub(channel)
                codes = []
                for request in (
                    generate_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=0)),
                    generate_pb2.GenerateRequest(model="gpt-9", text="hi"),
                    generate_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=4)),
                ):
                    try:
                        async for _ in stub.Generate(request):
                            pass
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
                return codes
        finally:
            await server.stop(None)

    assert asyncio.run(scenario()) == [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAVAILABLE,
    ]
