"""A request's lifecycle: waiting -> running -> (preempted -> waiting ->) finished(reason).

Disaggregated serving adds one state on the decode worker: waiting -> waiting_for_remote_kv (its
blocks are allocated, the uncached prompt suffix is being prefilled by a prefill worker) ->
running once the KV and the first token arrive (or, if the transfer fails, running with a local
prefill of the suffix).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from moemesh.contracts.block_hash import BlockHash
from moemesh.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top-n tokens of that position and their logprobs


@dataclass(frozen=True)
class RemotePrefillParams:
    """Set by a decode worker on a request it may prefill remotely: at admission, if at least
    `min_remote_tokens` prompt tokens are not in its prefix cache, the scheduler allocates the
    blocks and parks the request in WAITING_FOR_REMOTE_KV instead of computing them."""

    min_remote_tokens: int = 1


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
    remote_prefill: RemotePrefillParams | None = None  # decode worker: may prefill remotely (first admit only)
    kv_export_start: int | None = None  # prefill worker: keep blocks at finish to export KV from this token
    num_remote_prefill_tokens: int = 0  # prompt tokens whose KV came from a prefill worker
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
