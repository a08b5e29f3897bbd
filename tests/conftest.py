"""Shared fixtures: the default model and its Hugging Face oracle, loaded once per session."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from moemesh.engine.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))


@pytest.fixture(scope="session")
def hf_model(smollm_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm(smollm_path):
    """One float32 engine with default settings, shared by tests that do not change config."""
    from moemesh import LLM

    return LLM(smollm_path, show_progress=False)


@pytest.fixture(scope="session")
def redis_port():
    """Port of a real redis-server shared by the session (flush it per test with redis_client)."""
    from redis_process import RedisServer

    server = RedisServer().start()
    yield server.port
    server.stop()


@pytest.fixture()
def redis_client(redis_port):
    import redis

    client = redis.Redis(port=redis_port)
    client.flushall()
    yield client
    client.close()
