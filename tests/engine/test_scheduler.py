from moemesh.engine.core.request import FinishReason, RequestStatus

from .factories import make_request, make_scheduler


def run_round(scheduler, sampled_token=7):
    """Schedule one round and pretend the model sampled `sampled_token` where due."""
    out = scheduler.schedule()
    sampled = {}
    for request_id in out.num_scheduled_tokens:
        if scheduler.requests[request_id].num_output_placeholders:  # the round reached its end
            sampled[request_id] = sampled_token
    scheduler.update_from_output(out, {r: [t] for r, t in sampled.items()})
    return out


def test_round_budget_is_respected_and_decodes_go_first():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6, start=50))
    out = run_round(scheduler)
    assert out.num_scheduled_tokens == {"a": 6, "b": 6}
    scheduler.add_request(make_request("c", 20, start=100))
    out = run_round(scheduler)
    # a and b decode one token each, c gets the 14 remaining tokens of the budget (chunked)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 14}
    assert out.total_num_scheduled_tokens == 16
    out = run_round(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}
    assert scheduler.requests["c"].num_output_tokens == 1


def test_new_requests_are_sent_once_then_only_deltas():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 4))
    out = run_round(scheduler)
    assert [r.request_id for r in out.scheduled_new_reqs] == ["a"]
    assert out.scheduled_new_reqs[0].block_ids == [1]
    out = run_round(scheduler)  # token 5 needs a second block
    assert out.scheduled_new_reqs == []
    assert [(c.request_id, c.new_block_ids, c.num_computed_tokens) for c in out.scheduled_cached_reqs] == [
        ("a", [2], 4)
    ]
    out = run_round(scheduler)  # token 6 fits in block 2
    assert out.scheduled_cached_reqs[0].new_block_ids == []


def test_chunked_prefill_off_waits_for_a_round_with_room():
    scheduler = make_scheduler(max_num_batched_tokens=16, chunked=False)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10, start=50))
    out = run_round(scheduler)
    assert out.num_scheduled_tokens == {"a": 10}  # b does not fit the remaining 6
    out = run_round(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}


def test_admission_is_fcfs_and_capped_by_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 4, start=10 * i))
    out = run_round(scheduler)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_preemption_by_recompute_frees_blocks_and_requeues_at_head():
    # 4 usable blocks of 4 tokens; two requests of 8 tokens fill the pool.
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, caching=False)
    scheduler.add_request(make_request("a", 8))
    scheduler.add_request(make_request("b", 8, start=50))
    run_round(scheduler)  # a and b prefilled, each sampled a 9th token
    assert scheduler.kv.num_free_blocks == 0
    out = run_round(scheduler)  # a needs a block for token 9: b (last admitted) is preempted
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b
    assert scheduler.kv.get_block_ids("b") == []
    assert scheduler.num_preemptions == 1
    out = scheduler.schedule()
    assert "b" in out.finished_req_ids  # the runner drops its stale copy


def test_request_preempts_itself_when_it_is_the_only_one():
    scheduler = make_scheduler(num_blocks=3, block_size=4, caching=False)  # 2 usable blocks
    scheduler.add_request(make_request("a", 8))
    run_round(scheduler)
    out = run_round(scheduler)
    assert out.preempted_req_ids == {"a"} and out.num_scheduled_tokens == {}


def test_stop_conditions_finish_and_free():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("len", 4, max_tokens=2))
    scheduler.add_request(make_request("stop", 4, start=40, stop_token_ids=(7,)))
    run_round(scheduler, sampled_token=7)
    assert "stop" not in scheduler.requests  # finished on the stop token
    run_round(scheduler, sampled_token=3)
    assert scheduler.num_unfinished_requests == 0
    assert scheduler.kv.num_used_blocks == 0


def test_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=6)
    request = make_request("a", 4, max_tokens=100)
    scheduler.add_request(request)
    run_round(scheduler)
    run_round(scheduler)
    assert request.finish_reason == FinishReason.LENGTH and request.num_tokens == 6


def test_abort_frees_blocks_in_any_state():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 8), make_request("b", 8, start=30)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_round(scheduler)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    finished = scheduler.finish_requests(["a", "b", "missing"], FinishReason.ABORT)
    assert [r.request_id for r in finished] == ["a", "b"]
    assert a.finish_reason == FinishReason.ABORT
    assert scheduler.kv.num_used_blocks == 0
    assert scheduler.schedule().finished_req_ids == {"a"}


def test_prefix_hit_skips_cached_tokens_in_the_round():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 12))
    run_round(scheduler)
    scheduler.add_request(make_request("b", 14))  # shares 12 tokens = 3 full blocks
    out = run_round(scheduler)
    assert out.num_scheduled_tokens["b"] == 2
    b_new = next(r for r in out.scheduled_new_reqs if r.request_id == "b")
    assert b_new.num_computed_tokens == 12
    assert b_new.block_ids[:3] == scheduler.kv.get_block_ids("a")[:3]
    assert scheduler.requests["b"].num_cached_tokens == 12
