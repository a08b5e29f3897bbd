"""The router and the engine accept and refuse the same sampling parameters. Each value goes
through the router's HTTP API (its request model, the engine's SamplingParams built from it, the
prompt checks) and through the engine's own validation (SamplingParams, then its
InputProcessor): both accept it, or both refuse it naming the same field."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from moemesh.contracts.sampling import BOUNDS, INT32_MAX, INT64_MAX, INT64_MIN
from moemesh.engine.errors import InvalidRequestError
from moemesh.engine.sampling_params import SamplingParams
from moemesh.proto.v1 import common_pb2, generate_pb2
from moemesh.router.dispatcher import InvalidRequest
from moemesh.router.grpc_api import GenerateServicer
from moemesh.router.http_api import build_app
from tests.services.test_router_errors import MODEL, make_frontend, post

PROMPT = "The capital of France is"
MAX_TOKENS = 4
VOCAB = 49152  # SmolLM2's

# field -> (accepted values, refused values), as a client sends them in JSON
CASES: dict[str, tuple[list, list]] = {
    "temperature": ([0.0, 0.7, 2.0], [-0.1, 2.5, math.nan]),
    "top_p": ([1e-6, 0.5, 1.0], [0.0, -0.1, 1.5, math.nan]),
    "top_k": ([-1, 0, 1, 40, INT32_MAX], [-2, INT32_MAX + 1]),
    "min_p": ([0.0, 0.05, 1.0], [-0.01, 1.01]),
    "seed": ([INT64_MIN, 0, INT64_MAX], [INT64_MIN - 1, INT64_MAX + 1]),
    "max_tokens": ([1, MAX_TOKENS], [0, -1, INT32_MAX + 1]),  # the context: below
    "min_tokens": ([0, MAX_TOKENS], [-1, MAX_TOKENS + 1, INT32_MAX + 1]),
    "logprobs": ([0, 5, 20], [-1, 21]),
    "presence_penalty": ([-2.0, 0.5, 2.0], [-2.01, 2.5]),
    "frequency_penalty": ([-2.0, 0.5, 2.0], [-2.01, 2.5]),
    "repetition_penalty": ([0.5, 1.0, 2.0], [0.0, -1.0, 2.01]),
    "logit_bias": (
        [{"5": 100.0}, {"5": -100.0}, {str(VOCAB - 1): 1.0}],
        [{"5": 100.5}, {"5": -101.0}, {str(VOCAB): 1.0}, {str(INT32_MAX + 1): 1.0}],
    ),
    "stop_token_ids": ([[0], [INT32_MAX]], [[-1], [INT32_MAX + 1]]),
    "stop": ([["a"], "x"], [[""], ["a", ""]]),
}
VERDICTS = [(field, value, True) for field, (ok, _) in CASES.items() for value in ok] + [
    (field, value, False) for field, (_, bad) in CASES.items() for value in bad
]


@pytest.fixture(scope="module")
def engine(offline_llm):
    return offline_llm.engine


@pytest.fixture(scope="module")
def frontend(redis_server, engine):
    frontend, _ = make_frontend(redis_server, max_model_len=engine.max_model_len)
    assert (frontend.max_model_len, frontend.vocab_size) == (engine.max_model_len, engine.model.cfg.vocab_size)
    return frontend


@pytest.fixture(scope="module")
def app(frontend):
    return build_app(frontend, lambda: 0)  # no decode worker: an accepted request ends in a 503


def router_verdict(app, body: dict) -> str | None:
    """None: accepted (validated, then routed); else the field its 400 names."""
    content = json.dumps({"model": MODEL, "prompt": PROMPT, **body})  # NaN as JavaScript writes it
    response = post(app, "/v1/completions", content=content.encode(), headers={"content-type": "application/json"})
    if response.status_code == 503:
        return None
    assert response.status_code == 400, response.text
    return response.json()["error"]["param"]


def engine_verdict(engine, body: dict) -> str | None:
    """None: accepted by the engine's validation (nothing is queued); else the field it names."""
    kwargs = dict(body)
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
    try:
        engine.input_processor.process(PROMPT, SamplingParams(**kwargs))
    except InvalidRequestError as e:
        return e.param
    return None


def test_the_table_covers_every_bounded_field():
    assert set(CASES) >= set(BOUNDS) - {"token_id"}  # token ids: stop_token_ids and logit_bias keys


@pytest.mark.parametrize(("field", "value", "accepted"), VERDICTS, ids=[f"{f}={v!r}" for f, v, _ in VERDICTS])
def test_router_and_engine_accept_and_refuse_the_same_values(app, engine, field, value, accepted):
    body = {"max_tokens": MAX_TOKENS, field: value}
    router, ours = router_verdict(app, body), engine_verdict(engine, body)
    assert router == ours == (None if accepted else field)


def test_max_tokens_up_to_the_rest_of_the_context_and_not_one_more(app, engine):
    room = engine.max_model_len - len(engine.tokenizer.encode(PROMPT))
    assert router_verdict(app, {"max_tokens": room}) is engine_verdict(engine, {"max_tokens": room}) is None
    over = {"max_tokens": room + 1}
    assert router_verdict(app, over) == engine_verdict(engine, over) == "max_tokens"


def test_the_grpc_api_checks_sampling_with_the_same_bounds(frontend, engine):
    servicer = GenerateServicer(frontend)

    def grpc_verdict(**sampling) -> str | None:
        request = generate_pb2.GenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(**sampling))
        try:
            asyncio.run(servicer._input(request))
        except InvalidRequest as e:
            return e.param
        return None

    room = engine.max_model_len - len(engine.tokenizer.encode(PROMPT))
    assert grpc_verdict(max_tokens=MAX_TOKENS, temperature=2.0) is None
    assert grpc_verdict(max_tokens=MAX_TOKENS, temperature=2.5) == "temperature"
    assert grpc_verdict(max_tokens=MAX_TOKENS, top_k=-2) == "top_k"
    assert grpc_verdict(max_tokens=MAX_TOKENS, repetition_penalty=2.5) == "repetition_penalty"
    assert grpc_verdict(max_tokens=MAX_TOKENS, logit_bias={VOCAB: 1.0}) == "logit_bias"
    assert grpc_verdict(max_tokens=room) is None
    assert grpc_verdict(max_tokens=room + 1) == "max_tokens"
    assert grpc_verdict(max_tokens=0) == "max_tokens"
