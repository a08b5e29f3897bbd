from moemesh.engine.speculative.confidence import CostTable, schedule_draft_lengths


def test_flat_cost_admits_every_draft():
    cost = CostTable((1, 64), (0.01, 0.01))  # verifying more tokens is free
    assert schedule_draft_lengths({"a": [0.9, 0.5], "b": [0.1]}, cost) == {"a": 2, "b": 1}


def test_admission_follows_survival_and_stops_when_the_objective_stops_improving():
    # Step time grows 10% per extra token from a 2-token round (two decoding requests).
    cost = CostTable(tuple(range(2, 10)), tuple(1.0 + 0.1 * i for i in range(8)))
    # survivals: a: 0.9, 0.72, 0.36; b: 0.5, 0.05
    lengths = schedule_draft_lengths({"a": [0.9, 0.8, 0.5], "b": [0.5, 0.1]}, cost)
    # objective E / t: base 2/1.0 = 2.0; +a1 2.9/1.1 = 2.64; +a2 3.62/1.2 = 3.02; +b1 4.12/1.3 = 3.17;
    # +a3 4.48/1.4 = 3.2; +b2 4.53/1.5 = 3.02 < 3.2: the best prefix ends at a3.
    assert lengths == {"a": 3, "b": 1}


def test_expensive_verification_admits_nothing():
    cost = CostTable((1, 2), (1.0, 3.0))
    assert schedule_draft_lengths({"a": [0.9, 0.9]}, cost) == {"a": 0}


def test_cost_table_interpolates_and_extrapolates():
    cost = CostTable((1, 3, 5), (1.0, 2.0, 4.0))
    assert cost.step_seconds(0) == 1.0
    assert cost.step_seconds(2) == 1.5
    assert cost.step_seconds(4) == 3.0
    assert cost.step_seconds(10) == 8.0


def test_a_cost_jump_after_one_token_does_not_stall_admission():
    # CPU-like: 1 token 40 ms, 2..8 tokens 75 ms. One draft alone loses (1.5 / 75 < 1 / 40), four win.
    cost = CostTable((1, 2, 8), (0.040, 0.075, 0.075))
    assert schedule_draft_lengths({"a": [0.5, 0.9, 0.9, 0.9]}, cost) == {"a": 4}
    assert schedule_draft_lengths({"a": [0.5]}, cost) == {"a": 0}


def test_drafting_time_counts_in_every_set_so_longer_verification_pays_sooner():
    # verify-only: 1 token 1.0 s, 2 tokens 2.0 s -> E/t: 1/1 = 1.0 vs 1.6/2 = 0.8, nothing admitted.
    cost = CostTable((1, 2), (1.0, 2.0))
    assert schedule_draft_lengths({"a": [0.6]}, cost) == {"a": 0}
    # with 3 s of drafting already spent: 1/4 = 0.25 vs 1.6/5 = 0.32, the draft is worth verifying
    assert schedule_draft_lengths({"a": [0.6]}, cost, draft_seconds=3.0) == {"a": 1}
