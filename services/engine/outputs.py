"""What the engine returns per request each step (and, finished, as the final result)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.engine.core.request import Logprob


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # all generated so far
    text: str = ""  # all generated text so far (cut before a stop string)
    new_token_ids: list[int] = field(default_factory=list)  # this step's
    new_text: str = ""  # this step's (streaming delta)
    logprobs: list[Logprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    scheduled_time: float | None = None  # time.monotonic() of the first admission (None: still queued)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
