"""The router's boundary, in process (no workers): OpenAI error objects with the right status for
bad input, an unknown model, overload (429) and no healthy worker (503), on HTTP and gRPC."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from moemesh.common.grpc_util import ChannelPool, HealthReporter, create_server
from moemesh.common.redis_client import connect
from moemesh.common.settings import MeshSettings
from moemesh.proto.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from moemesh.router.grpc_api import GenerateServicer
from moemesh.router.http_api import build_app
from moemesh.router.main import build_frontend
from moemesh.router.settings import RouterSettings

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def make_frontend(redis_server, max_in_flight: int = 8):
    settings = RouterSettings(
        max_in_flight=max_in_flight, mesh=MeshSettings(mesh="nobody-here", redis_url=redis_server.url)
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
    ],
)
def test_invalid_completion_requests_get_400_naming_the_field(app, body, param):
    assert_error(post(app, "/v1/completions", json=body), 400, param)


def test_invalid_chat_requests_get_400(app):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(app, "/v1/chat/completions", json={"model": MODEL, "messages": image}), 400, "messages")
    assert_error(post(app, "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard"}]}),
                 400, "messages")  # fmt: skip
    hi = [{"role": "user", "content": "hi"}]
    assert_error(post(app, "/v1/chat/completions", json={"model": MODEL, "messages": hi, "tool_choice": "required"}),
                 400, "tool_choice")  # fmt: skip
    bad_call = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
    assert_error(post(app, "/v1/chat/completions", json={"model": MODEL, "messages": bad_call}), 400, "messages")


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
