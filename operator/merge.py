"""Three-way merge patches (RFC 7386) that converge a live object on the desired one.

``merge_patch(desired, live, last_applied)`` is pure: ``last_applied`` is what the operator
wrote the previous time (kept in the child's ``moemesh.io/last-applied`` annotation), so a field
the operator wrote before and no longer wants becomes ``null`` (removed), while fields only the
server set (defaults, a Service's clusterIP) are left alone. Lists are replaced whole, as a
merge patch does; a list is rewritten when it differs from what was applied or from what is live.
"""

from __future__ import annotations

from typing import Any


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every field of ``desired`` is present and equal in ``live`` (server defaults ignored)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    return desired == live


def merge_patch(desired: dict[str, Any], live: dict[str, Any], last_applied: dict[str, Any]) -> dict[str, Any]:
    """The merge patch taking ``live`` to ``desired``; empty when nothing needs writing."""
    patch: dict[str, Any] = {}
    for key in last_applied.keys() - desired.keys():
        if key in live:
            patch[key] = None
    for key, want in desired.items():
        have, applied = live.get(key), last_applied.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            sub = merge_patch(want, have, applied if isinstance(applied, dict) else {})
            if sub:
                patch[key] = sub
        elif not is_subset(want, have) or (key in last_applied and want != applied):
            patch[key] = want
    return patch
