"""Status conditions of an InferenceMesh (Kubernetes condition conventions)."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

# Ready: children reconciled from a valid spec. SpecValid: the spec parsed.
# TelemetryAvailable: the timer could read Redis. PodsHealthy: no container of the mesh's pods has
# failed (Unknown when the operator may not list pods).
# The reconcile handler owns SpecValid and Ready, the timer TelemetryAvailable and PodsHealthy.
# Kopf runs timers concurrently with change handlers, and a status patch replaces the whole list,
# so each handler writes the other's latest conditions too (`merge_owned`, from the per-object
# memo); otherwise a tick that read the status before a reconcile's patch would erase Ready.


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(
    existing: Iterable[Mapping[str, Any]] | None,
    type_: str,
    ok: bool | None,
    reason: str,
    message: str,
) -> list[dict[str, Any]]:
    """The conditions list with ``type_`` set (``ok`` None: status Unknown); lastTransitionTime
    changes only with the status."""
    status = "Unknown" if ok is None else "True" if ok else "False"
    result: list[dict[str, Any]] = []
    found = False
    for condition in existing or ():
        condition = dict(condition)
        if condition.get("type") == type_:
            found = True
            changed = condition.get("status") != status
            condition.update(status=status, reason=reason, message=message[:1024])
            if changed or "lastTransitionTime" not in condition:
                condition["lastTransitionTime"] = now_rfc3339()
        result.append(condition)
    if not found:
        result.append(
            {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message[:1024],
                "lastTransitionTime": now_rfc3339(),
            }
        )
    return result


def merge_owned(
    existing: Iterable[Mapping[str, Any]] | None, owned: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``existing`` with every condition of ``owned`` (the latest a handler wrote) in its place."""
    latest = {c["type"]: dict(c) for c in owned}
    result = [latest.pop(c.get("type"), dict(c)) for c in existing or ()]
    return result + list(latest.values())
