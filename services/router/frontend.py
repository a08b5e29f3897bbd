"""What the HTTP and gRPC APIs share: the model's name and tokenizer, request checks (the engine's
own: contracts/prompt_checks.py and contracts/sampling.py, raised here as InvalidRequest),
admission (max requests in flight) and running the choices of one API call (prompts x n)
concurrently.

Tokenization and chat templating run on worker threads (the Rust tokenizer releases the GIL), so
a huge prompt never stalls other streams; a text that cannot fit the context even at the
vocabulary's longest token per piece is refused before it is tokenized at all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from moemesh.contracts import prompt_checks
from moemesh.contracts.sampling import SamplingParams
from moemesh.router.dispatcher import (
    Delta,
    Dispatcher,
    FirstTokenTimeout,
    GenerateInput,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RouterError,
    Unavailable,
    WorkerFailedError,
    invalid_request,
)
from moemesh.router.tool_parsers import parser_for
from moemesh.runtime.metrics import RouterMetrics
from moemesh.text.errors import InvalidRequestError


@dataclass
class ChoiceDelta:
    index: int  # choice index in the response (prompt_index * n + i)
    prompt_index: int
    delta: Delta


class Frontend:
    def __init__(
        self,
        dispatcher: Dispatcher,
        tokenizer,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        metrics: RouterMetrics,
        max_in_flight: int,
        tool_call_parser: str = "auto",
    ):
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.limits = prompt_checks.PromptLimits(max_model_len, vocab_size)  # the workers also know their round budget
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._max_token_chars = _max_token_chars(tokenizer)
        self.tool_parser = parser_for(tool_call_parser, getattr(tokenizer, "chat_template", None))

    # -- checks ----------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ModelNotFound(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}", param="model"
            )

    async def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", param="prompt")
            self._check_text_length(prompt, "prompt")
            token_ids = await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens)
        else:
            token_ids = list(prompt)
        self.check_prompt(token_ids)
        return token_ids

    async def tokenize_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        self._check_text_length("".join(str(m.get("content") or "") for m in messages), "messages")
        token_ids = await asyncio.to_thread(self._tokenize_chat, messages, add_generation_prompt, tools)
        self.check_prompt(token_ids, param="messages")
        return token_ids

    async def detokenize(self, token_ids: list[int]) -> str:
        if any(t >= self.vocab_size for t in token_ids):
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size})", param="tokens")
        return await asyncio.to_thread(self.tokenizer.decode, token_ids, False)

    def _tokenize_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except InvalidRequestError as e:
            raise InvalidRequest(str(e), param=e.param or "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _check_text_length(self, text: str, param: str) -> None:
        """Every token covers at most `_max_token_chars` characters, so a longer text than this
        holds more tokens than the context: refused without tokenizing it."""
        if self._max_token_chars and len(text) > self.max_model_len * self._max_token_chars:
            raise InvalidRequest(
                f"{param} has {len(text)} characters, more than {self.max_model_len} tokens of "
                f"this model's context can hold",
                param=param,
            )

    def max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """The tokens to generate: `requested`, or the rest of the context when None (a request
        that cannot fit the context is refused by `check_request`, never silently cut)."""
        return requested if requested is not None else prompt_checks.room_to_generate(num_prompt_tokens, self.limits)

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        with invalid_request():
            prompt_checks.check_prompt(token_ids, self.limits, param=param)

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """The engine's checks of the prompt with these parameters (max_tokens within the context)."""
        with invalid_request():
            prompt_checks.check_request(token_ids, params, self.limits)

    # -- running ---------------------------------------------------------------------------
    async def run(self, inputs: list[tuple[int, GenerateInput]]) -> AsyncGenerator[ChoiceDelta, None]:
        """Deltas of every choice as they come; `inputs` are (prompt index, input) in choice order.
        Leaving early cancels every choice. Raises Overloaded when too many are in flight."""
        if self.in_flight + len(inputs) > self.max_in_flight:
            self.metrics.outcome("overloaded")
            raise Overloaded(f"the router has {self.in_flight} requests in flight (max {self.max_in_flight})")
        self.in_flight += len(inputs)
        self.metrics.in_flight.set(self.in_flight)
        try:
            async with contextlib.aclosing(self._run_all(inputs)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self.in_flight -= len(inputs)
            self.metrics.in_flight.set(self.in_flight)

    async def _run_all(self, inputs: list[tuple[int, GenerateInput]]) -> AsyncGenerator[ChoiceDelta, None]:
        if len(inputs) == 1:
            prompt_index, request = inputs[0]
            async with contextlib.aclosing(self._run_one(request)) as deltas:
                async for delta in deltas:
                    yield ChoiceDelta(0, prompt_index, delta)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, prompt_index: int, request: GenerateInput) -> None:
            try:
                async for delta in self._run_one(request):
                    queue.put_nowait(ChoiceDelta(index, prompt_index, delta))
            except Exception as e:  # noqa: BLE001 - re-raised in the consumer
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, p, r)) for i, (p, r) in enumerate(inputs)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_one(self, request: GenerateInput) -> AsyncGenerator[Delta, None]:
        """One choice; its outcome counts in `moemesh:router_requests_total{outcome}`: finished,
        aborted (the client left), timeout (no first token), failed (a worker failed and the
        request could not move), unavailable, overloaded or invalid."""
        outcome = "aborted"  # left early: the client went away (or a sibling choice failed)
        try:
            async with contextlib.aclosing(self.dispatcher.generate(request)) as deltas:
                async for delta in deltas:
                    if delta.finish_reason is not None:
                        self.metrics.prompt_tokens.inc(delta.num_prompt_tokens)
                        self.metrics.cached_tokens.inc(delta.num_cached_tokens)
                        outcome = "finished"
                    yield delta
        except RouterError as e:
            outcome = _OUTCOMES.get(type(e), "error")
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            self.metrics.outcome(outcome)


_OUTCOMES = {
    InvalidRequest: "invalid",
    Overloaded: "overloaded",
    Unavailable: "unavailable",
    WorkerFailedError: "failed",
    FirstTokenTimeout: "timeout",
}


def _max_token_chars(tokenizer) -> int | None:
    """The longest vocabulary entry's UTF-8 length: an upper bound on characters per token."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return None
    return max((len(piece.encode("utf-8")) for piece in backend.get_vocab(with_added_tokens=True)), default=None)
