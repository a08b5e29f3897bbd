"""Status conditions: each handler owns some; a timer tick that read the status before a
reconcile's patch must not erase the reconcile's conditions (kopf runs timers concurrently)."""

from __future__ import annotations

import kopf

from moemesh.operator.handlers import RECONCILE_CONDITIONS, TIMER_CONDITIONS, _record_owned
from moemesh.operator.status import merge_owned, set_condition


def test_a_stale_tick_keeps_the_reconciles_ready_condition():
    memo = kopf.Memo()
    stale = []  # what the tick read: the status before reconcile's patch landed
    reconciled = set_condition(set_condition(stale, "SpecValid", True, "Valid", "ok"), "Ready", True, "Reconciled", "5")
    written_by_reconcile = _record_owned(memo, reconciled, RECONCILE_CONDITIONS)
    tick = set_condition(stale, "TelemetryAvailable", True, "RedisReachable", "telemetry read")
    written_by_tick = _record_owned(memo, tick, TIMER_CONDITIONS)
    by_type = {c["type"]: c["status"] for c in written_by_tick}
    assert by_type == {"TelemetryAvailable": "True", "SpecValid": "True", "Ready": "True"}
    # and a reconcile that read the status before the tick's patch keeps TelemetryAvailable
    again = _record_owned(
        memo, set_condition(written_by_reconcile, "Ready", False, "InvalidSpec", "x"), RECONCILE_CONDITIONS
    )
    assert {c["type"]: c["status"] for c in again} == {
        "SpecValid": "True",
        "Ready": "False",
        "TelemetryAvailable": "True",
    }


def test_merge_owned_replaces_in_place_and_appends_missing_types():
    existing = [{"type": "A", "status": "True"}, {"type": "B", "status": "True"}]
    merged = merge_owned(existing, [{"type": "B", "status": "False"}, {"type": "C", "status": "True"}])
    assert merged == [
        {"type": "A", "status": "True"},
        {"type": "B", "status": "False"},
        {"type": "C", "status": "True"},
    ]
    assert existing[1]["status"] == "True"  # inputs untouched
