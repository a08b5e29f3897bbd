"""Structured outputs in the engine: the compiled-grammar LRU, and grammar rows batched with free
ones on SmolLM2 (the API-level checks with the openai client are in tests/services)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from moemesh import SamplingParams
from moemesh.engine.errors import InvalidRequestError
from moemesh.engine.runner.structured_output import StructuredOutputs
from moemesh.engine.sampling_params import StructuredOutputSpec

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_compiled_grammars_are_cached_by_canonical_text_least_recently_used_out(smollm):
    outputs = StructuredOutputs(smollm.engine.tokenizer, smollm.engine.model.cfg.vocab_size, max_cached_grammars=2)
    compact = outputs.compile(StructuredOutputSpec("json", json.dumps(SCHEMA, separators=(",", ":"))))
    assert outputs.compile(StructuredOutputSpec("json", json.dumps(SCHEMA, indent=2))) is compact
    regex = outputs.compile(StructuredOutputSpec("regex", "[a-z]+"))
    outputs.compile(StructuredOutputSpec("json", json.dumps(SCHEMA)))  # a hit: the schema is the newest again
    outputs.compile(StructuredOutputSpec("choice", choices=("a", "b")))  # evicts the regex, not the schema
    assert outputs.num_cached_grammars == 2
    assert outputs.compile(StructuredOutputSpec("json", json.dumps(SCHEMA))) is compact
    assert outputs.compile(StructuredOutputSpec("regex", "[a-z]+")) is not regex


def test_grammar_rows_batched_with_free_rows_leave_the_free_rows_unchanged(smollm):
    prompt = "Write the number of legs of a spider:"
    free = SamplingParams(temperature=0.0, max_tokens=8)
    alone = smollm.generate(prompt, free)[0].token_ids
    constrained = [
        SamplingParams(
            temperature=0.0, max_tokens=12, structured_output=StructuredOutputSpec("json", json.dumps(SCHEMA))
        ),
        SamplingParams(
            temperature=0.8, seed=3, max_tokens=8, structured_output=StructuredOutputSpec("regex", "[0-9]{2}")
        ),
        SamplingParams(
            temperature=0.0, max_tokens=8, structured_output=StructuredOutputSpec("choice", choices=("six", "eight"))
        ),
    ]
    outs = smollm.generate([prompt] * 4, [*constrained, free])
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert re.fullmatch("[0-9]{2}", outs[1].text) and outs[2].text in ("six", "eight")
    assert all(o.finish_reason == "stop" for o in outs[:3])
    assert outs[3].token_ids == alone


def test_a_bad_constraint_is_rejected_before_it_is_queued(smollm):
    for spec in [
        StructuredOutputSpec("regex", "(a"),
        StructuredOutputSpec("json", "{not json"),
        StructuredOutputSpec("grammar", "root ::= undefined_rule"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            smollm.generate("Hi", SamplingParams(structured_output=spec))
        assert e.value.param == spec.param
    assert not smollm.engine.has_unfinished_requests()
