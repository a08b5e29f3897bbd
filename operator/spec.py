"""InferenceMesh spec: parsed once from the custom resource into frozen, validated dataclasses.

The CRD's OpenAPI schema (charts/moemesh/crds/) already rejects wrong types at admission; this
module checks what a schema cannot (min <= replicas <= max, slots dividing over workers, a
threshold in range) and fills defaults. ``SpecError`` carries a message for the status condition.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from moemesh.operator.autoscaler import RatioGuard, ScalingPolicy
from moemesh.operator.engine_spec import EngineSpec, EngineSpecError, parse_engine
from moemesh.operator.eplb import EplbError, EplbLayout
from moemesh.operator.expert_scaling import ExpertScalingPolicy
from moemesh.operator.model_source_volumes import ModelSource, SourceError, parse_source
from moemesh.planning.checkpoint_tensors import ModelConfigError
from moemesh.planning.memory_plan import MemoryPlanError, parse_size, plan_mesh
from moemesh.runtime.engine_config import DTYPES

ROLES = ("router", "prefill", "decode", "expert")
# spec.<role> keys copied verbatim into the pod spec
POD_FIELDS = ("runtimeClassName", "affinity", "topologySpreadConstraints", "priorityClassName")


# the workers' --expert-transport choices (services/worker/settings.py EXPERT_TRANSPORTS; a test keeps them equal)
EXPERT_TRANSPORTS = ("grpc", "grpc-stream", "torch-dist", "socket")


class SpecError(ValueError):
    """The custom resource cannot be served as written; the message says what to fix."""

    reason = "InvalidSpec"  # the status condition's reason


class ExpertMemoryError(SpecError):
    """The expert pods cannot hold every expert replica in their GPU memory (the memory plan)."""

    reason = "ExpertPodsTooFew"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: ModelSource
    num_moe_layers: int = 0
    num_experts: int = 0
    num_expert_groups: int = 1
    config: dict[str, Any] | None = None  # the checkpoint's config.json, for the memory plan
    gpu_memory_bytes: int | None = None  # one pod's GPU memory, for the memory plan


@dataclass(frozen=True)
class RoleSpec:
    replicas: int
    min_replicas: int
    max_replicas: int
    resources: dict[str, Any]  # {requests: {...}, limits: {...}} as in a container spec
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]
    # copied verbatim into the role's pod template (Kubernetes-typed; the CRD schema checks them)
    pod_fields: dict[str, Any] = field(default_factory=dict)  # runtimeClassName, affinity, ...
    env: tuple[dict[str, Any], ...] = ()  # appended to the container env
    volumes: tuple[dict[str, Any], ...] = ()  # appended to the pod volumes
    volume_mounts: tuple[dict[str, Any], ...] = ()  # appended to the container volumeMounts


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool
    policy: ScalingPolicy  # the targets and windows; min/max come per role
    ratio: RatioGuard


@dataclass(frozen=True)
class EplbSpec:
    enabled: bool
    redundant_slots: int
    interval_s: float
    imbalance_threshold: float
    num_nodes: int


@dataclass(frozen=True)
class RedisSpec:
    url: str | None  # None: the operator's default (the chart's Redis)
    password_secret_name: str | None
    password_secret_key: str


@dataclass(frozen=True)
class MeshSpec:
    model: ModelSpec
    image: str
    image_pull_policy: str
    roles: dict[str, RoleSpec]
    autoscaling: AutoscalingSpec
    eplb: EplbSpec
    redis: RedisSpec
    otlp_endpoint: str | None = None  # spec.telemetry.otlpEndpoint: where every service exports traces
    expert_transport: str = "grpc-stream"  # spec.expertTransport: the workers' expert data plane
    image_pull_secrets: tuple[str, ...] = ()  # spec.imagePullSecrets[*].name, on every pod
    api_key_secret: tuple[str, str] | None = None  # spec.apiKeySecretRef (name, key): the router's API keys
    drain_s: float = 30.0  # spec.drainSeconds: SIGTERM -> in-flight requests may finish this long
    expert_autoscaling: ExpertScalingPolicy | None = None  # spec.autoscaling.expert; None: spec.expert.replicas
    engine: EngineSpec = field(default_factory=EngineSpec)  # spec.engine, spec.<role>.engine (engine_spec.py)

    def policy_for(self, role: str) -> ScalingPolicy:
        role_spec = self.roles[role]
        base = self.autoscaling.policy
        return ScalingPolicy(
            min_replicas=role_spec.min_replicas,
            max_replicas=role_spec.max_replicas,
            target_requests_per_replica=base.target_requests_per_replica,
            target_kv_usage=base.target_kv_usage,
            target_ttft_p90_s=base.target_ttft_p90_s if role == "prefill" else None,
            target_itl_p90_s=base.target_itl_p90_s if role == "decode" else None,
            scale_up_window_s=base.scale_up_window_s,
            scale_down_window_s=base.scale_down_window_s,
            max_step_up=base.max_step_up,
            max_step_down=base.max_step_down,
            scale_up_period_s=base.scale_up_period_s,
            scale_down_period_s=base.scale_down_period_s,
        )

    @property
    def expert_layout(self) -> EplbLayout | None:
        """The EPLB layout, or None when the mesh runs no expert workers."""
        num_workers = self.roles["expert"].replicas
        if self.model.num_experts == 0 or self.model.num_moe_layers == 0 or num_workers == 0:
            return None
        return EplbLayout(
            num_experts=self.model.num_experts,
            num_slots=self.model.num_experts + self.eplb.redundant_slots,
            num_workers=num_workers,
            num_groups=self.model.num_expert_groups,
            num_nodes=self.eplb.num_nodes,
        )


def _int(section: dict[str, Any], key: str, default: int, path: str, minimum: int = 0) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{path}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(section: dict[str, Any], key: str, default: float, path: str) -> float:
    """A non-negative number; absent or null: the default."""
    value = _optional_float(section, key, default, path)
    return default if value is None else value


def _optional_float(section: dict[str, Any], key: str, default: float | None, path: str) -> float | None:
    """A non-negative number; absent: the default; null: None (the setting is off)."""
    if key not in section:
        return default
    value = section[key]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SpecError(f"{path}.{key} must be a non-negative number, got {value!r}")
    return float(value)


def _section(spec: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = spec.get(key) or {}
    if not isinstance(value, dict):
        raise SpecError(f"{path}.{key} must be an object, got {type(value).__name__}")
    return value


def _expert_transport(spec: dict[str, Any]) -> str:
    value = spec.get("expertTransport", "grpc-stream")
    if value not in EXPERT_TRANSPORTS:
        raise SpecError(f"spec.expertTransport must be one of {list(EXPERT_TRANSPORTS)}, got {value!r}")
    return value


def _otlp_endpoint(telemetry: dict[str, Any]) -> str | None:
    value = telemetry.get("otlpEndpoint")
    if value is not None and (not isinstance(value, str) or not value or any(c.isspace() for c in value)):
        raise SpecError(f"spec.telemetry.otlpEndpoint must be a host:port or URL, got {value!r}")
    return value or None


DEFAULT_REPLICAS = {"router": 1, "prefill": 1, "decode": 1, "expert": 0}


def _role(spec: dict[str, Any], role: str) -> RoleSpec:
    section = _section(spec, role, "spec")
    path = f"spec.{role}"
    replicas = _int(section, "replicas", DEFAULT_REPLICAS[role], path)
    min_replicas = _int(section, "minReplicas", min(replicas, 1) if role != "expert" else replicas, path)
    max_replicas = _int(section, "maxReplicas", max(replicas, min_replicas), path)
    if not min_replicas <= replicas <= max_replicas:
        raise SpecError(
            f"{path}: need minReplicas <= replicas <= maxReplicas, got {min_replicas} <= {replicas} <= {max_replicas}"
        )
    resources = section.get("resources") or {}
    if not isinstance(resources, dict) or set(resources) - {"requests", "limits"}:
        raise SpecError(f"{path}.resources must be an object with requests/limits, got {resources!r}")
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    if "nvidia.com/gpu" in requests and requests.get("nvidia.com/gpu") != limits.get("nvidia.com/gpu"):
        raise SpecError(f"{path}.resources: nvidia.com/gpu must be set in limits (requests, if set, must equal limits)")
    return RoleSpec(
        replicas=replicas,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        resources={key: dict(value) for key, value in resources.items() if value},
        node_selector=dict(section.get("nodeSelector") or {}),
        tolerations=tuple(section.get("tolerations") or ()),
        pod_fields={key: section[key] for key in POD_FIELDS if section.get(key)},
        env=_named_list(section, "env", path),
        volumes=_named_list(section, "volumes", path),
        volume_mounts=_named_list(section, "volumeMounts", path),
    )


def _named_list(section: dict[str, Any], key: str, path: str) -> tuple[dict[str, Any], ...]:
    items = section.get(key) or []
    if not isinstance(items, list) or not all(isinstance(item, dict) and item.get("name") for item in items):
        raise SpecError(f"{path}.{key} must be a list of objects with a name, got {items!r}")
    return tuple(items)


def parse_spec(spec: dict[str, Any], default_image: str) -> MeshSpec:
    """Validate and default an InferenceMesh ``spec``; raises ``SpecError``."""
    model = _section(spec, "model", "spec")
    if not model.get("name") or not model.get("source"):
        raise SpecError("spec.model.name and spec.model.source are required")
    model_spec = ModelSpec(
        name=str(model["name"]),
        source=_source(model["source"]),
        num_moe_layers=_int(model, "numMoeLayers", 0, "spec.model"),
        num_experts=_int(model, "numExperts", 0, "spec.model"),
        num_expert_groups=_int(model, "numExpertGroups", 1, "spec.model", minimum=1),
        config=_section(model, "config", "spec.model") or None,
        gpu_memory_bytes=_gpu_memory(model.get("gpuMemory")),
    )
    image = _section(spec, "image", "spec")
    repository = image.get("repository")
    image_ref = f"{repository}:{image.get('tag', 'latest')}" if repository else default_image

    scaling = _section(spec, "autoscaling", "spec")
    path = "spec.autoscaling"
    ratio = _section(scaling, "prefillDecodeRatio", path)
    try:
        policy = ScalingPolicy(
            target_requests_per_replica=_optional_float(scaling, "targetRequestsPerReplica", 8.0, path) or None,
            target_kv_usage=_optional_float(scaling, "targetKvUsage", 0.8, path) or None,
            target_ttft_p90_s=_optional_float(scaling, "targetTtftP90Seconds", None, path) or None,
            target_itl_p90_s=_optional_float(scaling, "targetItlP90Seconds", None, path) or None,
            scale_up_window_s=_float(scaling, "scaleUpWindowSeconds", 0.0, path),
            scale_down_window_s=_float(scaling, "scaleDownWindowSeconds", 300.0, path),
            max_step_up=_int(scaling, "maxStepUp", 4, path, minimum=1),
            max_step_down=_int(scaling, "maxStepDown", 1, path, minimum=1),
            scale_up_period_s=_float(scaling, "scaleUpPeriodSeconds", 15.0, path),
            scale_down_period_s=_float(scaling, "scaleDownPeriodSeconds", 60.0, path),
        )
    except ValueError as exc:
        raise SpecError(f"{path}: {exc}") from exc
    guard = RatioGuard(
        min_ratio=_float(ratio, "min", 0.0, f"{path}.prefillDecodeRatio"),
        max_ratio=_float(ratio, "max", math.inf, f"{path}.prefillDecodeRatio"),
    )
    if guard.min_ratio > guard.max_ratio:
        raise SpecError(f"{path}.prefillDecodeRatio: min {guard.min_ratio} exceeds max {guard.max_ratio}")

    eplb = _section(spec, "eplb", "spec")
    threshold = _float(eplb, "imbalanceThreshold", 0.05, "spec.eplb")
    if threshold >= 1:
        raise SpecError(f"spec.eplb.imbalanceThreshold must be below 1 (a relative improvement), got {threshold}")
    redis_section = _section(spec, "redis", "spec")
    secret = _section(redis_section, "passwordSecretRef", "spec.redis")
    if secret and not secret.get("name"):
        raise SpecError("spec.redis.passwordSecretRef.name is required when passwordSecretRef is set")
    mesh = MeshSpec(
        model=model_spec,
        image=image_ref,
        image_pull_policy=str(image.get("pullPolicy", "IfNotPresent")),
        roles={role: _role(spec, role) for role in ROLES},
        autoscaling=AutoscalingSpec(bool(scaling.get("enabled", False)), policy, guard),
        eplb=EplbSpec(
            enabled=bool(eplb.get("enabled", True)),
            redundant_slots=_int(eplb, "redundantSlots", 0, "spec.eplb"),
            interval_s=_float(eplb, "intervalSeconds", 300.0, "spec.eplb"),
            imbalance_threshold=threshold,
            num_nodes=_int(eplb, "numNodes", 1, "spec.eplb", minimum=1),
        ),
        redis=RedisSpec(
            url=redis_section.get("url") or None,
            password_secret_name=secret.get("name") or None,
            password_secret_key=str(secret.get("key", "redis-password")),
        ),
        otlp_endpoint=_otlp_endpoint(_section(spec, "telemetry", "spec")),
        expert_transport=_expert_transport(spec),
        image_pull_secrets=tuple(ref["name"] for ref in _named_list(spec, "imagePullSecrets", "spec")),
        api_key_secret=_secret_ref(spec, "apiKeySecretRef", "spec", "api-key"),
        drain_s=_float(spec, "drainSeconds", 30.0, "spec"),
        engine=_engine(spec, _model_dtype(model)),
    )
    try:
        layout = mesh.expert_layout  # validates the expert/EPLB combination
    except EplbError as exc:
        raise SpecError(f"spec.expert/spec.eplb/spec.model: {exc}") from exc
    _check_expert_memory(mesh)
    expert_scaling = _section(scaling, "expert", path)
    if expert_scaling.get("enabled", False):
        mesh = dataclasses.replace(mesh, expert_autoscaling=_expert_scaling(expert_scaling, mesh, layout))
    return mesh


def _expert_scaling(section: dict[str, Any], mesh: MeshSpec, layout: EplbLayout | None) -> ExpertScalingPolicy:
    """spec.autoscaling.expert: the expert StatefulSet's size from routed-expert load and memory.
    A pod holds the slots the spec gives it (``(numExperts + redundantSlots) / expert.replicas``,
    what the memory plan checked), so each worker count n has n times that many slots. With
    ``eplb.numNodes`` > 1 every count and step is a multiple of it (whole nodes)."""
    path = "spec.autoscaling.expert"
    if layout is None:
        raise SpecError(
            f"{path} needs expert workers: spec.expert.replicas >= 1 and spec.model numMoeLayers/numExperts"
        )
    if not mesh.eplb.enabled:
        raise SpecError(f"{path} needs spec.eplb.enabled: the EPLB step publishes the placement for each worker count")
    nodes = layout.num_nodes
    role = mesh.roles["expert"]
    target = _float(section, "targetTokensPerSecond", 50000.0, path)
    try:
        policy = ExpertScalingPolicy(
            min_workers=role.min_replicas,
            max_workers=role.max_replicas,
            slots_per_worker=layout.slots_per_worker,
            target_tokens_per_second=target,
            worker_multiple=nodes,
            scale_up_window_s=_float(section, "scaleUpWindowSeconds", 0.0, path),
            scale_down_window_s=_float(section, "scaleDownWindowSeconds", 300.0, path),
            max_step_up=_int(section, "maxStepUp", 2 * nodes, path, minimum=1),
            max_step_down=_int(section, "maxStepDown", nodes, path, minimum=1),
            scale_up_period_s=_float(section, "scaleUpPeriodSeconds", 60.0, path),
            scale_down_period_s=_float(section, "scaleDownPeriodSeconds", 120.0, path),
        )
    except ValueError as exc:
        raise SpecError(f"{path} (with spec.expert minReplicas/maxReplicas): {exc}") from exc
    return policy


MODEL_DTYPES = DTYPES  # spec.model.dtype: the engine's dtypes


def _model_dtype(model: dict[str, Any]) -> str | None:
    """spec.model.dtype, the engine's dtype before spec.engine.dtype (which wins when both are set)."""
    value = model.get("dtype")
    if value is not None and value not in MODEL_DTYPES:
        raise SpecError(f"spec.model.dtype must be one of {list(MODEL_DTYPES)}, got {value!r}")
    return value


