"""Autoscaler: desired router/prefill/decode replicas from telemetry (pure; time is an input).

Per role, like the Kubernetes HPA:

1. raw recommendation: ``ceil(num_ready * max_i(metric_i / target_i))`` over the metrics that
   have a target: in-flight requests (queued + running) per ready replica, mean KV usage, TTFT
   p90 and ITL p90;
2. stabilisation: scale up to the *lowest* recommendation of the last ``scale_up_window_s``
   (0 s: at once), scale down to the *highest* of the last ``scale_down_window_s`` (slow), so a
   short dip or spike does not flap;
3. at most ``max_step_up`` replicas added per ``scale_up_period_s`` and ``max_step_down``
   removed per ``scale_down_period_s`` (the HPA's rate policies), within min/max;
4. no scale-up while pods of an earlier scale-up are still pending (not registered yet);
5. then a prefill:decode ratio guard keeps ``prefill / decode`` within [min_ratio, max_ratio]
   by adjusting prefill (a decision that would break min/max or the pending rule is not made).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

SCALED_ROLES = ("router", "prefill", "decode")


@dataclass(frozen=True)
class RoleTelemetry:
    """What the registry and the cluster say about one role right now."""

    num_ready: int  # workers heartbeating in the registry
    num_pending: int  # pods asked for but not registered yet
    num_queued: int = 0  # summed over ready workers
    num_running: int = 0
    kv_usage: float = 0.0  # mean over ready workers, 0..1
    ttft_p90_s: float = 0.0  # worst ready worker
    itl_p90_s: float = 0.0


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int = 1
    max_replicas: int = 8
    target_requests_per_replica: float | None = 8.0  # queued + running
    target_kv_usage: float | None = 0.8
    target_ttft_p90_s: float | None = None
    target_itl_p90_s: float | None = None
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    max_step_up: int = 4
    max_step_down: int = 1
    scale_up_period_s: float = 15.0
    scale_down_period_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("max_step_up and max_step_down must be >= 1")
        if min(self.scale_up_window_s, self.scale_down_window_s, self.scale_up_period_s, self.scale_down_period_s) < 0:
            raise ValueError("stabilisation windows and step periods must be >= 0 seconds")
        for name in ("target_requests_per_replica", "target_kv_usage", "target_ttft_p90_s", "target_itl_p90_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 when set, got {value}")


@dataclass(frozen=True)
class RatioGuard:
    """Allowed prefill:decode replica ratio."""

    min_ratio: float = 0.0
    max_ratio: float = math.inf


@dataclass(frozen=True)
class Recommendation:
    at: float  # clock seconds
    replicas: int


@dataclass(frozen=True)
class ScaleEvent:
    at: float  # clock seconds
    delta: int  # replicas added (> 0) or removed (< 0)


@dataclass(frozen=True)
class AutoscalerState:
    """Recent recommendations and scale events per role; keep it between decisions (kopf memo)."""

    history: dict[str, tuple[Recommendation, ...]] = field(default_factory=dict)
    events: dict[str, tuple[ScaleEvent, ...]] = field(default_factory=dict)


def raw_recommendation(current: int, telemetry: RoleTelemetry, policy: ScalingPolicy) -> int:
    """Step 1: replicas that would bring the worst metric to its target."""
    if telemetry.num_ready == 0:
        return current  # nothing measured yet
    ratios = [0.0]
    in_flight = (telemetry.num_queued + telemetry.num_running) / telemetry.num_ready
    for value, target in (
        (in_flight, policy.target_requests_per_replica),
        (telemetry.kv_usage, policy.target_kv_usage),
        (telemetry.ttft_p90_s, policy.target_ttft_p90_s),
        (telemetry.itl_p90_s, policy.target_itl_p90_s),
    ):
        if target is not None:
            ratios.append(value / target)
    return math.ceil(telemetry.num_ready * max(ratios) - 1e-9)


def _stabilise(history: tuple[Recommendation, ...], now: float, current: int, policy: ScalingPolicy) -> int:
    up = [r.replicas for r in history if now - r.at <= policy.scale_up_window_s]
    down = [r.replicas for r in history if now - r.at <= policy.scale_down_window_s]
    up_target, down_target = min(up), max(down)
    if up_target > current:
        return up_target
    if down_target < current:
        return down_target
    return current


def _bounded(
    current: int,
    desired: int,
    telemetry: RoleTelemetry,
    policy: ScalingPolicy,
    events: tuple[ScaleEvent, ...],
    now: float,
) -> int:
    added = sum(e.delta for e in events if e.delta > 0 and now - e.at < policy.scale_up_period_s)
    removed = -sum(e.delta for e in events if e.delta < 0 and now - e.at < policy.scale_down_period_s)
    desired = min(desired, current + max(policy.max_step_up - added, 0))
    desired = max(desired, current - max(policy.max_step_down - removed, 0))
    desired = min(max(desired, policy.min_replicas), policy.max_replicas)
    if desired > current and telemetry.num_pending > 0 and current >= policy.min_replicas:
        return current  # wait for the pods of the last scale-up to register
    return desired


def _step(
    history: tuple[Recommendation, ...],
    events: tuple[ScaleEvent, ...],
    now: float,
    current: int,
    raw: int,
    telemetry: RoleTelemetry,
    policy: ScalingPolicy,
) -> tuple[tuple[Recommendation, ...], tuple[ScaleEvent, ...], int]:
    """Steps 2-4 for one role: the kept history with ``raw`` added, the kept events, the desired count."""
    horizon = max(policy.scale_up_window_s, policy.scale_down_window_s)
    history = (*(r for r in history if now - r.at <= horizon), Recommendation(now, raw))
    period = max(policy.scale_up_period_s, policy.scale_down_period_s)
    events = tuple(e for e in events if now - e.at < period)
    desired = _bounded(current, _stabilise(history, now, current, policy), telemetry, policy, events, now)
    return history, events, desired


def stabilised(
    state: AutoscalerState,
    role: str,
    now: float,
    current: int,
    raw: int,
    telemetry: RoleTelemetry,
    policy: ScalingPolicy,
) -> tuple[int, AutoscalerState]:
    """Steps 2-4 for a role whose raw recommendation comes from elsewhere (the expert workers) and
    whose changes take several ticks to apply: the caller records each applied change with
    ``record_scale``, so the rate limits count what was done, not what was wished."""
    history, events, desired = _step(
        state.history.get(role, ()), state.events.get(role, ()), now, current, raw, telemetry, policy
    )
    return desired, dataclasses.replace(
        state, history={**state.history, role: history}, events={**state.events, role: events}
    )


def record_scale(state: AutoscalerState, role: str, now: float, delta: int) -> AutoscalerState:
    events = (*state.events.get(role, ()), ScaleEvent(now, delta))
    return dataclasses.replace(state, events={**state.events, role: events})


def decide(
    state: AutoscalerState,
    now: float,
    current: dict[str, int],
    telemetry: dict[str, RoleTelemetry],
    policies: dict[str, ScalingPolicy],
    ratio: RatioGuard = RatioGuard(),
) -> tuple[dict[str, int], AutoscalerState]:
    """Desired replicas per role in ``policies``; returns them with the updated state."""
    history = dict(state.history)
    events = dict(state.events)
    desired: dict[str, int] = {}
    for role, policy in policies.items():
        raw = raw_recommendation(current[role], telemetry[role], policy)
        history[role], events[role], desired[role] = _step(
            history.get(role, ()), events.get(role, ()), now, current[role], raw, telemetry[role], policy
        )
    if "prefill" in desired and "decode" in desired:
        desired["prefill"] = _guard_ratio(desired, current, telemetry, policies, ratio)
    for role, replicas in desired.items():
        if replicas != current[role]:
            events[role] = (*events[role], ScaleEvent(now, replicas - current[role]))
    return desired, dataclasses.replace(state, history=history, events=events)


def _guard_ratio(
    desired: dict[str, int],
    current: dict[str, int],
    telemetry: dict[str, RoleTelemetry],
    policies: dict[str, ScalingPolicy],
    ratio: RatioGuard,
) -> int:
    prefill, decode = desired["prefill"], desired["decode"]
    policy = policies["prefill"]
    if prefill > decode * ratio.max_ratio:
        prefill = max(math.floor(decode * ratio.max_ratio), policy.min_replicas)
    elif prefill < decode * ratio.min_ratio - 1e-9:
        wanted = min(math.ceil(decode * ratio.min_ratio - 1e-9), policy.max_replicas)
        if telemetry["prefill"].num_pending == 0 or wanted <= current["prefill"]:
            prefill = wanted
    return prefill
