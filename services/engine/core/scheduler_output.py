"""What the scheduler hands the model runner each round.

New requests are sent in full once (also when a preempted request resumes); after that only
deltas: new block ids and the computed-token count. The runner keeps its own per-request state
and appends the tokens it samples, so sampled tokens never travel back in this message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.engine.connectors.base import NO_METADATA, KVConnectorMetadata
from moemesh.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    token_ids: list[int]  # prompt, plus outputs so far when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit
    num_output_tokens: int = 0  # of token_ids, already sampled (resumed, or first token from a prefill worker)
    eos_token_id: int | None = None  # the sampler masks it while min_tokens is not reached


@dataclass(frozen=True)
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> q_i
    # request id -> draft tokens scheduled after its last token (counted in q_i); verified by the runner
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0  # sum of q_i <= max_num_batched_tokens
    finished_req_ids: set[str] = field(default_factory=set)  # since the last round: drop state
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata = NO_METADATA  # what the connector's worker half does this round

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
