"""Tokenizer: a `tokenizers` backend, special ids, and the model's chat template.

Built from GGUF metadata (byte-level BPE, as llama.cpp's `gpt2` tokenizer model) or from a Hugging
Face directory (tokenizer.json + tokenizer_config.json). The router loads the same class through
the loader, so engines and router tokenize identically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime
from typing import Any, cast

from moemesh.text.errors import InvalidRequestError, ModelLoadError
from moemesh.text.tool_prompt import with_tools

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names whose split differs from GPT-2's default regex.
_PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    def __init__(
        self,
        backend,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos_token: bool,
        chat_template: str | None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self._template: Any = None  # the jinja2 template, compiled on first use

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """`tools` (OpenAI function tools): rendered by the template if it knows them, else in
        the Hermes style (text/tool_prompt.py)."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt", param="messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not _has_content(m):
                raise InvalidRequestError(f"messages[{i}] must have string 'role' and 'content'", param="messages")
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            try:
                messages, extra = with_tools(messages, tools, self.chat_template)
            except (ValueError, TypeError, AttributeError) as e:
                raise InvalidRequestError(f"bad tool call in messages: {e}", param="messages") from None
        else:
            extra = {}
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **extra
        )

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, get: Callable) -> Tokenizer:
        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE)")
        backend = _byte_level_bpe(
            get("tokenizer.ggml.tokens"),
            get("tokenizer.ggml.merges"),
            get("tokenizer.ggml.token_type") or [],
            _PRE_TOKENIZER_SPLITS.get(get("tokenizer.ggml.pre")),
        )
        eos = get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[eos] if eos is not None else [],
            add_bos_token=bool(get("tokenizer.ggml.add_bos_token", False)),
            chat_template=get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str, hf_config: dict) -> Tokenizer | None:
        """None when the directory has no tokenizer.json (token-id-only models, e.g. in tests)."""
        from tokenizers import Tokenizer as Backend

        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tokenizer_file):
            return None
        backend = Backend.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        generation = _read_json(os.path.join(path, "generation_config.json"))
        eos = generation.get("eos_token_id", hf_config.get("eos_token_id"))
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        bos = hf_config.get("bos_token_id")
        template = config.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        return cls(backend, bos, eos_ids, bool(config.get("add_bos_token", False)), template)


def _has_content(message: dict) -> bool:
    """A string content, or none beside tool calls (an assistant turn that only calls tools)."""
    content = message.get("content")
    return isinstance(content, str) or (content is None and bool(message.get("tool_calls")))


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int], split_regex: str | None):
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())

    def respell(token: str) -> str:  # llama.cpp writes some tokens in plain UTF-8
        return token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {respell(t): i for i, t in enumerate(tokens)}
    pairs = [cast(tuple[str, str], tuple(m.split(" "))) for m in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    if split_regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, token_types)
        if kind == _CONTROL and set(t) <= letters
    ]
    backend.add_special_tokens(control)
    user = [AddedToken(t, normalized=False) for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
    if user:
        backend.add_tokens(user)
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise InvalidRequestError(f"chat template: {message}", param="messages")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ModelLoadError(f"the model's chat template does not compile: {e}") from e


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)
