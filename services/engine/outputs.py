"""What the engine returns: per step, each request's delta; for the offline API, whole outputs.

`LLMEngine.step()` (and `abort_request`) return one `RequestDelta` per request that changed:
the tokens, logprobs and text this step added, never the output so far, so a step's output
work grows with its new tokens only. Worker servicers send the deltas as they are. The offline
`LLM.generate` adds them up with an `OutputCollector` into one `RequestOutput` per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.contracts.finish_reason import FinishReason
from moemesh.engine.core.request import Logprob


@dataclass
class RequestDelta:
    request_id: str
    prompt_token_ids: list[int]  # the request's own list (not a copy)
    new_token_ids: list[int]  # this step's tokens
    new_logprobs: list[Logprob] | None  # one per new token; None: logprobs were not requested
    new_text: str = ""  # this step's text (streaming delta; empty without detokenization)
    num_output_tokens: int = 0  # all output tokens so far (a resumed request's included)
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    scheduled_time: float | None = None  # time.monotonic() of the first admission (None: still queued)


@dataclass
class RequestOutput:
    """A request's whole output (the offline API's result)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # all generated
    text: str = ""  # all generated text (cut before a stop string)
    logprobs: list[Logprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    scheduled_time: float | None = None  # time.monotonic() of the first admission (None: still queued)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class OutputCollector:
    """Adds up each request's deltas (`add`, once per step) and returns its `RequestOutput` when
    it finishes. Tokens and logprobs are appended, text pieces joined once at the end."""

    def __init__(self):
        self._outputs: dict[str, RequestOutput] = {}
        self._text: dict[str, list[str]] = {}

    def add(self, deltas: list[RequestDelta]) -> list[RequestOutput]:
        """The outputs these deltas finished."""
        finished = []
        for delta in deltas:
            output = self._outputs.get(delta.request_id)
            if output is None:
                output = self._outputs[delta.request_id] = RequestOutput(delta.request_id, delta.prompt_token_ids)
                self._text[delta.request_id] = []
            output.token_ids += delta.new_token_ids
            if delta.new_logprobs is not None:
                if output.logprobs is None:
                    output.logprobs = []
                output.logprobs += delta.new_logprobs
            if delta.new_text:
                self._text[delta.request_id].append(delta.new_text)
            output.num_cached_tokens = delta.num_cached_tokens
            output.scheduled_time = delta.scheduled_time
            if delta.finished:
                output.finished, output.finish_reason = True, delta.finish_reason
                output.text = "".join(self._text.pop(delta.request_id))
                finished.append(self._outputs.pop(delta.request_id))
        return finished
