"""Autoscaling step of the timer: registry records -> RoleTelemetry -> autoscaler decision."""

from __future__ import annotations

from moemesh.contracts.registry import WorkerRecord
from moemesh.operator.autoscaler import SCALED_ROLES, AutoscalerState, RoleTelemetry, decide
from moemesh.operator.spec import MeshSpec

# aggregated workers ('both') serve decode traffic
_REGISTRY_ROLES = {"router": ("router",), "prefill": ("prefill",), "decode": ("decode", "both")}


def role_telemetry(workers: list[WorkerRecord], role: str, current_replicas: int) -> RoleTelemetry:
    """Aggregate the live workers of ``role``; pods not (yet) registered count as pending."""
    mine = [w for w in workers if w.role in _REGISTRY_ROLES[role]]
    num_ready = len(mine)
    return RoleTelemetry(
        num_ready=num_ready,
        num_pending=max(current_replicas - num_ready, 0),
        num_queued=sum(w.num_queued for w in mine),
        num_running=sum(w.num_running for w in mine),
        kv_usage=sum(w.kv_usage for w in mine) / num_ready if num_ready else 0.0,
        ttft_p90_s=max((w.ttft_p90_s for w in mine), default=0.0),
        itl_p90_s=max((w.itl_p90_s for w in mine), default=0.0),
    )


def scale_step(
    state: AutoscalerState,
    now: float,
    spec: MeshSpec,
    current: dict[str, int],
    workers: list[WorkerRecord],
) -> tuple[dict[str, int], dict[str, RoleTelemetry], AutoscalerState]:
    """Desired replicas of router/prefill/decode, the telemetry they came from, the new state."""
    telemetry = {role: role_telemetry(workers, role, current[role]) for role in SCALED_ROLES}
    policies = {role: spec.policy_for(role) for role in SCALED_ROLES}
    desired, state = decide(state, now, current, telemetry, policies, spec.autoscaling.ratio)
    return desired, telemetry, state
