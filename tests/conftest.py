"""Shared fixtures: the default model and its Hugging Face oracle, loaded once per session, and
the real redis-server of the session (tests/redis_process.py) with a per-test client.

In-process engines resolve dtype "auto" as on a CPU without native bf16 (float32, GGUF weights
dequantized at load), whatever machine runs the suite: the oracle tests compare against float32
Hugging Face. Tests of bf16 / quantized paths ask for them explicitly; tests of the resolution
patch the flags themselves. Service tests start their workers with --dtype float32."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _auto_dtype_is_float32():
    from moemesh.engine import dtype

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dtype, "cpu_flags", lambda: frozenset())
        yield


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from moemesh.engine.loader import default_model_path

    return default_model_path()


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers' GGUF loading parses the file's metadata once per call (twice per model) and
    rebuilds gguf's tensor-name map for every module it visits (~400 times): about 20 s of the
    oracle's load on a CPU. Both are pure functions of their arguments, so memoise them while
    the oracle loads; the weights and the tokenizer come out exactly as without."""
    import gguf

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _memoised(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", _memoised(gguf.get_tensor_name_map))
        yield


@functools.cache
def _memoised(function):  # one memo per function for the session: the tokenizer reuses the model's parse
    return functools.cache(function)


@pytest.fixture(scope="session")
def hf_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    with _gguf_parsed_once():
        return AutoTokenizer.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))


@pytest.fixture(scope="session")
def hf_model(smollm_path):
    import torch
    from transformers import AutoModelForCausalLM

    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def smollm(smollm_path):
    """One float32 engine with default settings, shared by tests that do not change config."""
    from moemesh import LLM

    return LLM(smollm_path, dtype="float32", show_progress=False)


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server shared by the session (tests/redis_process.py). Tests that use it
    directly keep to their own mesh id; `redis_client` flushes it around each test."""
    from tests.redis_process import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_port(redis_server) -> int:
    return redis_server.port


@pytest.fixture()
def redis_client(redis_server):
    """A client of the session's redis-server, on an empty database (flushed before and after)."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.flushall()
    client.close()
