"""Expert-worker autoscaling (pure; time is an input): how many expert workers, and the safe order
of placement changes and replica-count changes that gets there.

Signals: the routed-expert tokens per second the expert workers computed over the last load
windows (``read_expert_load``), against a per-worker target; and memory: every logical expert
needs a slot, a worker holds ``slots_per_worker`` replicas (what fits its GPU memory), so at least
``ceil(num_experts / slots_per_worker)`` workers. The raw recommendation is the larger of the
two; it is then stabilised and rate-limited exactly as the P/D autoscaler does (scale up to the
lowest recommendation of ``scale_up_window_s``, down to the highest of ``scale_down_window_s``,
at most ``max_step_*`` per period) so a burst or a dip does not flap.

A change of worker count is applied in an order that never drops a request:
- scale up: grow the StatefulSet first; once the new workers are registered, plan a placement
  over all of them (two-phase apply: they load, report ready, then dispatchers switch);
- scale down: first plan and apply a placement over the workers that stay (the highest
  ordinals hold no slot in it), wait until it is active and the leaving workers are idle for
  the release grace (their replicas drained), then shrink the StatefulSet.
``next_action`` is that state machine, one timer tick at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moemesh.operator.autoscaler import AutoscalerState, RoleTelemetry, ScalingPolicy, record_scale, stabilised
from moemesh.operator.eplb import EplbLayout

ROLE = "expert"


@dataclass(frozen=True)
class ExpertScalingPolicy:
    min_workers: int
    max_workers: int
    slots_per_worker: int  # replicas one worker holds (its GPU memory)
    target_tokens_per_second: float  # routed-expert tokens per worker per second
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    max_step_up: int = 2
    max_step_down: int = 1
    scale_up_period_s: float = 60.0
    scale_down_period_s: float = 120.0
    worker_multiple: int = 1  # workers come in whole nodes (EPLB's num_nodes): every count is a multiple

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}")
        if self.slots_per_worker < 1 or self.target_tokens_per_second <= 0:
            raise ValueError("slots_per_worker must be >= 1 and target_tokens_per_second > 0")
        counts = {
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "max_step_up": self.max_step_up,
            "max_step_down": self.max_step_down,
        }
        uneven = [f"{name}={value}" for name, value in counts.items() if value % self.worker_multiple]
        if uneven:
            raise ValueError(f"{', '.join(uneven)} must be multiples of the {self.worker_multiple} nodes")

    def scaling_policy(self, num_experts: int) -> ScalingPolicy:
        return ScalingPolicy(
            min_replicas=max(self.min_workers, self.min_workers_for_memory(num_experts)),
            max_replicas=self.max_workers,
            target_requests_per_replica=None,
            target_kv_usage=None,
            scale_up_window_s=self.scale_up_window_s,
            scale_down_window_s=self.scale_down_window_s,
            max_step_up=self.max_step_up,
            max_step_down=self.max_step_down,
            scale_up_period_s=self.scale_up_period_s,
            scale_down_period_s=self.scale_down_period_s,
        )

    def min_workers_for_memory(self, num_experts: int) -> int:
        return self.whole_nodes(math.ceil(num_experts / self.slots_per_worker))

    def whole_nodes(self, num_workers: int) -> int:
        """``num_workers`` rounded up to a multiple of ``worker_multiple``."""
        return -(-num_workers // self.worker_multiple) * self.worker_multiple


@dataclass(frozen=True)
class ExpertTelemetry:
    num_ready: int  # expert workers heartbeating in the registry
    num_pending: int  # pods asked for but not registered
    tokens_per_second: float  # summed over the workers, over the recent load windows


def layout_for(
    num_workers: int, num_experts: int, policy: ExpertScalingPolicy, num_groups: int = 1, num_nodes: int = 1
) -> EplbLayout:
    """Every worker's slots in use: num_slots = num_workers * slots_per_worker (>= num_experts)."""
    return EplbLayout(
        num_experts=num_experts,
        num_slots=num_workers * policy.slots_per_worker,
        num_workers=num_workers,
        num_groups=num_groups,
        num_nodes=num_nodes,
    )


def raw_workers(telemetry: ExpertTelemetry, policy: ExpertScalingPolicy, num_experts: int, current: int) -> int:
    memory = policy.min_workers_for_memory(num_experts)
    if telemetry.num_ready == 0:
        return max(current, memory)  # nothing measured yet
    return max(
        memory, policy.whole_nodes(math.ceil(telemetry.tokens_per_second / policy.target_tokens_per_second - 1e-9))
    )


def decide_expert_workers(
    state: AutoscalerState,
    now: float,
    current: int,
    telemetry: ExpertTelemetry,
    policy: ExpertScalingPolicy,
    num_experts: int,
) -> tuple[int, AutoscalerState]:
    """Desired expert workers (stabilised, rate-limited, within min/max and memory)."""
    raw = raw_workers(telemetry, policy, num_experts, current)
    role_telemetry = RoleTelemetry(num_ready=telemetry.num_ready, num_pending=telemetry.num_pending)
    return stabilised(state, ROLE, now, current, raw, role_telemetry, policy.scaling_policy(num_experts))


def applied(state: AutoscalerState, now: float, before: int, after: int) -> AutoscalerState:
    """Record a StatefulSet resize (``ScaleTo``) for the rate limits."""
    return record_scale(state, ROLE, now, after - before) if after != before else state


@dataclass(frozen=True)
class ScaleTo:
    """Set the StatefulSet's replicas."""

    num_workers: int


@dataclass(frozen=True)
class PlaceOver:
    """Plan and publish (two-phase) a placement over the first ``num_workers`` workers."""

    num_workers: int


@dataclass(frozen=True)
class Hold:
    reason: str


Action = ScaleTo | PlaceOver | Hold


def next_action(
    replicas: int,  # the StatefulSet's spec.replicas now
    desired: int,  # decide_expert_workers' answer
    num_registered: int,  # expert workers with ordinal < replicas in the registry
    active_workers: int | None,  # workers of the active placement (None: none active)
    pending_workers: int | None,  # workers of a published, not yet active placement
    leaving_drained: bool,  # workers with ordinal >= desired: no call in flight for the release grace
) -> Action:
    if pending_workers is not None:
        return Hold(f"placement over {pending_workers} workers is loading")
    if desired > replicas:
        return ScaleTo(desired)
    if desired < replicas:
        if active_workers != desired:
            return PlaceOver(desired)  # move every replica off the leaving workers first
        if not leaving_drained:
            return Hold("draining the leaving workers' replicas")
        return ScaleTo(desired)
    if num_registered < replicas:
        return Hold(f"{replicas - num_registered} expert workers not registered yet")
    if active_workers != replicas:
        return PlaceOver(replicas)  # grown: spread replicas over the new workers
    return Hold("steady")
