"""Status is checked against the CRD's schema where it is produced (api/status.py): a field the
models lack, misspelt at the top or inside an entry, or a value of the wrong type, fails naming
its path instead of being pruned by the apiserver. A pass' status is built once from the typed
model, and written only when the model reads it differently from what is stored (`status_patch`). Real passes over the render-only backend (its
Serve config is a real file) and a real tiny checkpoint; no cluster."""

from __future__ import annotations

import pytest

from manifests import small_deployment
from moe_operator.api.models import GroupStatus
from moe_operator.api.status import FIELDS, StatusError, build, checked, dump, status_patch
from moe_operator.api.validation import parse_spec
from moe_operator.backends.render_only import RenderOnlyClient
from moe_operator.reconcile import ObjectRef, observe_live, observed_groups, reconcile
from moe_operator.settings import Settings
from moe_workers.model.random_init import write_random_mixtral


@pytest.mark.parametrize("status, message", [
    ({"readyReplicas": 1}, "status fields the CRD does not have: readyReplicas"),
    ({"groups": [{"name": "ExpertShard-0", "readyReplica": 1}]}, "status.groups.0.readyReplica: Extra inputs"),
    ({"autoscaling": {"phase": "Loading", "movedCopy": 2}}, "status.autoscaling.movedCopy: Extra inputs"),
    ({"imbalance": "high"}, "status.imbalance: Input should be a valid number"),
    ({"tiers": {"hot": {"experts": 1, "bytes": "1Gi"}}}, "status.tiers.hot.bytes: Input should be a valid integer"),
])
def test_a_field_the_crd_does_not_have_is_refused_naming_it(status, message):
    with pytest.raises(StatusError) as err:
        checked(status)
    assert message in str(err.value)


def test_a_field_an_older_version_wrote_is_dropped_not_refused(tmp_path):
    """A stored status (a standalone status file) may hold a field since removed from the CRD: the
    pass drops it, as the apiserver prunes it, instead of failing every pass on it."""
    model = write_random_mixtral(tmp_path / "tiny", num_layers=2, num_experts=4, hidden_size=32,
                                 intermediate_size=64, vocab_size=128)
    raw = small_deployment("m", str(model), groups=2, num_cpus=0.1, autoscaling={"mode": "Off"})["spec"]
    res = reconcile(ObjectRef("default", "m", 1), raw, {"retiredField": 1, "replicas": 0},
                    RenderOnlyClient(str(tmp_path / "ray")), Settings(allowed_roots=(str(tmp_path),)),
                    fetch=lambda url: None)
    assert res.ready, res.event
    assert "retiredField" not in res.status and res.status["replicas"] == 1


def test_removals_pass():
    assert checked({k: None for k in FIELDS}) == {k: None for k in FIELDS}  # a merge patch's removals


def test_groups_are_built_from_their_model_and_keep_the_autoscalers_load():
    cluster = {"applications": {"default.m": {"deployments": {"ExpertShard-0": {
        "target_num_replicas": 2, "replicas": [{"state": "RUNNING"}, {"state": "STARTING"}]}}}}}
    groups = observed_groups(cluster, "default.m", {"ExpertShard-0": ["0.1", "0.2"], "ExpertShard-1": ["0.3"]}, 1,
                             previous=[{"name": "ExpertShard-0", "load": 12.5}])
    assert groups == [{"name": "ExpertShard-0", "replicas": 2, "readyReplicas": 1, "experts": 2, "load": 12.5},
                      {"name": "ExpertShard-1", "replicas": 1, "readyReplicas": 1, "experts": 1}]
    assert groups[1] == dump(GroupStatus(name="ExpertShard-1", replicas=1, ready_replicas=1, experts=1))


