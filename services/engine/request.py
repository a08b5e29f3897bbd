"""A request's lifecycle: waiting -> running -> (preempted -> waiting ->) finished(reason)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from moemesh.common.block_hash import BlockHash
from moemesh.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
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


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (set on first admit)
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)  # keys of the full blocks so far
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next round

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