def _engine(spec: dict[str, Any], legacy_dtype: str | None) -> EngineSpec:
    try:
        return parse_engine(spec, legacy_dtype)
    except EngineSpecError as exc:
        raise SpecError(str(exc)) from exc


def _secret_ref(section: dict[str, Any], key: str, path: str, default_key: str) -> tuple[str, str] | None:
    ref = _section(section, key, path)
    if not ref:
        return None
    if not isinstance(ref.get("name"), str) or not ref["name"]:
        raise SpecError(f"{path}.{key}.name is required when {key} is set")
    return ref["name"], str(ref.get("key") or default_key)


def _gpu_memory(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except MemoryPlanError as exc:
        raise SpecError(f"spec.model.gpuMemory: {exc}") from exc


def _check_expert_memory(mesh: MeshSpec) -> None:
    """With spec.model.config and spec.model.gpuMemory, the memory plan (the same function as
    `moemesh plan`) decides whether spec.expert.replicas pods hold every expert replica."""
    model = mesh.model
    if model.config is None or model.gpu_memory_bytes is None:
        return
    try:
        plan = plan_mesh(
            model.config,
            None,
            model.gpu_memory_bytes,
            expert_pods=mesh.roles["expert"].replicas,
            redundant_experts=mesh.eplb.redundant_slots,
        )
    except (ModelConfigError, MemoryPlanError) as exc:
        raise SpecError(f"spec.model.config: {exc}") from exc
    if plan.expert_pods_problem:
        raise ExpertMemoryError(f"spec.expert.replicas={mesh.roles['expert'].replicas}: {plan.expert_pods_problem}")


def _source(source: Any) -> ModelSource:
    try:
        return parse_source(source)
    except SourceError as exc:
        raise SpecError(str(exc)) from exc
