"""Execution overlap (async scheduling): the scheduler prepares round t+1 while the model runs
round t on the runner thread; outputs must not change.

The oracle is the same engine code with overlap off (rounds one after another), which the
Hugging Face oracle tests check against transformers.
"""

from __future__ import annotations

import threading

import pytest

from moemesh import LLM, SamplingParams
from moemesh.engine.outputs import OutputCollector

from .factories import make_request, make_scheduler

PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Explain why the sky is blue in one sentence.",
    "Once upon a time, in a small village by the sea,",
    "List three fruits:",
]


def mixed_params() -> list[SamplingParams]:
    """Greedy, with a spread of max_tokens and stop strings that do and do not fire."""
    return [
        SamplingParams(temperature=0.0, max_tokens=1 + (i * 5) % 23, stop=(" 8,", "\n\n") if i % 3 == 0 else ())
        for i in range(len(PROMPTS))
    ]


@pytest.fixture(scope="module")
def engines(smollm_path):
    """Overlap on and off, with a small budget (chunked prefill) and a pool small enough to preempt."""
    kwargs = dict(max_num_batched_tokens=24, max_num_seqs=8, num_blocks=10, block_size=8, show_progress=False)
    return LLM(smollm_path, async_scheduling=True, **kwargs), LLM(smollm_path, async_scheduling=False, **kwargs)


def test_overlap_is_on_by_default_and_off_with_speculation(smollm, smollm_path):
    from moemesh.engine.config import SpecConfig

    assert smollm.engine._overlap is not None
    spec = LLM(smollm_path, speculative=SpecConfig(method="ngram"), show_progress=False, num_blocks=8)
    assert spec.engine._overlap is None


def test_greedy_outputs_are_identical_with_overlap_on_and_off(engines):
    overlapped, sequential = engines
    params = mixed_params()
    on = overlapped.generate(PROMPTS, params)
    off = sequential.generate(PROMPTS, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
    assert any(o.finish_reason == "stop" for o in on) and any(o.finish_reason == "length" for o in on)
    assert all(len(o.token_ids) <= p.max_tokens for o, p in zip(on, params))
    assert overlapped.engine.scheduler.num_preemptions > 0  # the small pool preempted mid-overlap
    # a second pass is served partly from the prefix cache, still identical
    again = overlapped.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in off]
    for llm in engines:
        assert llm.engine.kv_cache_manager.num_used_blocks == 0


def test_seeded_sampling_is_identical_with_overlap_and_preemption(engines, smollm):
    """Seeded rows draw from their own generator; a preempted request resumes the seed's stream
    (the runner fast-forwards it), so the pool size and overlap change nothing."""
    overlapped, sequential = engines
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=12) for i in range(len(PROMPTS))]
    reference = smollm.generate(PROMPTS, params)  # a pool that never preempts
    preemptions = sequential.engine.scheduler.num_preemptions
    off = sequential.generate(PROMPTS, params)
    on = overlapped.generate(PROMPTS, params)
    assert sequential.engine.scheduler.num_preemptions > preemptions
    assert [o.token_ids for o in on] == [o.token_ids for o in reference]
    assert [o.token_ids for o in off] == [o.token_ids for o in reference]


def test_aborts_arriving_mid_round_free_their_blocks_and_spare_the_others(engines):
    overlapped, sequential = engines
    engine = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = {o.prompt_token_ids[-1]: o.token_ids for o in sequential.generate(PROMPTS[:4], params)}
    ids = [engine.add_request(p, params) for p in PROMPTS[:4]]
    outputs, collector = {}, OutputCollector()  # the engine's deltas, added up per request
    for round_index in range(6):
        for out in collector.add(engine.step()):
            outputs[out.request_id] = out
        if round_index == 2:  # two rounds in flight or queued: abort one running, one not yet decoding
            assert engine._in_flight
            for out in collector.add(engine.abort_request([ids[1], ids[3]])):
                outputs[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in collector.add(engine.step()):
            outputs[out.request_id] = out
    assert outputs[ids[1]].finish_reason == outputs[ids[3]].finish_reason == "abort"
    for i in (0, 2):
        out = outputs[ids[i]]
        assert out.finished and out.token_ids == expected[out.prompt_token_ids[-1]]
    assert engine.kv_cache_manager.num_used_blocks == 0
    assert not engine._in_flight
    # the runner keeps only states the next round tells it to drop
    assert set(engine.runner.requests) <= engine.scheduler._finished_req_ids


def test_the_next_round_is_scheduled_while_the_model_runs(engines):
    """The runner blocks in round t until the caller's thread has scheduled round t+1."""
    overlapped, _ = engines
    engine = overlapped.engine
    scheduled_next = threading.Event()
    rounds = {"executed": 0, "overlapped": 0}
    execute, schedule = engine.runner.execute, engine.scheduler.schedule

    def slow_execute(out):
        rounds["executed"] += 1
        result = execute(out)
        if not out.is_empty and scheduled_next.wait(timeout=10):
            rounds["overlapped"] += 1
        scheduled_next.clear()
        return result

    def schedule_and_signal():
        out = schedule()
        if engine._in_flight:  # a round is running: this one is prepared while it runs
            scheduled_next.set()
        return out

    engine.runner.execute, engine.scheduler.schedule = slow_execute, schedule_and_signal
    try:
        overlapped.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6))
    finally:
        engine.runner.execute, engine.scheduler.schedule = execute, schedule
    assert rounds["overlapped"] >= rounds["executed"] - 2  # all but the pipeline's last round(s)
    assert rounds["overlapped"] >= 5


def test_scheduler_places_one_placeholder_and_skips_a_request_its_pending_token_ends():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 6, max_tokens=2))
    first = scheduler.schedule()  # prefill
    request = scheduler.requests["a"]
    assert first.num_scheduled_tokens == {"a": 6} and request.num_output_placeholders == 1
    second = scheduler.schedule()  # before round 1's token is known: decode at the placeholder
    assert second.num_scheduled_tokens == {"a": 1} and request.num_computed_tokens == 7
    assert request.num_output_placeholders == 2
    scheduler.update_from_output(first, {"a": [5]})
    assert request.num_output_placeholders == 1 and request.output_token_ids == [5]
    # the pending token will be the second of max_tokens=2: nothing more to schedule for it
    assert scheduler.schedule().num_scheduled_tokens == {}
    scheduler.update_from_output(second, {"a": [6]})
    assert request.is_finished and request.output_token_ids == [5, 6]
    assert scheduler.kv.num_used_blocks == 0


def test_a_failing_round_raises_from_step_and_shutdown_still_stops_the_runner(smollm_path):
    llm = LLM(smollm_path, num_blocks=16, show_progress=False)
    engine = llm.engine
    execute, calls = engine.runner.execute, []

    def failing_execute(out):
        calls.append(out)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return execute(out)

    engine.runner.execute = failing_execute
    engine.add_request("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8))
    with pytest.raises(RuntimeError, match="device lost"):
        while engine.has_unfinished_requests():
            engine.step()
    engine.shutdown()  # returns: the failed round is not waited for twice, the thread stops
    assert engine._overlap._shutdown
