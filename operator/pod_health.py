"""Failed containers of a mesh's pods, as the PodsHealthy condition (pure: Pod dicts in).

The timer lists the mesh's pods and calls ``pods_health``; a container counts as failed when

- it terminated with a non-zero exit code (``state.terminated``), e.g. a worker that could not
  resolve its model source: it prints one line naming the source and exits, and with
  ``terminationMessagePolicy: FallbackToLogsOnError`` that line is the termination message;
- it is waiting to restart after such an exit (``lastState.terminated`` non-zero), unless it is
  running and ready again (a container that crashed once and recovered is healthy);
- it waits with a reason that needs a person (``FAILED_WAITING_REASONS``: a bad image, a missing
  Secret or ConfigMap key, a crash loop).

Init containers are checked first (they run first). Terminating pods (a rollout replacing them)
are skipped: their containers exit on SIGTERM by design.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FAILED_WAITING_REASONS = frozenset(
    {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError"}
)
MAX_DETAIL_CHARS = 800  # the condition message stays under ~1000 characters


@dataclass(frozen=True)
class PodsHealth:
    """The PodsHealthy condition: ``ok`` None = unknown (the pods could not be read)."""

    ok: bool | None
    reason: str
    message: str


HEALTHY = PodsHealth(True, "NoFailures", "no container of the mesh has failed")
FORBIDDEN = PodsHealth(None, "Forbidden", "the operator may not list pods (RBAC: get, list, watch on pods)")


def _last_line(text: str | None) -> str:
    """The last non-empty line: with FallbackToLogsOnError the message is the log's tail, and a
    process that cannot start prints its reason last."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:MAX_DETAIL_CHARS] if lines else ""


def _exited(terminated: Mapping[str, Any]) -> str:
    detail = _last_line(terminated.get("message")) or terminated.get("reason") or "no termination message"
    return f"exited {terminated.get('exitCode')}: {detail}"


def container_failure(status: Mapping[str, Any]) -> str | None:
    """How one container (a ``containerStatuses`` entry) failed, or None when it has not."""
    state = status.get("state") or {}
    terminated = state.get("terminated")
    if terminated is not None:  # exit code 0: a completed init container
        return _exited(terminated) if terminated.get("exitCode", 0) != 0 else None
    if "running" in state and status.get("ready"):
        return None
    last = (status.get("lastState") or {}).get("terminated") or {}
    if last.get("exitCode", 0) != 0:
        return _exited(last)
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in FAILED_WAITING_REASONS:
        return f"{waiting['reason']}: {_last_line(waiting.get('message')) or 'no message'}"
    return None


def pod_failure(pod: Mapping[str, Any]) -> str | None:
    """``<pod>/<container> <how it failed>`` for the pod's first failed container, or None."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]:
        failure = container_failure(container)
        if failure is not None:
            return f"{meta.get('name')}/{container.get('name')} {failure}"
    return None


def pods_health(pods: Iterable[Mapping[str, Any]]) -> PodsHealth:
    """PodsHealthy=False naming the first failed pod (by name) and counting the others; else True."""
    failures = sorted(
        (str((pod.get("metadata") or {}).get("name")), failure)
        for pod in pods
        if (failure := pod_failure(pod)) is not None
    )
    if not failures:
        return HEALTHY
    message = failures[0][1]
    if len(failures) > 1:
        message += f" (and {len(failures) - 1} more failed pod{'s' if len(failures) > 2 else ''})"
    return PodsHealth(False, "ContainerFailed", message)


def with_pods_health(ready: tuple[bool, str, str], health: PodsHealth) -> tuple[bool, str, str]:
    """The Ready condition given PodsHealthy: not ready while a pod fails, and the message says why."""
    ok, reason, message = ready
    if health.ok is not False:
        return ready
    if ok:
        return False, "PodsFailing", f"pods failing: {health.message}"
    return False, reason, f"{message}; pods failing: {health.message}"
