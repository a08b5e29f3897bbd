"""What the HTTP and gRPC APIs share: the model's name and tokenizer, prompt checks, admission
(max requests in flight) and running the choices of one API call (prompts x n) concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from moemesh.common.metrics import RouterMetrics
from moemesh.router.dispatcher import Delta, Dispatcher, GenerateInput, InvalidRequest, ModelNotFound, Overloaded
from moemesh.router.tool_parsers import parser_for
from moemesh.text.errors import InvalidRequestError


@dataclass
class ChoiceDelta:
    index: int  # choice index in the response (prompt_index * n + i)
    prompt_index: int
    delta: Delta


class Frontend:
    def __init__(self, dispatcher: Dispatcher, tokenizer, model_name: str, max_model_len: int, vocab_size: int,
                 metrics: RouterMetrics, max_in_flight: int, tool_call_parser: str = "auto"):  # fmt: skip
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.tool_parser = parser_for(tool_call_parser, getattr(tokenizer, "chat_template", None))

    # -- checks ----------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                                param="model")  # fmt: skip

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in token_ids):
                raise InvalidRequest(f"token ids must be in [0, {self.vocab_size})", param="prompt")
        self.check_prompt(token_ids)
        return token_ids

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        except InvalidRequestError as e:
            raise InvalidRequest(str(e), param=e.param or "messages") from None
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_prompt(token_ids, param="messages")
        return token_ids

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise InvalidRequest("prompt must not be empty", param=param)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(token_ids)} tokens; the context holds {self.max_model_len}, leaving no room to "
                "generate",
                param=param,
            )

    # -- running ---------------------------------------------------------------------------
    async def run(self, inputs: list[tuple[int, GenerateInput]]) -> AsyncIterator[ChoiceDelta]:
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

    async def _run_all(self, inputs: list[tuple[int, GenerateInput]]) -> AsyncIterator[ChoiceDelta]:
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

    async def _run_one(self, request: GenerateInput) -> AsyncIterator[Delta]:
        async with contextlib.aclosing(self.dispatcher.generate(request)) as deltas:
            async for delta in deltas:
                if delta.finish_reason is not None:
                    self.metrics.prompt_tokens.inc(delta.num_prompt_tokens)
                    self.metrics.cached_tokens.inc(delta.num_cached_tokens)
                    self.metrics.outcome("finished")
                yield delta
