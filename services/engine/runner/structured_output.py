"""Structured outputs: the sampled tokens of a request follow a grammar (a JSON schema, any JSON
object, a regex, one of a list of choices, or an EBNF grammar), enforced with xgrammar.

Why xgrammar rather than llguidance: xgrammar compiles a grammar against the vocabulary once
(its adaptive token-mask cache), after which a step's mask fill costs microseconds; with our LRU
of compiled grammars, the repeated schemas of agent and JSON clients pay compilation once per
worker. Its bitmask helpers (`allocate_token_bitmask`, `apply_token_bitmask_inplace`, with a CPU
implementation) work on torch tensors, so the mask is one batched op on the round's logits. It is
also vLLM's default backend, so a schema means the same here as there. llguidance needs no
compile step (better for one-off grammars) but computes each mask lazily at every step.

Who calls what, and when:
- `LLMEngine.add_request` calls `compile(spec)` (caller's thread): a bad schema, regex or grammar
  is an InvalidRequestError naming the field before the request is queued; it fills the cache.
- The model runner (runner thread) calls `add` for every new request with a spec (also a request
  resumed after preemption, or decoding after a remote prefill: the matcher is advanced over the
  output tokens it already has, e.g. the prefill worker's first token), `apply_bitmask` on the
  round's logits before the sampler (as vLLM does), `accept` with each sampled token, and
  `remove` when the scheduler drops the request.

Compiled grammars are cached in an LRU keyed by (kind, canonical text): JSON schemas are
re-serialised compactly (key order kept: it is the order of the generated properties). JSON is
generated without free whitespace (`any_whitespace=False`, like vLLM's
`disable-any-whitespace`): a small model cannot pad the output with endless blanks.

Speculative decoding: structured requests are not speculated (`SamplingParams.adjusts_logits`),
so a matcher only ever sees accepted tokens and never rolls back.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import torch

from moemesh.engine.errors import InvalidRequestError
from moemesh.engine.sampling_params import StructuredOutputSpec

logger = logging.getLogger(__name__)


class NullStructuredOutputs:
    """A model without a tokenizer: no grammar can be compiled against its vocabulary."""

    def compile(self, spec: StructuredOutputSpec):
        raise InvalidRequestError("this model has no tokenizer; structured outputs need one", param=spec.param)

    def add(self, request_id: str, spec: StructuredOutputSpec, output_token_ids: list[int]) -> None:
        self.compile(spec)

    def remove(self, request_id: str) -> None:
        pass

    def apply_bitmask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        pass

    def accept(self, request_id: str, token_id: int) -> None:
        pass


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, max_cached_grammars: int = 64):
        """`vocab_size`: the width of the model's logits (may exceed the tokenizer's vocabulary:
        the padding ids are never allowed)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_cached_grammars = max_cached_grammars
        self._compiler = None  # built on first use (imports xgrammar, reads the vocabulary)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # compile runs on the caller's and the runner's thread
        self._matchers: dict[str, object] = {}  # request id -> xgrammar.GrammarMatcher (runner thread)

    # -- compilation (any thread) ---------------------------------------------------------------
    def compile(self, spec: StructuredOutputSpec):
        key = (spec.kind, _canonical(spec))
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
            grammar = self._compile(spec, key[1])
            self._cache[key] = grammar
            if len(self._cache) > self.max_cached_grammars:
                self._cache.popitem(last=False)
            return grammar

    @property
    def num_cached_grammars(self) -> int:
        return len(self._cache)

    def _compile(self, spec: StructuredOutputSpec, text: str):
        compiler = self._get_compiler()
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(text)
            if spec.kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_string(c) for c in spec.choices))
            return compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for bad specs
            raise InvalidRequestError(f"cannot compile the {spec.kind} constraint: {e}", param=spec.param) from None

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar

            backend = self.tokenizer.backend  # a `tokenizers.Tokenizer`
            encoded_vocab = [""] * self.vocab_size
            for token, token_id in backend.get_vocab(with_added_tokens=True).items():
                if token_id < self.vocab_size:
                    encoded_vocab[token_id] = token
            # how tokens spell bytes (byte-level BPE, byte fallback, raw), from the tokenizer's JSON
            metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
            info = xgrammar.TokenizerInfo(
                encoded_vocab,
                metadata["vocab_type"],
                vocab_size=self.vocab_size,
                stop_token_ids=list(self.tokenizer.eos_token_ids),
                add_prefix_space=metadata["add_prefix_space"],
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    # -- matchers (runner thread) ---------------------------------------------------------------
    def add(self, request_id: str, spec: StructuredOutputSpec, output_token_ids: list[int]) -> None:
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self.compile(spec))
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                logger.warning("request %s: output token %d does not match its grammar", request_id, token_id)
                break
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def apply_bitmask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Mask, in place, the tokens each structured row's grammar forbids next.
        logits: [num_rows, vocab] float32, row i of request_ids[i]."""
        rows = [i for i, r in enumerate(request_ids) if r in self._matchers]
        if not rows:
            return
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(request_ids), self.vocab_size)  # [num_rows, vocab / 32]
        for i in rows:
            matcher = self._matchers[request_ids[i]]
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    def accept(self, request_id: str, token_id: int) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is not None and not matcher.is_terminated() and not matcher.accept_token(token_id):
            logger.warning("request %s: sampled token %d does not match its grammar", request_id, token_id)


def _canonical(spec: StructuredOutputSpec) -> str:
    if spec.kind == "json":
        try:
            return json.dumps(json.loads(spec.spec), separators=(",", ":"), ensure_ascii=False)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=spec.param) from None
    if spec.kind == "choice":
        return json.dumps(spec.choices, ensure_ascii=False)
    return spec.spec


def _ebnf_string(text: str) -> str:
    """An EBNF string literal matching `text` exactly."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'
