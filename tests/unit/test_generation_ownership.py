"""Who applies an object's current generation (moe_operator.handlers.operator.orphaned_generation):
kopf's reconcile handler while it has a change to handle or a retry pending; the observe timer
when kopf dropped it (an edit that failed temporarily, reverted before its retry)."""

from __future__ import annotations

import json

from moe_operator.handlers.operator import DIFFBASE_KEY, PREFIX, orphaned_generation

SPEC_B = {"experts": {"groups": 2, "groupNodes": [{"groups": [1], "rayNodeLabels": {"pool": "b"}}]}}
SPEC_C = {"experts": {"groups": 2, "groupNodes": [{"groups": [1], "rayNodeLabels": {"pool": "c"}}]}}


def _meta(handled: dict | None, *extra: str) -> dict:
    annotations = {f"{PREFIX}/rebalance-requested": "x"}
    if handled is not None:
        annotations[f"{PREFIX}/{DIFFBASE_KEY}"] = json.dumps({"spec": handled, "metadata": {"labels": {}}})
    annotations.update({f"{PREFIX}/{key}": "{}" for key in extra})
    return {"generation": 5, "annotations": annotations}


def test_a_reverted_edit_whose_retry_kopf_dropped_is_orphaned():
    assert orphaned_generation(_meta(SPEC_B), SPEC_B)


def test_a_change_kopf_handles_or_retries_is_not():
    assert not orphaned_generation(_meta(SPEC_B), SPEC_C)  # kopf sees a diff: its handler runs
    assert not orphaned_generation(_meta(SPEC_B, "reconcile_handler.spec"), SPEC_B)  # a retry is pending
    assert not orphaned_generation(_meta(None), SPEC_B)  # never handled: the create handler's
    broken = _meta(SPEC_B)
    broken["annotations"][f"{PREFIX}/{DIFFBASE_KEY}"] = "{not json"
    assert not orphaned_generation(broken, SPEC_B)
