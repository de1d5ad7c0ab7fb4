"""The Ingress' routing anomaly report -> condition RoutingAnomaly, status.routingAnomalies, the
Event, and spec.routing.autoQuarantine's decision (pure)."""

from moe_operator.api import conditions as cond
from moe_operator.api.semantics import ModelFacts
from moe_operator.api.status import checked
from moe_operator.api.validation import parse_spec
from moe_operator.containment import auto_quarantine, pending
from moe_operator.object_loop import needs_pass
from moe_operator.observe import anomaly_events, summarise
from moe_operator.reconcile import contain
from moe_operator.render.serve_app import render_application
from moe_workers.serve.anomaly import Thresholds

FACTS = ModelFacts(num_layers=4, num_experts=8, top_k=2, hidden_size=64, intermediate_size=128, dtype="bfloat16")
SURGE = {"layer": 1, "expert": 5, "kind": "surge", "share": 0.61, "baseline": 0.12, "entropy": 0.7,
         "key": "aaaa1111", "key_share": 0.97, "since": "2026-12-07T19:00:00Z"}


def spec(**routing):
    return parse_spec({"model": {"path": "/models/m", "shape": {"numLayers": 4, "numExperts": 8, "topK": 2,
                                                                 "hiddenSize": 64, "intermediateSize": 128}},
                       "experts": {"groups": 2, "tiers": {"hot": {"budget": "1Gi"}, "warm": {"budget": "1Gi"}}},
                       "routing": routing})


def report(anomalies=(), ok=True, reason=""):
    return {"replicas": [], "routing": {"quarantined": [], "anomalies": list(anomalies),
                                        "detector": {"ok": ok, "reason": reason}}}


def condition(status):
    return cond.get_condition(status["conditions"], cond.ROUTING_ANOMALY)


def test_no_anomaly_unknown_and_a_surge_naming_layer_expert_and_key():
    quiet = checked(summarise(spec(), report(), {}))
    c = condition(quiet)
    assert (c["status"], c["reason"]) == ("False", cond.NO_ANOMALY) and quiet["routingAnomalies"] is None
    for bad in ({"replicas": []}, report(ok=False, reason="cannot read the routing window: KeyError")):
        c = condition(summarise(spec(), bad, {}))
        assert (c["status"], c["reason"]) == ("Unknown", cond.DETECTOR_UNAVAILABLE) and c["message"]
    assert "KeyError" in condition(summarise(spec(), bad, {}))["message"]
    alert = checked(summarise(spec(), report([SURGE]), quiet))
    c = condition(alert)
    assert (c["status"], c["reason"]) == ("True", cond.EXPERT_SURGE)
    assert "layer 1 expert 5" in c["message"] and "aaaa1111" in c["message"]
    assert alert["routingAnomalies"] == [{"expert": "1.5", "kind": "surge", "key": "aaaa1111",
                                          "since": "2026-12-07T19:00:00Z"}]
    entropy = condition(summarise(spec(), report([{**SURGE, "kind": "entropy"}]), {}))
    assert entropy["reason"] == cond.ENTROPY_DROP


def test_a_lasting_alert_changes_nothing_and_its_event_is_posted_once():
    quiet = summarise(spec(), report(), {})
    first = summarise(spec(), report([SURGE]), quiet)
    [(kind, reason, message)] = anomaly_events(quiet["conditions"], first["conditions"], report([SURGE])["routing"])
    assert (kind, reason) == (cond.WARNING, cond.EXPERT_SURGE)
    assert "share 0.610" in message and "97% of its tokens from key aaaa1111" in message
    later = summarise(spec(), report([{**SURGE, "share": 0.55}]), {**quiet, **first})
    assert later["conditions"] == first["conditions"]  # shares move, the condition does not: no write
    assert anomaly_events(first["conditions"], later["conditions"], {}) == []
    cleared = summarise(spec(), report(), {**quiet, **later})
    assert condition(cleared)["status"] == "False" and anomaly_events(later["conditions"], cleared["conditions"], {}) == []


