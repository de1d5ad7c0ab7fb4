"""Who applies an object's current generation (moe_operator.handlers.operator.orphaned_generation):
kopf's reconcile handler while it has a change to handle or a retry pending; the observe timer
when kopf dropped it (an edit that failed temporarily, reverted before its retry)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from moe_operator.handlers.operator import DIFFBASE_KEY, ORPHAN_GRACE_S, PREFIX, orphaned_generation

SPEC_B = {"experts": {"groups": 2, "groupNodes": [{"groups": [1], "rayNodeLabels": {"pool": "b"}}]}}
SPEC_C = {"experts": {"groups": 2, "groupNodes": [{"groups": [1], "rayNodeLabels": {"pool": "c"}}]}}


NOW = datetime(2026, 12, 6, 5, 40, tzinfo=timezone.utc).timestamp()


def _retry(delayed_s_ago: float) -> str:
    """kopf's progress record of a handler that failed temporarily (as it writes it)."""
    delayed = datetime.fromtimestamp(NOW - delayed_s_ago, timezone.utc).isoformat()
    return json.dumps({"started": delayed, "delayed": delayed, "purpose": "update", "retries": 1,
                       "success": False, "failure": False, "message": "ExpertShard-1 is pinned ..."})


def _meta(handled: dict | None, **progress: str) -> dict:
    annotations = {f"{PREFIX}/rebalance-requested": "x"}
    if handled is not None:
        annotations[f"{PREFIX}/{DIFFBASE_KEY}"] = json.dumps({"spec": handled, "metadata": {"labels": {}}})
    annotations.update({f"{PREFIX}/{key}": value for key, value in progress.items()})
    return {"generation": 5, "annotations": annotations}


def test_a_reverted_edit_whose_retry_kopf_dropped_is_orphaned():
    assert orphaned_generation(_meta(SPEC_B), SPEC_B, NOW)
    # kopf leaves the dropped retry's record behind: long past its time, it is nobody's
    assert orphaned_generation(_meta(SPEC_B, **{"reconcile_handler.spec": _retry(ORPHAN_GRACE_S + 5)}), SPEC_B, NOW)


def test_a_change_kopf_handles_or_retries_is_not():
    assert not orphaned_generation(_meta(SPEC_B), SPEC_C, NOW)  # kopf sees a diff: its handler runs
    for due in (-10, 0, ORPHAN_GRACE_S - 5):  # a retry to come, or just due
        assert not orphaned_generation(_meta(SPEC_B, **{"reconcile_handler.spec": _retry(due)}), SPEC_B, NOW)
    assert not orphaned_generation(_meta(SPEC_B, **{"reconcile_handler.spec": "{}"}), SPEC_B, NOW)  # running
    assert not orphaned_generation(_meta(None), SPEC_B, NOW)  # never handled: the create handler's
    broken = _meta(SPEC_B)
    broken["annotations"][f"{PREFIX}/{DIFFBASE_KEY}"] = "{not json"
    assert not orphaned_generation(broken, SPEC_B, NOW)
