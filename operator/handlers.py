"""Kopf handlers of the InferenceMesh operator. They read state, call a decision, apply it.

``register(registry, config)`` adds them to a kopf registry (tests use their own registry and
config); ``moemesh.operator.main`` registers them into kopf's default registry for
``kopf run -m moemesh.operator.main``.

- login: kopf's service-account or kubeconfig login; the same credentials serve ``KubeApi``;
- create/update/resume: parse the spec, apply the children, record conditions. A bad spec only
  sets ``SpecValid=False`` with the reason (no retry loop, no half-applied children);
- timer: autoscale router/prefill/decode from the registry, scale the expert workers (placement
  first on the way down, StatefulSet first on the way up), run the EPLB step, report failed
  containers of the mesh's pods (PodsHealthy), record status; re-apply when a workload is missing;
- child deleted: a Deployment, StatefulSet, Service, ConfigMap or PodDisruptionBudget of a mesh
  that someone deleted is re-applied at once (event handlers: kopf puts no finalizer on children);
- delete: delete the children (owner references also let the garbage collector do it) and the
  mesh's placement keys in Redis.
"""

from __future__ import annotations

import asyncio
import math
import time
import weakref
from typing import Any

import kopf
import redis

from moemesh.contracts.registry import list_workers
from moemesh.operator import manifests
from moemesh.operator.autoscaler import SCALED_ROLES, AutoscalerState
from moemesh.operator.config import OperatorConfig
from moemesh.operator.eplb import EplbLayout
from moemesh.operator.expert_scaling import PlaceOver, ScaleTo, layout_for
from moemesh.operator.expert_step import ExpertScaleOutcome, expert_scale_step
from moemesh.operator.kube import KubeApi, KubeError
from moemesh.operator.pod_health import FORBIDDEN, PodsHealth, pods_health, with_pods_health
from moemesh.operator.rebalance import delete_placements, rebalance_step
from moemesh.operator.scaling import scale_step
from moemesh.operator.spec import MeshSpec, SpecError, parse_spec
from moemesh.operator.status import merge_owned, set_condition

RESOURCE = (manifests.GROUP, manifests.VERSION, manifests.PLURAL)
WORKLOAD_KIND = {"router": "Deployment", "prefill": "Deployment", "decode": "Deployment", "expert": "StatefulSet"}
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("apps", "v1", "statefulsets"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("policy", "v1", "poddisruptionbudgets"),
)
MANAGED = {"app.kubernetes.io/managed-by": "moemesh-operator"}


def _redis_target(mesh: MeshSpec, config: OperatorConfig) -> tuple[str, tuple[str, str] | None]:
    """The mesh's Redis URL and the (Secret, key) its pods read the password from."""
    if mesh.redis.url:
        secret = mesh.redis.password_secret_name
        return mesh.redis.url, (secret, mesh.redis.password_secret_key) if secret else None
    secret = config.redis_secret_name
    return config.redis_url, (secret, config.redis_secret_key) if secret else None


async def _desired_replicas(mesh: MeshSpec, kube: KubeApi, name: str, namespace: str) -> dict[str, int]:
    """Spec replicas; with autoscaling on, the live replicas (the autoscaler owns them) within min/max."""
    replicas = {role: mesh.roles[role].replicas for role in manifests_roles()}
    scaled = (*(SCALED_ROLES if mesh.autoscaling.enabled else ()), *(("expert",) if mesh.expert_autoscaling else ()))
    if scaled:
        for role in scaled:
            live = await kube.get(WORKLOAD_KIND[role], namespace, f"{name}-{role}")
            live_replicas = ((live or {}).get("spec") or {}).get("replicas")
            if isinstance(live_replicas, int):
                role_spec = mesh.roles[role]
                replicas[role] = min(max(live_replicas, role_spec.min_replicas), role_spec.max_replicas)
    return replicas


