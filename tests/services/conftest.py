"""Service-test fixtures: the offline engine as the oracle, its tokenizer and model id. The
redis-server fixtures (`redis_server`, `redis_client`) come from tests/conftest.py; each module
uses its own mesh id, or its own server (test_faults.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def offline_llm(smollm_path):
    """The offline engine (the oracle for greedy outputs), small pool, one thread."""
    import torch

    from moemesh import LLM

    torch.set_num_threads(1)
    return LLM(smollm_path, dtype="float32", num_blocks=256, max_model_len=1024, show_progress=False)


@pytest.fixture(scope="session")
def tokenizer(smollm_path):
    from moemesh.engine.loader import open_checkpoint

    return open_checkpoint(smollm_path).tokenizer


@pytest.fixture(scope="session")
def model_id(smollm_path):
    from moemesh.engine.loader import open_checkpoint

    return open_checkpoint(smollm_path).model_id
