"""The router's tokenizer for checkpoints without tokenizer.json (token-id-only models such as
the tiny MoE test checkpoints): prompts must be token ids, outputs carry ids and empty text."""

from __future__ import annotations

from moemesh.router.dispatcher import InvalidRequest


class TokenIdsOnlyTokenizer:
    eos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise InvalidRequest("this model has no tokenizer: send the prompt as a list of token ids", param="prompt")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        raise InvalidRequest(
            "this model has no tokenizer or chat template: use /v1/completions with token ids", param="messages"
        )
