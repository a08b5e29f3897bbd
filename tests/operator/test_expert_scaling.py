"""Expert-worker autoscaling: the decision (load and memory signals, stabilised) and the order of
placement and replica changes (scale up, then spread; scale down only after a placement without
the leaving workers is active and their replicas drained), simulated tick by tick with a clock."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from moemesh.operator.autoscaler import AutoscalerState
from moemesh.operator.expert_scaling import (
    ExpertScalingPolicy,
    ExpertTelemetry,
    Hold,
    PlaceOver,
    ScaleTo,
    applied,
    decide_expert_workers,
    layout_for,
    next_action,
)
from moemesh.operator.spec import SpecError, parse_spec

NUM_EXPERTS = 16
POLICY = ExpertScalingPolicy(
    min_workers=1,
    max_workers=8,
    slots_per_worker=8,
    target_tokens_per_second=1000.0,
    scale_up_window_s=0,
    scale_down_window_s=60,
    max_step_up=2,
    max_step_down=1,
    scale_up_period_s=10,
    scale_down_period_s=30,
)


def test_memory_sets_the_floor_and_load_the_rest():
    assert POLICY.min_workers_for_memory(NUM_EXPERTS) == 2  # 16 experts / 8 slots
    state = AutoscalerState()
    idle = ExpertTelemetry(num_ready=2, num_pending=0, tokens_per_second=0.0)
    desired, state = decide_expert_workers(state, 0.0, 2, idle, POLICY, NUM_EXPERTS)
    assert desired == 2  # never below one copy of every expert
    busy = ExpertTelemetry(num_ready=2, num_pending=0, tokens_per_second=3500.0)
    desired, state = decide_expert_workers(state, 1.0, 2, busy, POLICY, NUM_EXPERTS)
    assert desired == 4  # ceil(3.5) = 4, within max_step_up 2


def test_a_layout_uses_every_slot_of_every_worker():
    layout = layout_for(3, NUM_EXPERTS, POLICY)
    assert (layout.num_workers, layout.num_slots, layout.slots_per_worker) == (3, 24, 8)
    with pytest.raises(ValueError):
        ExpertScalingPolicy(min_workers=0, max_workers=2, slots_per_worker=8, target_tokens_per_second=1.0)


@dataclass
class FakeMesh:
    """What the operator observes and changes: the StatefulSet, registrations, placements."""

    replicas: int = 2
    registered: int = 2
    active_workers: int | None = 2
    pending_workers: int | None = None
    pending_since: float = 0.0
    active_since: float = 0.0
    log: list = field(default_factory=list)

    def tick(self, now: float, action) -> None:
        self.log.append((now, action))
        if isinstance(action, ScaleTo):
            self.replicas = action.num_workers
            self.registered = min(self.registered, self.replicas)
        elif isinstance(action, PlaceOver):
            self.pending_workers, self.pending_since = action.num_workers, now
        # the world moves: pods register 5 s after asked, placements activate 3 s after publishing
        if self.registered < self.replicas and now - self._last_scale(now) >= 5:
            self.registered = self.replicas
        if self.pending_workers is not None and now - self.pending_since >= 3:
            self.active_workers, self.pending_workers, self.active_since = self.pending_workers, None, now

    def _last_scale(self, now):
        times = [t for t, a in self.log if isinstance(a, ScaleTo)]
        return times[-1] if times else now

    def drained(self, now: float, desired: int) -> bool:
        return self.active_workers == desired and now - self.active_since >= 2  # release grace


def run(mesh: FakeMesh, load, until: float, step: float = 1.0) -> list:
    state, now, actions = AutoscalerState(), 0.0, []
    while now <= until:
        telemetry = ExpertTelemetry(
            num_ready=mesh.registered, num_pending=mesh.replicas - mesh.registered, tokens_per_second=load(now)
        )
        desired, state = decide_expert_workers(state, now, mesh.replicas, telemetry, POLICY, NUM_EXPERTS)
        action = next_action(
            mesh.replicas,
            desired,
            mesh.registered,
            mesh.active_workers,
            mesh.pending_workers,
            mesh.drained(now, desired),
        )
        if isinstance(action, ScaleTo):
            state = applied(state, now, mesh.replicas, action.num_workers)
        mesh.tick(now, action)
        actions.append((now, desired, action, mesh.replicas, mesh.active_workers))
        now += step
    return actions


def test_scale_up_grows_the_statefulset_then_spreads_the_placement_over_the_new_workers():
    mesh = FakeMesh()
    actions = run(mesh, lambda t: 3800.0 if t >= 5 else 500.0, until=60)
    scale_ups = [a for _, _, a, _, _ in actions if isinstance(a, ScaleTo)]
    places = [a for _, _, a, _, _ in actions if isinstance(a, PlaceOver)]
    assert scale_ups[0] == ScaleTo(4) and places and places[0] == PlaceOver(4)
    first_scale = next(t for t, _, a, _, _ in actions if a == ScaleTo(4))
    first_place = next(t for t, _, a, _, _ in actions if a == PlaceOver(4))
    assert first_place >= first_scale + 5  # only once the new pods registered
    assert (mesh.replicas, mesh.active_workers) == (4, 4)


def test_scale_down_moves_replicas_off_the_leaving_workers_before_their_pods_go():
    mesh = FakeMesh(replicas=4, registered=4, active_workers=4)
    actions = run(mesh, lambda t: 3900.0 if t < 30 else 1500.0, until=300)  # then 2 workers' worth
    order = [(t, a) for t, _, a, _, _ in actions if not isinstance(a, Hold)]
    assert order[0][0] >= 30 + 60  # the scale-down window held the first step back
    assert [a for _, a in order] == [PlaceOver(3), ScaleTo(3), PlaceOver(2), ScaleTo(2)]  # one step at a time
    (place3, scale3, place2, scale2) = [t for t, _ in order]
    assert scale3 >= place3 + 3 + 2 and scale2 >= place2 + 3 + 2  # placement active, then the grace drained
    assert scale2 >= scale3 + 30  # scale_down_period between steps
    for t, a in order:  # when a pod goes, no active placement still gives it slots
        if isinstance(a, ScaleTo):
            active = next(act for (when, _, _, _, act) in actions if when == t)
            assert active <= a.num_workers
    assert (mesh.replicas, mesh.active_workers) == (2, 2)


def test_load_that_oscillates_inside_the_down_window_does_not_flap():
    mesh = FakeMesh(replicas=4, registered=4, active_workers=4)
    actions = run(mesh, lambda t: 3900.0 if int(t) % 20 < 10 else 1000.0, until=240)
    assert [a for _, _, a, _, _ in actions if not isinstance(a, Hold)] == []
    assert mesh.replicas == 4


SCALED_MESH = {
    "model": {"name": "m", "source": {"hostPath": {"path": "/m"}}, "numMoeLayers": 2, "numExperts": 16},
    "expert": {"replicas": 2, "maxReplicas": 6},
    "eplb": {"redundantSlots": 4},
    "autoscaling": {"expert": {"enabled": True, "targetTokensPerSecond": 1000}},
}


def scaled_spec(**changes):
    spec = {**SCALED_MESH, **changes}
    return parse_spec(spec, default_image="unused")


def test_each_pod_keeps_the_slots_the_spec_gives_it_and_memory_sets_the_floor():
    policy = scaled_spec().expert_autoscaling
    assert (policy.min_workers, policy.max_workers, policy.slots_per_worker) == (2, 6, 10)  # (16 + 4) / 2
    assert policy.min_workers_for_memory(16) == 2
    assert layout_for(3, 16, policy).num_slots == 30
    assert scaled_spec(autoscaling={}).expert_autoscaling is None


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"eplb": {"enabled": False}}, "needs spec.eplb.enabled"),
        ({"expert": {"replicas": 0}}, "needs expert workers"),
        ({"autoscaling": {"expert": {"enabled": True, "targetTokensPerSecond": 0}}}, "target_tokens_per_second"),
        (
            {"eplb": {"redundantSlots": 4, "numNodes": 2}, "expert": {"replicas": 2, "maxReplicas": 5}},
            "max_workers=5 must be multiples of the 2 nodes",
        ),
    ],
)
def test_expert_autoscaling_that_cannot_work_is_a_spec_error(changes, message):
    with pytest.raises(SpecError, match=message):
        scaled_spec(**changes)


def test_whole_nodes_round_every_recommendation_up():
    policy = ExpertScalingPolicy(
        min_workers=2,
        max_workers=8,
        slots_per_worker=4,
        target_tokens_per_second=100.0,
        worker_multiple=2,
        max_step_up=4,
        max_step_down=2,
    )
    busy = ExpertTelemetry(num_ready=2, num_pending=0, tokens_per_second=250.0)  # 2.5 workers' worth
    desired, _ = decide_expert_workers(AutoscalerState(), 0.0, 2, busy, policy, num_experts=8)
    assert desired == 4
    assert policy.min_workers_for_memory(12) == 4  # 3 workers' memory, a whole node more