def test_a_reconcile_pass_and_the_live_observer_write_only_what_the_crd_keeps(tmp_path):
    model = write_random_mixtral(tmp_path / "tiny", num_layers=2, num_experts=4, hidden_size=32,
                                 intermediate_size=64, vocab_size=128)
    raw = small_deployment("m", str(model), groups=2, num_cpus=0.1, autoscaling={"mode": "Off"})["spec"]
    res = reconcile(ObjectRef("default", "m", 1), raw, {}, RenderOnlyClient(str(tmp_path / "ray")),
                    Settings(allowed_roots=(str(tmp_path),)), fetch=lambda url: None)
    assert res.ready, res.event
    assert checked(res.status) is res.status
    assert {"conditions", "observedGeneration", "endpoint", "rayAddress", "groups", "replicas"} <= set(res.status)
    assert [g["readyReplicas"] for g in res.status["groups"]] == [1, 1]

    tiers = {t: {"experts": 1, "bytes": 100} for t in ("hot", "warm", "cold")}
    reps = [{"replica": "a", "group": "ExpertShard-0", "tiers": tiers,
             "versions": {"1.2": {"source": "/w/e.safetensors", "digest": "sha256:new", "tier": "hot", "tokens": 0}},
             "swaps": {"1.2": {"outcome": "Serving", "path": "/w/e.safetensors", "reason": "", "duration_s": 0.2,
                               "started_at": "2026-12-03T10:00:00Z"}}}]
    spec = parse_spec({**raw, "experts": {**raw["experts"],
                                          "overrides": [{"expert": "1.2", "weights": {"path": "/w/e.safetensors"}}]}})
    fields, events = observe_live(spec, res.status, fetch=lambda url: {"replicas": reps})
    assert fields["lastSwaps"][0]["outcome"] == "Serving" and fields["overriddenExperts"] == 1
    assert checked(fields) is fields


STORED = {"observedGeneration": 3, "endpoint": "http://h:8000/m/v1", "replicas": 1,
          "conditions": [{"type": "Ready", "status": "True", "reason": "Serving", "message": "serving",
                          "observedGeneration": 3, "lastTransitionTime": "2026-12-07T13:00:00Z"}],
          "groups": [{"name": "ExpertShard-0", "replicas": 1, "readyReplicas": 1, "experts": 4, "load": 12}],
          "autoscaling": {"phase": "Steady", "target": {"0": ["0.1"]}}}


def test_a_status_the_model_reads_alike_is_not_written():
    """The apiserver hands back JSON: a float load stored as 12 reads as the 12.0 a pass computes; a
    key the CRD prunes, a None (nothing to remove) and a default the pass did not set are no change."""
    same = {**STORED, "groups": [{**STORED["groups"][0], "load": 12.0}], "kopf": {"dummy": 1}, "imbalance": None}
    assert status_patch(STORED, same) == {}
    assert status_patch(STORED, dict(STORED)) == {}


def test_a_change_is_written_as_a_merge_patch_of_it_alone():
    after = {**STORED, "replicas": 2, "autoscaling": {"phase": "Steady"}}
    assert status_patch(STORED, after) == {"replicas": 2, "autoscaling": {"target": None}}
    removed = {k: v for k, v in STORED.items() if k != "endpoint"}
    assert status_patch(STORED, removed) == {"endpoint": None}
    assert status_patch({}, STORED) == STORED


def test_a_stored_status_the_model_cannot_read_is_compared_as_it_is():
    old = {**STORED, "groups": [{"name": "ExpertShard-0", "retiredField": 1}]}  # an older version wrote it
    assert status_patch(old, STORED) == {"groups": STORED["groups"]}


def test_the_pass_builds_its_status_from_the_model_once(tmp_path):
    """The pass' Result carries the model's dump (the keys it set, as the CRD spells them), and a
    second pass over the same state changes nothing the model reads: no write."""
    assert build(STORED) == {**STORED, "groups": [{**STORED["groups"][0], "load": 12.0}]}
    with pytest.raises(StatusError, match="readyReplicas"):
        build({"readyReplicas": 1})
    model = write_random_mixtral(tmp_path / "tiny", num_layers=2, num_experts=4, hidden_size=32,
                                 intermediate_size=64, vocab_size=128)
    raw = small_deployment("m", str(model), groups=2, num_cpus=0.1, autoscaling={"mode": "Off"})["spec"]
    client, settings = RenderOnlyClient(str(tmp_path / "ray")), Settings(allowed_roots=(str(tmp_path),))
    first = reconcile(ObjectRef("default", "m", 1), raw, {}, client, settings, fetch=lambda url: None)
    assert first.ready, first.event
    assert first.status == build(first.status)
    again = reconcile(ObjectRef("default", "m", 1), raw, first.status, client, settings, fetch=lambda url: None)
    assert again.ready and status_patch(first.status, again.status) == {}
