"""OpenAI-compatible request bodies (validated at the boundary) and response objects.

Strict like OpenAI's own API: an unknown field is a 400 naming it. The exceptions are the
documented extras in `ACCEPTED_EXTRAS` (fields vLLM's and OpenAI's clients send), accepted only
with a value that changes nothing here; any other value is a 400 saying it is not supported.
The sampling fields' bounds are the engine's (contracts/sampling.py `BOUNDS`, never past
protobuf's int32/int64), and a request's sampling fields become the engine's `SamplingParams`
(`sampling_params`), so the router refuses exactly what a worker would. Every string is checked
for unpaired UTF-16 surrogates (JSON allows `"\\ud800"`; UTF-8 cannot carry it).
Sampling follows vLLM: presence/frequency penalties, logit_bias, any number of stop strings, and
vLLM's extensions top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids.
Structured outputs: `response_format` and vLLM's `guided_*` / `structured_outputs`
(router/structured_request.py). Tools: `tools`, `tool_choice`, `parallel_tool_calls`
(router/tool_calls.py).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from moemesh.contracts.finish_reason import FinishReason
from moemesh.contracts.sampling import BOUNDS, INT64_MIN, SamplingParams, StructuredOutputSpec
from moemesh.proto.v1 import common_pb2
from moemesh.router.dispatcher import InvalidRequest, invalid_request
from moemesh.router.structured_request import structured_output


def bounded(name: str):
    """The engine's bound of a field (contracts/sampling.py), as a pydantic constraint."""
    bound = BOUNDS[name]
    if bound.low_open:
        return Field(gt=bound.low, le=bound.high)
    return Field(ge=bound.low, le=bound.high)


OPENAI_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI's `finish_reason` (None while a stream goes on). An aborted request never reaches a
    client (the router migrates it or fails the call); it would read as vLLM's "abort"."""
    return None if reason is None else OPENAI_FINISH_REASONS[reason]


# sampling fields that the engine's SamplingParams takes as they are
_AS_THEY_ARE = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
)