def _mesh_lock(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Lock:
    """Per-mesh lock between reconcile, the timer and the child handler (each object has its own
    memo, a shallow copy of the operator's: the lock table is shared; a lock nobody holds or
    awaits is dropped from it)."""
    locks: weakref.WeakValueDictionary[str, asyncio.Lock] = memo.mesh_locks
    lock = locks.get(manifests.mesh_id(namespace, name))
    if lock is None:
        lock = locks[manifests.mesh_id(namespace, name)] = asyncio.Lock()
    return lock


async def _apply_children(
    memo: kopf.Memo, mesh: MeshSpec, name: str, namespace: str, uid: str, config: OperatorConfig
) -> int:
    """Apply every child of the mesh (the one path that writes them); returns how many."""
    redis_url, secret = _redis_target(mesh, config)
    async with _mesh_lock(memo, namespace, name):  # the timer patches replicas too
        replicas = await _desired_replicas(mesh, memo.kube, name, namespace)
        children = manifests.children(mesh, name, namespace, uid, replicas, redis_url, secret)
        for child in children:
            await memo.kube.apply(child)
    return len(children)


def manifests_roles() -> tuple[str, ...]:
    return ("router", "prefill", "decode", "expert")


async def _redis_client(
    memo: kopf.Memo, kube: KubeApi, mesh: MeshSpec, namespace: str, config: OperatorConfig
) -> redis.Redis:
    url, _ = _redis_target(mesh, config)
    password = config.redis_password if not mesh.redis.url else None
    if mesh.redis.url and mesh.redis.password_secret_name:
        password = await kube.secret_value(namespace, mesh.redis.password_secret_name, mesh.redis.password_secret_key)
    clients: dict[tuple[str, str | None], redis.Redis] = memo.redis_clients
    if (url, password) not in clients:
        clients[(url, password)] = redis.Redis.from_url(
            url, password=password, socket_timeout=5, socket_connect_timeout=5
        )
    return clients[(url, password)]


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler of the operator into ``registry``."""

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = f"{manifests.GROUP}/cleanup"
        settings.posting.level = 30  # warnings and errors become Kubernetes events
        memo.setdefault("kube", KubeApi())
        memo.setdefault("clock", time.monotonic)
        memo.setdefault("redis_clients", {})
        memo.setdefault("mesh_locks", weakref.WeakValueDictionary())

    @kopf.on.login(registry=registry)
    def login(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo | None:
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
        if info is not None:
            memo.setdefault("kube", KubeApi()).use(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        await memo.kube.close()
        for client in memo.redis_clients.values():
            client.close()

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, registry=registry)
    async def reconcile(
        spec: kopf.Spec,
        status: kopf.Status,
        name: str,
        namespace: str | None,
        uid: str,
        meta: kopf.Meta,
        memo: kopf.Memo,
        patch: kopf.Patch,
        logger: kopf.Logger,
        **_: Any,
    ) -> None:
        assert namespace is not None, "InferenceMesh and its children are namespaced"
        conditions = status.get("conditions")
        try:
            mesh = parse_spec(dict(spec), config.default_image)
        except SpecError as exc:
            logger.error(f"invalid InferenceMesh spec: {exc}")
            conditions = set_condition(conditions, "SpecValid", False, exc.reason, str(exc))
            conditions = set_condition(
                conditions, "Ready", False, exc.reason, "fix the spec; children were not changed"
            )
            patch.status.update(
                conditions=_stamp(_record_owned(memo, conditions, RECONCILE_CONDITIONS), meta),
                observedGeneration=meta.get("generation"),
            )
            return
        try:
            num_children = await _apply_children(memo, mesh, name, namespace, uid, config)
        except KubeError as exc:
            raise kopf.TemporaryError(f"applying children failed: {exc}", delay=15) from exc
        conditions = set_condition(conditions, "SpecValid", True, "Valid", "spec accepted")
        conditions = set_condition(conditions, "Applied", True, "Reconciled", f"{num_children} children applied")
        if not any(c.get("type") == "Ready" for c in conditions):  # the timer reports it from the children
            conditions = set_condition(conditions, "Ready", False, "Starting", "no pod of the mesh is ready yet")
        patch.status.update(
            conditions=_stamp(_record_owned(memo, conditions, RECONCILE_CONDITIONS), meta),
            observedGeneration=meta.get("generation"),
        )

    async def child_deleted(
        type: str, meta: kopf.Meta, namespace: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any
    ) -> None:
        """Re-apply the owner mesh's children when one was deleted, unless the mesh is going away."""
        assert namespace is not None, "InferenceMesh and its children are namespaced"
        owner = _owner_mesh(meta)
        if type != "DELETED" or owner is None:
            return
        live = await memo.kube.get("InferenceMesh", namespace, owner)
        if live is None or live["metadata"].get("deletionTimestamp"):
            return
        try:
            mesh = parse_spec(live.get("spec") or {}, config.default_image)
            await _apply_children(memo, mesh, owner, namespace, live["metadata"]["uid"], config)
        except SpecError:
            return  # reconcile reported it; nothing is applied from an invalid spec
        except KubeError as exc:  # event handlers are not retried: the timer re-applies missing workloads
            logger.warning(f"re-applying the children of {owner} failed: {exc}")
            return
        logger.info(f"{meta.get('name')} was deleted: re-applied the children of InferenceMesh {owner}")

    for resource in CHILD_RESOURCES:
        kopf.on.event(*resource, labels=MANAGED, registry=registry)(child_deleted)

    @kopf.on.delete(*RESOURCE, registry=registry)
    async def delete(
        spec: kopf.Spec, name: str, namespace: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any
    ) -> None:
        assert namespace is not None, "InferenceMesh and its children are namespaced"
        for role in manifests_roles():
            for kind in (WORKLOAD_KIND[role], "Service", "PodDisruptionBudget"):
                await memo.kube.delete(kind, namespace, f"{name}-{role}")
        await memo.kube.delete("ConfigMap", namespace, f"{name}-config")
        try:
            mesh = parse_spec(dict(spec), config.default_image)
            client = await _redis_client(memo, memo.kube, mesh, namespace, config)
            removed = await asyncio.to_thread(delete_placements, client, manifests.mesh_id(namespace, name))
            logger.info(f"deleted {removed} placement keys")
        except (SpecError, redis.RedisError) as exc:
            logger.warning(f"placement keys not deleted (they stay until Redis is flushed): {exc}")

    @kopf.timer(*RESOURCE, interval=config.tick_seconds, registry=registry)
    async def tick(
        spec: kopf.Spec,
        status: kopf.Status,
        name: str,
        namespace: str | None,
        uid: str,
        meta: kopf.Meta,
        memo: kopf.Memo,
        patch: kopf.Patch,
        logger: kopf.Logger,
        **_: Any,
    ) -> None:
        assert namespace is not None, "InferenceMesh and its children are namespaced"
        try:
            mesh = parse_spec(dict(spec), config.default_image)
        except SpecError:
            return  # reconcile reported it in the conditions
        mesh_key = manifests.mesh_id(namespace, name)
        now = memo.clock()
        conditions = status.get("conditions")
        try:
            observed = await _observed_replicas(memo.kube, name, namespace)
            applied = _condition_field(conditions, "Applied", "status") == "True"
            if applied and len(observed) < len(WORKLOAD_KIND) and not meta.get("deletionTimestamp"):
                missing = [role for role in manifests_roles() if role not in observed]
                logger.info(f"re-applying the children: no {', '.join(missing)} workload")
                await _apply_children(memo, mesh, name, namespace, uid, config)
            health = await _pods_health(memo.kube, name, namespace)
        except KubeError as exc:
            raise kopf.TemporaryError(f"reading the children failed: {exc}", delay=15) from exc
        if health is FORBIDDEN and memo.get("owned_conditions", {}).get("PodsHealthy", {}).get("reason") != "Forbidden":
            logger.warning(f"pod failures are not reported: {health.message}")
        conditions = set_condition(conditions, "PodsHealthy", health.ok, health.reason, health.message)
        ok, reason, message = with_pods_health(readiness(observed), health)
        conditions = set_condition(conditions, "Ready", ok, reason, message)
        try:
            client = await _redis_client(memo, memo.kube, mesh, namespace, config)
            workers = await asyncio.to_thread(list_workers, client, mesh_key)
            async with _mesh_lock(memo, namespace, name):
                roles = await _autoscale(mesh, name, namespace, memo, workers, now)
            for role, (replicas, ready) in observed.items():
                roles.setdefault(role, {}).update(replicas=replicas, readyReplicas=ready)
            patch.status["roles"] = roles
            patch.status["selector"] = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=decode"
            layout = mesh.expert_layout
            if mesh.expert_autoscaling is not None and "expert" in roles:
                async with _mesh_lock(memo, namespace, name):
                    layout = await _scale_experts(mesh, name, namespace, memo, client, workers, now, logger)
                roles["expert"]["desiredReplicas"] = memo.expert_scaling.desired
                patch.status["expertScaling"] = _expert_scaling_status(memo.expert_scaling)
            if mesh.eplb.enabled and layout is not None:
                plan_due = now - memo.get("last_plan_at", -math.inf) >= mesh.eplb.interval_s
                outcome = await asyncio.to_thread(
                    rebalance_step,
                    client,
                    mesh_key,
                    layout,
                    mesh.model.num_moe_layers,
                    manifests.expert_worker_ids(name, layout.num_workers),
                    mesh.eplb.imbalance_threshold,
                    plan_due,
                    time.time,
                    max(status.get("placementVersion") or 0, status.get("pendingPlacementVersion") or 0),
                )
                if outcome.planned:
                    memo.last_plan_at = now
                if outcome.published_version:
                    logger.info(f"published placement {outcome.published_version}: {outcome.reason}")
                patch.status["placementVersion"] = outcome.active_version
                patch.status["pendingPlacementVersion"] = outcome.pending_version
                if outcome.imbalance_before is not None and outcome.imbalance_after is not None:
                    patch.status["imbalance"] = {
                        "before": round(outcome.imbalance_before, 4),
                        "after": round(outcome.imbalance_after, 4),
                    }
                    patch.status["lastReplicaMoves"] = outcome.moves
            conditions = set_condition(conditions, "TelemetryAvailable", True, "RedisReachable", "telemetry read")
        except redis.RedisError as exc:
            logger.warning(f"telemetry unavailable: {exc}")
            conditions = set_condition(conditions, "TelemetryAvailable", False, "RedisUnreachable", str(exc))
        except KubeError as exc:
            raise kopf.TemporaryError(f"scaling failed: {exc}", delay=15) from exc
        patch.status["conditions"] = _stamp(_record_owned(memo, conditions, TIMER_CONDITIONS), meta)


RECONCILE_CONDITIONS = ("SpecValid", "Applied", "Ready")
TIMER_CONDITIONS = ("TelemetryAvailable", "PodsHealthy", "Ready")


async def _scale_experts(
    mesh: MeshSpec,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    client: redis.Redis,
    workers: list,
    now: float,
    logger: kopf.Logger,
) -> EplbLayout:
    """The expert-scaling step (spec.autoscaling.expert): resize the StatefulSet or have the EPLB
    step place replicas over a new worker count; returns the layout the EPLB step plans for."""
    policy = mesh.expert_autoscaling
    assert policy is not None, "called only with spec.autoscaling.expert"
    live = await memo.kube.get("StatefulSet", namespace, f"{name}-expert")
    replicas = int(((live or {}).get("spec") or {}).get("replicas", 0))
    outcome, memo.expert_autoscaler = await asyncio.to_thread(
        expert_scale_step,
        client,
        manifests.mesh_id(namespace, name),
        name,
        memo.get("expert_autoscaler", AutoscalerState()),
        now,
        replicas,
        workers,
        policy,
        mesh.model.num_moe_layers,
        mesh.model.num_experts,
        time.time,
    )
    memo.expert_scaling = outcome
    if isinstance(outcome.action, ScaleTo):
        logger.info(
            f"expert workers {replicas} -> {outcome.action.num_workers} "
            f"({outcome.telemetry.tokens_per_second:.0f} routed tokens/s)"
        )
        await memo.kube.patch(
            "StatefulSet", namespace, f"{name}-expert", {"spec": {"replicas": outcome.action.num_workers}}
        )
    elif isinstance(outcome.action, PlaceOver):
        logger.info(f"placing the expert replicas over {outcome.action.num_workers} workers")
    return layout_for(
        outcome.placement_workers, mesh.model.num_experts, policy, mesh.model.num_expert_groups, mesh.eplb.num_nodes
    )


def _expert_scaling_status(outcome: ExpertScaleOutcome) -> dict[str, Any]:
    action = outcome.action
    described = (
        f"scale to {action.num_workers}"
        if isinstance(action, ScaleTo)
        else f"place over {action.num_workers}"
        if isinstance(action, PlaceOver)
        else action.reason
    )
    return {
        "desiredWorkers": outcome.desired,
        "placementWorkers": outcome.placement_workers,
        "routedTokensPerSecond": round(outcome.telemetry.tokens_per_second, 1),
        "action": described,
    }


def _owner_mesh(meta: kopf.Meta) -> str | None:
    """The name of the InferenceMesh that owns a child, from its owner references."""
    for ref in meta.get("ownerReferences") or ():
        if ref.get("kind") == manifests.KIND and ref.get("apiVersion") == f"{manifests.GROUP}/{manifests.VERSION}":
            return ref.get("name")
    return None


def _condition_field(conditions: list[dict[str, Any]] | None, type_: str, field: str) -> Any:
    return next((c.get(field) for c in conditions or () if c.get("type") == type_), None)


async def _pods_health(kube: KubeApi, name: str, namespace: str) -> PodsHealth:
    """PodsHealthy from the mesh's pods; unknown when the operator may not list pods (403)."""
    try:
        pods = await kube.list("Pod", namespace, {"app.kubernetes.io/instance": name, **MANAGED})
    except KubeError as exc:
        if exc.status == 403:
            return FORBIDDEN
        raise
    return pods_health(pods)


def _stamp(conditions: list[dict[str, Any]], meta: kopf.Meta) -> list[dict[str, Any]]:
    """Every condition says which generation of the spec it describes."""
    return [{**c, "observedGeneration": meta.get("generation")} for c in conditions]


async def _observed_replicas(kube: KubeApi, name: str, namespace: str) -> dict[str, tuple[int, int]]:
    """role -> (spec.replicas, status.readyReplicas) of each child workload, as the cluster reports it."""
    observed = {}
    for role in manifests_roles():
        live = await kube.get(WORKLOAD_KIND[role], namespace, f"{name}-{role}")
        if live is not None:
            observed[role] = (
                int((live.get("spec") or {}).get("replicas", 0)),
                int((live.get("status") or {}).get("readyReplicas") or 0),
            )
    return observed


def readiness(observed: dict[str, tuple[int, int]]) -> tuple[bool, str, str]:
    """Ready = every workload has its ready pods and a router is ready (it is only once a decode
    worker is routable: its readiness probe is /health)."""
    missing = [role for role in manifests_roles() if role not in observed]
    if missing:
        return False, "ChildrenMissing", f"no {', '.join(missing)} workload yet"
    waiting = [f"{role} {ready}/{replicas}" for role, (replicas, ready) in observed.items() if ready < replicas]
    if waiting:
        return False, "PodsNotReady", "waiting for ready pods: " + ", ".join(waiting)
    if observed["router"][1] < 1:
        return False, "NoRouter", "no router pod is ready"
    return True, "Serving", "every role has its ready pods"


def _record_owned(
    memo: kopf.Memo, conditions: list[dict[str, Any]], owned_types: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Remember this handler's conditions in the object's memo and return the full list with the
    other handler's latest ones merged in (see operator/status.py)."""
    owned = memo.setdefault("owned_conditions", {})
    for condition in conditions:
        if condition.get("type") in owned_types:
            owned[condition["type"]] = condition
    return merge_owned(conditions, owned.values())


async def _autoscale(
    mesh: MeshSpec, name: str, namespace: str, memo: kopf.Memo, workers: list, now: float
) -> dict[str, dict[str, int]]:
    """Patch router/prefill/decode replicas when autoscaling is on; returns status.roles."""
    current: dict[str, int] = {}
    for role in manifests_roles():
        live = await memo.kube.get(WORKLOAD_KIND[role], namespace, f"{name}-{role}")
        if live is not None:
            current[role] = int((live.get("spec") or {}).get("replicas", 0))
    roles = {role: {"desiredReplicas": replicas} for role, replicas in current.items()}
    ready = {
        role: sum(1 for w in workers if w.role in (role, "both" if role == "decode" else role))
        for role in manifests_roles()
    }
    if mesh.autoscaling.enabled and len(current) == len(manifests_roles()):  # reconciled already
        state = memo.get("autoscaler", AutoscalerState())
        desired, _, memo.autoscaler = scale_step(state, now, mesh, current, workers)
        for role, replicas in desired.items():
            if replicas != current[role]:
                await memo.kube.patch("Deployment", namespace, f"{name}-{role}", {"spec": {"replicas": replicas}})
            roles[role]["desiredReplicas"] = replicas
    for role in manifests_roles():
        roles.setdefault(role, {})["registeredReplicas"] = ready[role]  # in the registry (heartbeating)
    return roles
