"""Service-test fixtures: a real redis-server on a free loopback port (one per session; each
module uses its own mesh id or its own server), and the offline engine as the oracle."""

from __future__ import annotations

import pytest

from moemesh.launcher.local_cluster import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def offline_llm(smollm_path):
    """The offline engine (the oracle for greedy outputs), small pool, one thread."""
    import torch

    from moemesh import LLM

    torch.set_num_threads(1)
    return LLM(smollm_path, num_blocks=256, max_model_len=1024, show_progress=False)


@pytest.fixture(scope="session")
def tokenizer(smollm_path):
    from moemesh.engine.loader import open_checkpoint

    return open_checkpoint(smollm_path).tokenizer


@pytest.fixture(scope="session")
def model_id(smollm_path):
    from moemesh.engine.loader import open_checkpoint

    return open_checkpoint(smollm_path).model_id