# Fields OpenAI's or vLLM's clients send that moemesh accepts only with these values (each
# changes nothing here). Any other field not declared on the request model is a 400.
ACCEPTED_EXTRAS: dict[str, tuple] = {
    # OpenAI
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    # vLLM
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "priority": (0,),
    "add_special_tokens": (None,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "echo": (False,),  # chat completions only (completions declare it)
    "return_tokens_as_token_ids": (None, False),
    "logits_processors": (None,),
    "documents": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None, {}),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool = False  # padding against side channels; moemesh sends none
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk

    def check_unsupported(self) -> None:
        if self.continuous_usage_stats:
            raise InvalidRequest("stream_options.continuous_usage_stats is not supported", param="stream_options")


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras: checked against ACCEPTED_EXTRAS in check_unsupported

    model: str
    temperature: Annotated[float, bounded("temperature")] = 1.0
    top_p: Annotated[float, bounded("top_p")] = 1.0
    top_k: Annotated[int, bounded("top_k")] = 0
    min_p: Annotated[float, bounded("min_p")] = 0.0
    n: int = Field(1, ge=1, le=16)
    seed: Annotated[int, bounded("seed")] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, bounded("token_id")]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: Annotated[float, bounded("presence_penalty")] = 0.0
    frequency_penalty: Annotated[float, bounded("frequency_penalty")] = 0.0
    repetition_penalty: Annotated[float, bounded("repetition_penalty")] = 1.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: Annotated[int, bounded("min_tokens")] = 0
    user: str | None = None
    # structured outputs (router/structured_request.py)
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name not in ACCEPTED_EXTRAS:
                raise InvalidRequest(f"unknown field {name!r}", param=name)
            if value not in ACCEPTED_EXTRAS[name]:
                allowed = " or ".join(json.dumps(v) for v in ACCEPTED_EXTRAS[name])
                raise InvalidRequest(f"{name}={json.dumps(value)} is not supported (only {allowed})", param=name)
        if self.stream_options is not None:
            self.stream_options.check_unsupported()
        for name in type(self).model_fields:
            check_text(getattr(self, name), name)

    def token_biases(self) -> dict[int, float]:
        """logit_bias with its keys as token ids (their range and the biases': SamplingParams)."""
        biases = {}
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise InvalidRequest(f"logit_bias keys must be token ids; got {key!r}", param="logit_bias")
            biases[int(key)] = bias
        return biases

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, choice: int, tool_constraint: StructuredOutputSpec | None
    ) -> SamplingParams:
        """The engine's parameters of choice `choice` (InvalidRequest naming a field out of bounds).
        `tool_constraint`: a tool choice's grammar, exclusive with the body's own."""
        guided = {
            name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        }
        constraint = structured_output(self.response_format, guided, self.structured_outputs)
        if tool_constraint is not None:
            if constraint is not None:
                raise InvalidRequest(
                    "tool_choice 'required' or a named function cannot be combined with response_format or guided "
                    "decoding",
                    param="tool_choice",
                )
            constraint = tool_constraint
        seed = self.seed
        if seed is not None:  # n > 1: distinct but reproducible choices (wrapping within int64)
            seed = (seed + choice - INT64_MIN) % 2**64 + INT64_MIN
        with invalid_request():
            return SamplingParams(
                **{name: getattr(self, name) for name in _AS_THEY_ARE},
                seed=seed,
                max_tokens=max_tokens,
                stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                logprobs=logprobs,
                logit_bias=tuple(self.token_biases().items()),
                structured_output=constraint,
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def check_text(value, param: str) -> None:
    """A 400 naming `param` if any string in `value` holds an unpaired surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(
                f"{param} holds an unpaired UTF-16 surrogate (not valid Unicode text)", param=param
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, param)
            check_text(item, param)
    elif isinstance(value, list | tuple):
        for item in value:
            check_text(item, param)
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            check_text(getattr(value, name), param)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, bounded("max_tokens")] = 16  # OpenAI's and vLLM's default
    logprobs: Annotated[int, bounded("logprobs")] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if self.best_of not in (None, 1, self.n):
            raise InvalidRequest("best_of is not supported", param="best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [cast(list[int], list(prompt))]
        return cast(list[str | list[int]], list(prompt))

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatMessage(BaseModel):
    # lenient on purpose: clients send an assistant reply back as it came (with OpenAI's
    # response-only keys such as refusal, audio, annotations, function_call set to null)
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this result answers

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest("only text content parts are supported", param="messages")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Annotated[int, bounded("max_tokens")] | None = None  # None: the rest of the context
    max_completion_tokens: Annotated[int, bounded("max_tokens")] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, bounded("logprobs")] | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise InvalidRequest("messages must be a non-empty list", param="messages")

    def conversation(self) -> list[dict]:
        return _conversation(self.messages)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("send exactly one of prompt and messages", param="prompt")
        check_text(self.prompt, "prompt")
        check_text(self.messages, "messages")

    def conversation(self) -> list[dict]:
        return _conversation(self.messages or [])


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Annotated[int, bounded("token_id")]]


def _conversation(messages: list[ChatMessage]) -> list[dict]:
    conversation = []
    for m in messages:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
            message["content"] = m.text() if m.content is not None else None
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        conversation.append(message)
    return conversation


# -- responses ---------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class LogprobFormatter:
    """OpenAI logprob objects from TokenLogprob messages (tokens as their decoded text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, logprobs: list[common_pb2.TokenLogprob], text_offset: int) -> dict:
        tokens = [self.token(lp.token_id) for lp in logprobs]
        offsets, offset = [], text_offset
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)} for lp in logprobs],
            "text_offset": offsets,
        }

    def chat(self, logprobs: list[common_pb2.TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            token = self.token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        return {
            "content": [
                {
                    **entry(lp.token_id, lp.logprob),
                    "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)],
                }
                for lp in logprobs
            ]
        }