def test_thresholds_reach_the_ingress_only_when_set_and_defaults_agree_with_the_detector():
    assert spec().routing.anomaly.user_config() == {}
    s = spec(anomaly={"surgeFactor": 5.0, "warmupWindows": 6})
    ingress = render_application("ns", "m", s, {"ExpertShard-0": [], "ExpertShard-1": []})["deployments"][0]
    assert ingress["user_config"]["anomaly"] == {"surgeFactor": 5.0, "warmupWindows": 6}
    assert Thresholds.from_dict(ingress["user_config"]["anomaly"]).surge_factor == 5.0
    d, t = spec().routing.anomaly, Thresholds()
    assert (d.entropy_floor, d.surge_factor, d.min_share_factor, d.min_tokens, d.warmup_windows) == \
        (t.entropy_floor, t.surge_factor, t.min_share_factor, t.min_tokens, t.warmup_windows)


def test_auto_quarantine_takes_a_surging_expert_out_never_past_the_share_and_keeps_it():
    status = {"routingAnomalies": [{"expert": "1.5", "kind": "surge", "key": "k"},
                                   {"expert": "2.0", "kind": "entropy", "key": "k"}]}
    assert auto_quarantine(spec(), FACTS, status) == ([], [])  # off by default
    assert not pending({}, status)
    on = spec(autoQuarantine=True)
    assert pending({"routing": {"autoQuarantine": True}}, status)
    assert auto_quarantine(on, FACTS, status) == (["1.5"], [])  # entropy alerts quarantine nothing
    # 0.25 of 8 experts: 2 a layer; the user's two in layer 1 leave no room
    full = spec(autoQuarantine=True, quarantine=["1.0", "1.1"])
    assert auto_quarantine(full, FACTS, status) == ([], ["1.5"])
    # kept once the surge is gone (the expert gets no tokens now); lifted when turned off
    assert auto_quarantine(on, FACTS, {"autoQuarantined": ["1.5"]}) == (["1.5"], [])
    assert pending({}, {"autoQuarantined": ["1.5"]})
    assert not pending({"routing": {"autoQuarantine": True}}, {**status, "autoQuarantined": ["1.5"]})
    assert not pending({"routing": {"autoQuarantine": True}}, {**status, "autoQuarantineRefused": ["1.5"]})


def test_the_pass_records_and_renders_the_automatic_quarantine_with_events():
    status = {"routingAnomalies": [{"expert": "1.5", "kind": "surge", "key": "k"}]}
    s = spec(autoQuarantine=True, quarantine=["3.1"])
    [(kind, reason, message)] = contain(s, FACTS, status)
    assert (kind, reason, status["autoQuarantined"]) == (cond.WARNING, cond.AUTO_QUARANTINED, ["1.5"])
    assert "1.5" in message and contain(s, FACTS, status) == []  # said once
    app = render_application("ns", "m", s, {"ExpertShard-0": [], "ExpertShard-1": []},
                             auto_quarantine=status["autoQuarantined"])
    assert app["deployments"][0]["user_config"]["quarantine"] == ["1.5", "3.1"]
    [(kind, reason, message)] = contain(spec(), FACTS, status)  # turned off: lifted
    assert (kind, reason, status["autoQuarantined"]) == (cond.NORMAL, cond.AUTO_QUARANTINED, None)


def test_the_loop_runs_the_whole_pass_for_a_pending_surge():
    ready = {"observedGeneration": 1, "conditions": [{"type": "Ready", "status": "True"}]}
    meta = {"generation": 1}
    sp = {"routing": {"autoQuarantine": True}}
    assert not needs_pass(sp, meta, ready, False)
    assert needs_pass(sp, meta, {**ready, "routingAnomalies": [{"expert": "1.5", "kind": "surge"}]}, False)


def test_moectl_quarantine_wait_reads_the_users_quarantine_beside_the_automatic_one():
    from moe_operator.cli.quarantine import applied
    doc = {"metadata": {"generation": 2}, "status": {"observedGeneration": 2, "conditions": [],
                                                       "quarantinedExperts": ["1.5", "3.1"], "autoQuarantined": ["1.5"]}}
    assert applied(doc, ["3.1"]) == ""
    assert applied(doc, ["1.5", "3.1"]) == ""  # taken over by the spec
    assert applied(doc, ["3.1", "3.2"]) is None
