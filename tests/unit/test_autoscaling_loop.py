"""One autoscaling pass (pure): from smoothed per-expert rates to what is written."""

import pytest

from moe_operator.api.models import MoEDeploymentSpec
from moe_operator.autoscaling.driver import Autoscaler, metrics_source
from moe_operator.autoscaling.loop import autoscale
from moe_operator.autoscaling.signals import AppReportSource, PrometheusSource, ScrapeSource, totals_from_app_report
from moe_operator.merge_patch import merge_patch
from moe_operator.planner.initial import initial_placement

PLACEMENT = initial_placement(1, 8, 4)  # 2 experts per group


def spec(**autoscaling) -> MoEDeploymentSpec:
    return MoEDeploymentSpec.model_validate({
        "model": {"path": "/models/m"},
        "experts": {"groups": 4, "tiers": {"hot": {"budget": "1Gi"}, "warm": {"budget": "1Gi"}}},
        "autoscaling": {"stabilizationWindowSeconds": 0, "cooldownSeconds": 60, **autoscaling},
    })


def skewed_rates(placement=PLACEMENT) -> dict:
    """Experts 0.0 and 0.4 (both in ExpertShard-0) take most tokens."""
    load = {"0.0": 400.0, "0.4": 300.0}
    return {(g, e): load.get(e, 10.0) for g, es in placement.items() for e in es}


def test_auto_rebalance_sets_target_and_event():
    p = autoscale(spec(mode="Auto"), {}, PLACEMENT, skewed_rates(), 1000.0, 2**20, 1)
    a = p.autoscaling
    assert p.status["imbalance"] > 3
    assert a["lastDecision"] == "Rebalance" and a["phase"] == "Loading"
    assert a["imbalanceAfter"] < a["imbalanceBefore"]
    assert a["movedCopies"] >= 1 and a["bytesMoved"] == a["movedCopies"] * 2**20
    # the two hot experts no longer share a group
    target = a["target"]
    assert not any({"0.0", "0.4"} <= set(es) for es in target.values())
    assert p.event[1] == "RebalanceStarted"


def test_recommend_writes_the_plan_only_and_one_event_per_plan():
    p = autoscale(spec(mode="Recommend"), {}, PLACEMENT, skewed_rates(), 1000.0, 2**20, 1)
    assert "target" not in p.autoscaling and p.autoscaling["recommended"]
    assert p.event[1] == "RebalanceRecommended"
    again = autoscale(spec(mode="Recommend"), {"autoscaling": p.autoscaling}, PLACEMENT, skewed_rates(), 1010.0, 2**20, 1)
    assert again.event is None and again.autoscaling["recommended"] == p.autoscaling["recommended"]


def test_cooldown_after_an_applied_rebalance_is_kept_in_status():
    first = autoscale(spec(mode="Auto"), {}, PLACEMENT, skewed_rates(), 1000.0, 2**20, 1)
    done = {k: v for k, v in first.autoscaling.items() if k != "target"}
    second = autoscale(spec(mode="Auto"), {"autoscaling": done}, PLACEMENT, skewed_rates(), 1030.0, 2**20, 1)
    assert "target" not in second.autoscaling and "cooling down" in second.autoscaling["message"]


def test_off_does_nothing_but_a_request_rebalances():
    off = autoscale(spec(mode="Off"), {}, PLACEMENT, skewed_rates(), 1000.0, 2**20, 1)
    assert "target" not in off.autoscaling and off.event is None
    asked = autoscale(spec(mode="Off"), {}, PLACEMENT, skewed_rates(), 1000.0, 2**20, 1, request="r1")
    assert asked.autoscaling["target"] and asked.autoscaling["lastRequest"] == "r1"
    assert asked.autoscaling["reason"].startswith("requested (r1)")
    # the same request is not handled twice
    again = autoscale(spec(mode="Off"), {"autoscaling": {"lastRequest": "r1"}}, PLACEMENT, skewed_rates(), 1001.0,
                      2**20, 1, request="r1")
    assert "target" not in again.autoscaling


def test_request_on_balanced_load_says_why_not():
    even = {(g, e): 50.0 for g, es in PLACEMENT.items() for e in es}
    p = autoscale(spec(mode="Auto"), {}, PLACEMENT, even, 1000.0, 2**20, 1, request="r2")
    assert "target" not in p.autoscaling and p.event[1] == "RebalanceNotNeeded"
    assert "no placement does better" in p.autoscaling["message"]


def test_no_decision_while_a_change_is_applied():
    p = autoscale(spec(mode="Auto"), {"autoscaling": {"target": PLACEMENT}}, PLACEMENT, skewed_rates(), 1000.0, 2**20, 1)
    assert p.autoscaling["target"] == PLACEMENT and p.event is None


def test_scaling_writes_replicas():
    p = autoscale(spec(mode="Auto", targetTokensPerSecondPerReplica=200, maxReplicasPerGroup=3), {}, PLACEMENT,
                  skewed_rates(), 1000.0, 2**20, 1)
    assert p.replicas_per_group == 3 and p.event[1] == "ScaleUp"  # busiest group: 700 tokens/s


def test_group_load_written_into_groups():
    status = {"groups": [{"name": g, "replicas": 1} for g in PLACEMENT]}
    p = autoscale(spec(mode="Off"), status, PLACEMENT, skewed_rates(), 1000.0, 2**20, 1)
    loads = {g["name"]: g["load"] for g in p.status["groups"]}
    assert loads["ExpertShard-0"] == 700.0 and loads["ExpertShard-1"] == 20.0


