"""The output processor the engine and the router share (text/output_processor.py), on SmolLM2's
tokenizer: streamed text adds up to the decoded output whatever the step sizes, never splits a
character, and a stop string cuts the text before it and drops the tokens after the one that
completed it."""

from __future__ import annotations

import pytest

from moemesh.text.model_text import open_model_text
from moemesh.text.output_processor import OutputProcessor

TEXT = "Über café naïve — 日本語 テスト 🙂 and then, one, two, three. Four!"


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    return open_model_text(smollm_path).tokenizer


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("Say something:")


def stream(processor: OutputProcessor, token_ids: list[int], step_sizes: list[int]) -> list[str]:
    """Feed the tokens in steps of these sizes (cycled), the last step finishing; the deltas."""
    deltas, i, k = [], 0, 0
    while i < len(token_ids):
        step = token_ids[i : i + step_sizes[k % len(step_sizes)]]
        i, k = i + len(step), k + 1
        out = processor.process(step, finished=i >= len(token_ids))
        assert out.num_kept == len(step) and not out.stopped
        deltas.append(out.text)
    return deltas


@pytest.mark.parametrize("step_sizes", [[1], [3], [2, 1, 4]])
@pytest.mark.parametrize("stop", [(), ("never seen",)])
def test_streamed_text_adds_up_to_the_decoded_output_and_never_splits_a_character(tokenizer, prompt, step_sizes, stop):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    deltas = stream(OutputProcessor(tokenizer, stop, prompt), token_ids, step_sizes)
    assert "".join(deltas) == tokenizer.decode(token_ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_text_that_could_begin_a_stop_string_is_held_back_until_it_cannot(tokenizer, prompt):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = OutputProcessor(tokenizer, ("three!",), prompt)
    sent = ""
    for i, token_id in enumerate(token_ids[:-1]):
        sent += processor.process([token_id], finished=False).text
        decoded = tokenizer.decode(token_ids[: i + 1])
        assert decoded.startswith(sent) and len(decoded) - len(sent) <= len("three!") - 1 + 2  # + a split character
    sent += processor.process(token_ids[-1:], finished=True).text
    assert sent == TEXT


@pytest.mark.parametrize("stop", [("three",), ("three", "one,"), (". F",)])
def test_a_stop_string_cuts_the_text_before_it_and_keeps_no_token_after_the_one_that_completed_it(
    tokenizer, prompt, stop
):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    first = min(TEXT.index(s) for s in stop)
    # the oracle: the fewest tokens whose text holds a stop string
    needed = next(k for k in range(1, len(token_ids) + 1) if any(s in tokenizer.decode(token_ids[:k]) for s in stop))
    processor = OutputProcessor(tokenizer, stop, prompt)
    out = processor.process(token_ids, finished=False)  # one step with every token (as a speculative round)
    assert out.stopped and out.num_kept == needed
    assert out.text == TEXT[:first]
    assert processor.process(token_ids[:1], finished=True).num_kept == 0  # stopped: nothing more is taken
