"""Schemathesis over the router's own OpenAPI document (in process, the workers replaced by one
that answers every choice with one token): whatever the generated requests hold, no answer is a
5xx, and the router still serves afterwards."""

from __future__ import annotations

import itertools

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from moemesh.router.dispatcher import Delta
from moemesh.router.frontend import ChoiceDelta
from moemesh.router.http_api import build_app
from tests.services.test_router_errors import MODEL, make_frontend, post


@pytest.fixture(scope="module")
def fuzzed_app(redis_server):
    frontend, _ = make_frontend(redis_server, max_in_flight=64, max_model_len=256)

    async def one_token_each(inputs):  # stands in for the workers: the boundary is what is fuzzed
        for index, (prompt_index, _) in enumerate(inputs):
            yield ChoiceDelta(
                index, prompt_index, Delta("x", [1], finish_reason="length", num_prompt_tokens=1, num_output_tokens=1)
            )

    frontend.run = one_token_each
    return build_app(frontend, lambda: 1)


@pytest.fixture(scope="module")
def router_schema(fuzzed_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)


def test_no_generated_request_gets_a_5xx(router_schema):
    operations = [result.ok() for result in router_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    for operation, mode in itertools.product(operations, GenerationMode):  # valid, then schema-violating data
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # nothing to violate: no body, no parameters

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_5xx(case):
            if isinstance(case.body, dict) and "model" in case.body and case.body["model"] != MODEL:
                case.body["model"] = MODEL  # mostly the served model, or most requests end at the 404
            response = case.call()
            assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text)

        no_5xx()


def test_the_router_still_serves_after_the_fuzzing(fuzzed_app):
    response = post(fuzzed_app, "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "x"
