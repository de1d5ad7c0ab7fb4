"""What one turn of an object's loop does (moe_operator.object_loop.needs_pass, pure): the
whole pass whenever status has not observed the current generation (so a reverted edit is applied
like any other: no record of kopf's to read), while the object is not Ready, in ray.mode KubeRay, or
while a rebalance runs; otherwise only the live report is read."""

from __future__ import annotations

from moe_operator.api import conditions as cond
from moe_operator.object_loop import needs_pass

REST = {"experts": {"groups": 2}}
KUBERAY = {"ray": {"mode": "KubeRay"}, "experts": {"groups": 2}}


def _status(generation: int, ready: bool, **extra) -> dict:
    return {"observedGeneration": generation,
            "conditions": cond.set_condition([], cond.READY, ready, cond.SERVING if ready else cond.UNSCHEDULABLE,
                                             "m", generation), **extra}


def test_a_serving_object_at_its_generation_only_reads_its_live_report():
    assert not needs_pass(REST, {"generation": 5}, _status(5, True), first=False)


def test_every_other_turn_runs_the_whole_pass():
    assert needs_pass(REST, {"generation": 5}, _status(5, True), first=True)  # the loop's first turn
    assert needs_pass(REST, {"generation": 6}, _status(5, True), first=False)  # an edit, or a revert of one
    assert needs_pass(REST, {"generation": 5}, _status(5, False), first=False)  # not Ready: its retry
    assert needs_pass(REST, {"generation": 5}, {}, first=False)  # never reconciled
    assert needs_pass(KUBERAY, {"generation": 5}, _status(5, True), first=False)  # KubeRay moves on its own
    rebalancing = _status(5, True, autoscaling={"target": {"ExpertShard-0": ["0.0"]}})
    assert needs_pass(REST, {"generation": 5}, rebalancing, first=False)