def test_merge_patch_nulls_removed_keys():
    before = {"autoscaling": {"target": {"g": ["0.0"]}, "phase": "Draining", "lastRequest": "r"}, "imbalance": 2.0}
    after = {"autoscaling": {"phase": "Steady", "lastRequest": "r"}, "imbalance": 2.0}
    assert merge_patch(before, after) == {"autoscaling": {"target": None, "phase": "Steady"}}


def test_metrics_source_choice():
    s = spec()
    assert isinstance(metrics_source(s, "ns.a", "http://h:8000/a/v1"), AppReportSource)
    assert metrics_source(s, "ns.a", "http://h:8000/a/v1").base_url == "http://h:8000/a"
    assert isinstance(metrics_source(s, "ns.a", None, ["http://127.0.0.1:1/metrics"]), ScrapeSource)
    prom = spec(metrics={"source": "Prometheus", "prometheusUrl": "http://prom:9090"})
    assert isinstance(metrics_source(prom, "ns.a", None), PrometheusSource)


def test_totals_from_app_report_sums_replicas():
    report = {"replicas": [{"group": "g0", "load": {"0.1": 5}}, {"group": "g0", "load": {"0.1": 7, "0.2": 1}}]}
    assert totals_from_app_report(report) == {("g0", "0.1"): 12.0, ("g0", "0.2"): 1.0}


class FakeSource:
    def __init__(self):
        self.total = 0.0
        self.reads = 0

    def expert_token_totals(self):
        self.reads += 1
        self.total += 100.0
        return {("ExpertShard-0", "0.0"): self.total}


def test_driver_reads_when_due_and_needs_two_reads():
    drv, src = Autoscaler(), FakeSource()
    sp = spec(mode="Auto", metrics={"scrapeIntervalSeconds": 10})
    first = drv.step("ns/a", sp, {}, PLACEMENT, src, 2**20, now=100.0)
    assert "first read" in first.autoscaling["message"]
    assert drv.step("ns/a", sp, {}, PLACEMENT, src, 2**20, now=105.0) is None  # not due
    second = drv.step("ns/a", sp, {}, PLACEMENT, src, 2**20, now=110.0)
    assert second.status["imbalance"] == pytest.approx(4.0)  # all load on one of 4 groups
    assert src.reads == 2
    # a request is read at once
    assert drv.step("ns/a", sp, {}, PLACEMENT, src, 2**20, request="r", now=111.0) is not None
    assert src.reads == 3


def test_imbalance_is_per_layer_and_the_worst_layer_is_named():
    """Two layers: layer 0 balanced, layer 1 all on one group. Summed over layers the groups
    would look closer than either layer's step does."""
    placement = initial_placement(2, 4, 2)  # 2 experts per group per layer
    rates = {}
    for g, es in placement.items():
        for e in es:
            layer, expert = e.split(".")
            rates[(g, e)] = 100.0 if layer == "0" else (200.0 if g == "ExpertShard-0" else 0.0)
    p = autoscale(spec(mode="Off"), {}, placement, rates, 1000.0, 2**20, 1)
    assert p.status["imbalance"] == 1.5  # mean of layer 0's 1.0 and layer 1's 2.0
    assert p.status["worstLayer"] == {"layer": 1, "imbalance": 2.0}
    idle = autoscale(spec(mode="Off"), {}, placement, {}, 1000.0, 2**20, 1)
    assert idle.status["imbalance"] == 1.0 and idle.status["worstLayer"] is None


def test_the_plan_states_slots_per_group():
    p = autoscale(spec(mode="Auto", redundantExpertSlots=4), {}, PLACEMENT, skewed_rates(), 1000.0, 2**20, 1)
    assert p.autoscaling["slotsPerGroup"] == 3  # (8 experts + 4 spare) / 4 groups
    target = p.autoscaling["target"]
    assert all(len(es) <= 3 for es in target.values()) and sum(map(len, target.values())) <= 12


def test_decide_reads_nothing_while_off_and_checks_the_files_before_the_placement(tmp_path):
    """`driver.decide`, the pass the kopf timer and moectl up share: Off without a new rebalance
    request reads no placement; a request already handled is no request; a spec whose model
    files do not check out reads no placement either (the reconcile pass reports why)."""
    from moe_operator.autoscaling.driver import decide

    reads = []

    def read_placement():
        reads.append(1)
        return PLACEMENT

    off = spec(mode="Off")
    handled = {"autoscaling": {"lastRequest": "r1"}}
    assert decide(Autoscaler(), "ns/m", off, {}, None, read_placement, [], "app") is None
    assert decide(Autoscaler(), "ns/m", off, handled, "r1", read_placement, [], "app") is None
    assert reads == []
    # a new request while Off gets past the first check; /models/m is outside the allowed roots
    assert decide(Autoscaler(), "ns/m", off, handled, "r2", read_placement, [str(tmp_path)], "app") is None
    assert reads == []


def test_decide_reads_the_placement_once_the_files_check_out(tmp_path):
    """With the model's files in order, a new request reads the deployed placement and steps the
    autoscaler (no endpoint yet: a pass that says there is no metrics source)."""
    from checkpoints import make_mixtral
    from moe_operator.autoscaling.driver import decide

    make_mixtral(tmp_path / "m", num_hidden_layers=1, num_local_experts=8)
    s = MoEDeploymentSpec.model_validate({**spec(mode="Off").model_dump(by_alias=True),
                                          "model": {"path": str(tmp_path / "m")}})
    reads = []
    p = decide(Autoscaler(), "ns/m", s, {}, "r1", lambda: reads.append(1) or PLACEMENT, [str(tmp_path)], "app")
    assert reads == [1]
    assert p is not None and "no metrics source" in p.autoscaling["message"]
