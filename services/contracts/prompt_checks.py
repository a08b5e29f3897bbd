"""The checks of a tokenized prompt against the model, one function for the router and the engine.

The router knows the context length and the vocabulary from the model's text metadata
(text/model_text.py); the engine also knows its round budget, which bounds a prompt when
chunked prefill is off. Both call `check_request` before a request goes anywhere, so a request
one of them refuses the other refuses too, with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moemesh.contracts.sampling import SamplingParams
from moemesh.text.errors import InvalidRequestError


@dataclass(frozen=True)
class PromptLimits:
    max_model_len: int  # prompt + generated tokens
    vocab_size: int  # token ids are in [0, vocab_size)
    max_prefill_tokens: int | None = None  # chunked prefill off: a prompt runs in one round of this budget


def check_prompt(
    token_ids: Sequence[int], limits: PromptLimits, max_tokens: int | None = None, param: str = "prompt"
) -> None:
    """Raises InvalidRequestError naming `param` (the context overrun by `max_tokens`: naming
    max_tokens). `max_tokens` None: only that the prompt leaves room to generate."""
    if not token_ids:
        raise InvalidRequestError("prompt must not be empty", param=param)
    num_tokens, vocab = len(token_ids), limits.vocab_size
    if min(token_ids) < 0 or max(token_ids) >= vocab:
        raise InvalidRequestError(f"token ids must be in [0, {vocab})", param=param)
    if num_tokens >= limits.max_model_len:
        raise InvalidRequestError(
            f"prompt has {num_tokens} tokens; the context holds {limits.max_model_len}, leaving no room to generate",
            param=param,
        )
    if max_tokens is not None and num_tokens + max_tokens > limits.max_model_len:
        raise InvalidRequestError(
            f"this model's context holds {limits.max_model_len} tokens, but the request needs "
            f"{num_tokens + max_tokens}: {num_tokens} in the prompt and {max_tokens} to generate",
            param="max_tokens",
        )
    budget = limits.max_prefill_tokens
    if budget is not None and num_tokens > budget:
        raise InvalidRequestError(
            f"prompt has {num_tokens} tokens, more than max_num_batched_tokens ({budget}) with chunked prefill off",
            param=param,
        )


def check_request(
    token_ids: Sequence[int], params: SamplingParams, limits: PromptLimits, param: str = "prompt"
) -> None:
    """The prompt with the request's max_tokens, and its logit_bias ids within the vocabulary."""
    check_prompt(token_ids, limits, params.max_tokens, param)
    if any(t >= limits.vocab_size for t, _ in params.logit_bias):
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {limits.vocab_size})", param="logit_bias")


def room_to_generate(num_prompt_tokens: int, limits: PromptLimits) -> int:
    """The default max_tokens where a request gives none (chat): the rest of the context."""
    return limits.max_model_len - num_prompt_tokens
