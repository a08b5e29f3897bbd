"""Tiny factories for engine unit tests (no model needed)."""

from __future__ import annotations

from moemesh.contracts.block_hash import HashExtra
from moemesh.engine.config import SchedulerConfig
from moemesh.engine.connectors.base import KVConnector
from moemesh.engine.core.kv_cache_manager import KVCacheManager
from moemesh.engine.core.request import Request
from moemesh.engine.core.scheduler import Scheduler
from moemesh.engine.sampling_params import SamplingParams

EXTRA = HashExtra(model_id="test-model")


def make_request(request_id: str, num_tokens: int, start: int = 0, max_tokens: int = 16, **params) -> Request:
    token_ids = list(range(start, start + num_tokens))
    return Request(
        request_id, token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params), eos_token_id=-1
    )


def make_kv(num_blocks: int, block_size: int = 4, caching: bool = True, extra: HashExtra = EXTRA) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, caching, extra)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    chunked: bool = True,
    caching: bool = True,
    max_model_len: int = 1024,
    kv_connector: KVConnector | None = None,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked)
    return Scheduler(config, make_kv(num_blocks, block_size, caching), max_model_len, kv_connector)
