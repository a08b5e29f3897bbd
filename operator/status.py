"""Status conditions of an InferenceMesh (Kubernetes condition conventions)."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

# Ready: children reconciled from a valid spec. SpecValid: the spec parsed.
# TelemetryAvailable: the timer could read Redis.


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(
    existing: Iterable[Mapping[str, Any]] | None,
    type_: str,
    ok: bool,
    reason: str,
    message: str,
) -> list[dict[str, Any]]:
    """The conditions list with ``type_`` set; lastTransitionTime changes only with the status."""
    status = "True" if ok else "False"
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
