"""Autoscaler scenarios on a fake clock: burst, steady, drain, flapping, pending pods, ratio guard."""

import pytest

from moemesh.operator.autoscaler import (
    AutoscalerState,
    RatioGuard,
    RoleTelemetry,
    ScalingPolicy,
    decide,
    raw_recommendation,
)

POLICY = ScalingPolicy(
    min_replicas=1,
    max_replicas=10,
    target_requests_per_replica=10.0,
    target_kv_usage=None,
    scale_up_window_s=0.0,
    scale_down_window_s=60.0,
    max_step_up=4,
    max_step_down=1,
    scale_up_period_s=15.0,
    scale_down_period_s=30.0,
)


def telemetry(num_ready, in_flight, num_pending=0, **fields):
    return RoleTelemetry(num_ready=num_ready, num_pending=num_pending, num_queued=in_flight, **fields)


class Decode:
    """Drives decode-only decisions tick by tick; `replicas` follows the decisions instantly."""

    def __init__(self, replicas=2, policy=POLICY):
        self.replicas, self.policy, self.state, self.now = replicas, policy, AutoscalerState(), 0.0

    def tick(self, in_flight, dt=10.0, num_pending=0):
        self.now += dt
        ready = self.replicas - num_pending
        desired, self.state = decide(
            self.state,
            self.now,
            {"decode": self.replicas},
            {"decode": telemetry(ready, in_flight, num_pending)},
            {"decode": self.policy},
        )
        self.replicas = desired["decode"]
        return self.replicas


def test_raw_recommendation_follows_the_worst_metric():
    policy = ScalingPolicy(target_requests_per_replica=10, target_kv_usage=0.5, target_itl_p90_s=0.05)
    assert raw_recommendation(4, telemetry(4, in_flight=20, kv_usage=0.25), policy) == 2
    assert raw_recommendation(4, telemetry(4, in_flight=20, kv_usage=0.75), policy) == 6
    assert raw_recommendation(4, telemetry(4, in_flight=20, itl_p90_s=0.1), policy) == 8
    assert raw_recommendation(3, telemetry(0, in_flight=0), policy) == 3  # nothing measured yet


def test_burst_scales_up_at_once_but_by_at_most_max_step_per_period():
    decode = Decode(replicas=2)
    # wants 20: +4 at t=10, nothing more until the t=10 step is 15 s old, then up to the max
    assert [decode.tick(in_flight=200) for _ in range(3)] == [6, 6, 10]


def test_steady_load_keeps_the_replica_count():
    decode = Decode(replicas=3)
    assert [decode.tick(in_flight=30) for _ in range(10)] == [3] * 10


def test_drain_scales_down_only_after_the_window_and_one_by_one():
    decode = Decode(replicas=5)
    decode.tick(in_flight=50)  # t=10, recommendation 5
    ticks = [decode.tick(in_flight=0) for _ in range(10)]  # t=20..110
    # the t=10 recommendation of 5 holds until t=70; then -1 per 30 s period
    assert ticks == [5, 5, 5, 5, 5, 5, 4, 4, 4, 3]


def test_flapping_load_does_not_flap_replicas():
    decode = Decode(replicas=4)
    ticks = [decode.tick(in_flight=load) for load in [40, 5, 40, 5, 40, 5, 40, 5]]
    assert ticks == [4] * 8


def test_no_scale_up_while_earlier_pods_are_pending():
    decode = Decode(replicas=2)
    assert decode.tick(in_flight=100) == 6
    assert decode.tick(in_flight=100, num_pending=4, dt=20) == 6  # 2 ready, 4 still starting
    assert decode.tick(in_flight=100) == 10  # registered: continue


def test_min_replicas_is_restored_even_with_pending_pods():
    decode = Decode(replicas=0, policy=ScalingPolicy(min_replicas=2, max_replicas=4))
    assert decode.tick(in_flight=0, num_pending=0) == 2


def test_ratio_guard_raises_prefill_to_the_minimum_ratio():
    policies = {"prefill": POLICY, "decode": POLICY}
    desired, _ = decide(
        AutoscalerState(),
        10.0,
        {"prefill": 1, "decode": 8},
        {"prefill": telemetry(1, 0), "decode": telemetry(8, 80)},
        policies,
        RatioGuard(min_ratio=0.5, max_ratio=2.0),
    )
    assert desired == {"prefill": 4, "decode": 8}


def test_ratio_guard_caps_prefill_at_the_maximum_ratio():
    policies = {"prefill": POLICY, "decode": POLICY}
    desired, _ = decide(
        AutoscalerState(),
        10.0,
        {"prefill": 4, "decode": 2},
        {"prefill": telemetry(4, 200), "decode": telemetry(2, 20)},
        policies,
        RatioGuard(max_ratio=1.5),
    )
    assert desired == {"prefill": 3, "decode": 2}


def test_history_older_than_the_longest_window_is_dropped():
    decode = Decode(replicas=2)
    for _ in range(20):
        decode.tick(in_flight=20)
    assert len(decode.state.history["decode"]) == 7  # t within the last 60 s, 10 s apart


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_replicas": 3, "max_replicas": 2}, "min_replicas <= max_replicas"),
        ({"max_step_up": 0}, "max_step_up"),
        ({"scale_down_window_s": -1}, "windows and step periods must be >= 0"),
        ({"target_kv_usage": 0}, "target_kv_usage must be > 0"),
    ],
)
def test_invalid_policy_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScalingPolicy(**kwargs)
