"""A step's output work grows with its new tokens, not with the output so far: over a 2,000-token
generation, the elements the engine copies out of a request's token and logprob lists and the
token ids it detokenizes per step are counted, and are the same at token 100 as at token 1,900."""

from __future__ import annotations

import statistics

import pytest

from moemesh import SamplingParams

NUM_TOKENS = 2000


class CountingList(list):
    """A list that counts the elements read out of it in bulk (iteration, slices, copies) while
    `counter["on"]` is set."""

    def __init__(self, items, counter: dict):
        super().__init__(items)
        self.counter = counter

    def _count(self, n: int) -> None:
        if self.counter["on"]:
            self.counter["copied"] += n

    def __iter__(self):
        self._count(len(self))
        return super().__iter__()

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            self._count(len(item))
        return item

    def copy(self):
        self._count(len(self))
        return super().copy()

    def __add__(self, other):
        self._count(len(self))
        return super().__add__(other)

    def __radd__(self, other):
        self._count(len(self))
        return list(other) + list.copy(self)


@pytest.fixture(scope="module")
def tiny_llm(smollm_path, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer: its text is noise, but real text to detokenize,
    and 2,000 steps take seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from moemesh import LLM
    from moemesh.text.model_text import open_model_text

    tokenizer = open_model_text(smollm_path).tokenizer
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    return LLM(str(path), dtype="float32", max_model_len=4096, show_progress=False)


@pytest.fixture()
def long_generation(tiny_llm, monkeypatch):
    """Per step of one request's greedy 2,000-token generation (with logprobs, and a stop string
    that never matches, so text is held back): (output tokens so far, elements copied, token ids
    decoded)."""
    engine = tiny_llm.engine
    assert engine.tokenizer is not None and engine.max_model_len > NUM_TOKENS + 16
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0, stop=("\x00\x00\x00\x00",)
    )
    request_id = engine.add_request("Tell me a very long story about a dragon.", params)
    request = engine.scheduler.requests[request_id]
    counter = {"on": False, "copied": 0, "decoded": 0}
    request.output_token_ids = CountingList(request.output_token_ids, counter)
    request.output_logprobs = CountingList(request.output_logprobs, counter)

    decode = engine.tokenizer.decode

    def counting_decode(token_ids, *args, **kwargs):
        if counter["on"]:
            counter["decoded"] += len(token_ids)
        return decode(token_ids, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "decode", counting_decode)
    process_outputs = engine._process_outputs

    def counted(*args, **kwargs):  # the step's output work: deltas, detokenization, stop strings
        counter["on"] = True
        try:
            return process_outputs(*args, **kwargs)
        finally:
            counter["on"] = False

    monkeypatch.setattr(engine, "_process_outputs", counted)
    steps, num_tokens, num_logprobs = [], 0, 0
    while engine.has_unfinished_requests():
        counter["copied"] = counter["decoded"] = 0
        for delta in engine.step():
            num_tokens += len(delta.new_token_ids)
            num_logprobs += len(delta.new_logprobs)
            assert delta.num_output_tokens == num_tokens
            steps.append((num_tokens, counter["copied"], counter["decoded"]))
    assert num_tokens == num_logprobs == NUM_TOKENS
    return steps


def test_a_steps_output_work_at_token_1900_equals_that_at_token_100(long_generation):
    by_token = {num_tokens: (copied, decoded) for num_tokens, copied, decoded in long_generation}
    assert set(by_token) == set(range(1, NUM_TOKENS + 1))  # one token per step
    copied_100, _ = by_token[100]
    copied_1900, _ = by_token[1900]
    assert copied_100 == copied_1900 == 1  # the step's one new token, never the list so far
    assert all(copied == 1 for copied, _ in by_token.values())
    # detokenization reads a window of the last few ids (longer while a character is split over
    # tokens), however long the output is
    assert max(decoded for _, decoded in by_token.values()) <= 16
    around_100 = [by_token[n][1] for n in range(50, 151)]
    around_1900 = [by_token[n][1] for n in range(1850, 1951)]
    assert statistics.median(around_100) == statistics.median(around_1900)
