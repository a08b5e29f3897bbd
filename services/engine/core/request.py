"""A request's lifecycle: waiting -> running -> (preempted -> waiting ->) finished(reason).

A KV connector (connectors/base.py) adds one state: waiting -> waiting_for_external_kv (its blocks
are allocated, the connector is loading the KV of tokens after its prefix-cache hit, e.g. a remote
prefill of the uncached prompt suffix) -> running from the tokens that arrived (and the first
token, when the source computed the whole prompt); the rest is computed locally.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from moemesh.contracts.block_hash import BlockHash
from moemesh.contracts.finish_reason import FinishReason
from moemesh.engine.connectors.base import KVTransferParams
from moemesh.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_EXTERNAL_KV = "waiting_for_external_kv"
    FINISHED = "finished"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top-n tokens of that position and their logprobs


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admitted (time.monotonic()): the end of its queue time

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (set on first admit)
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)  # keys of the full blocks so far
    kv_transfer_params: KVTransferParams | None = None  # for the KV connector (e.g. a remote prefill), opaque here
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next round
    num_output_placeholders: int = 0  # overlap: tokens a scheduled round will sample, not known yet

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
