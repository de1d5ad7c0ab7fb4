"""The MoEDeployment models and validation, without a cluster."""

from __future__ import annotations

import glob
import math
import typing

import pytest
import yaml
from hypothesis import given, strategies as st

from invalid_manifests import CASES, SEMANTIC_CASES, VALID, build
from moe_operator.api.models import MoEDeployment, MoEDeploymentSpec
from moe_operator.api.types import MAX_QUANTITY, ExpertId, parse_quantity, quantity_bytes
from moe_operator.api.validation import SpecError, parse_spec


@pytest.mark.parametrize("text,expected", [
    ("16Gi", 16 * 2**30), ("512Mi", 512 * 2**20), ("2G", 2e9), ("1k", 1000), ("1.5Gi", 1.5 * 2**30),
    ("1e3", 1000), ("500m", 0.5), (1024, 1024), ("0", 0),
])
def test_quantity_parsing(text, expected):
    assert math.isclose(float(parse_quantity(text)), expected)


@pytest.mark.parametrize("bad", ["16GB", "lots", "", "1.2.3Gi", "Gi", "-1Gi", True])
def test_quantity_rejects(bad):
    with pytest.raises(ValueError):
        parse_quantity(bad)


@given(st.integers(min_value=0, max_value=2**40), st.sampled_from(["", "Ki", "Mi", "Gi"]))
def test_quantity_bytes_round_trip(n, suffix):
    factor = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[suffix]
    if n * factor > MAX_QUANTITY:  # an int64, as Kubernetes keeps it
        with pytest.raises(ValueError, match="out of range"):
            quantity_bytes(f"{n}{suffix}")
    else:
        assert quantity_bytes(f"{n}{suffix}") == n * factor


@pytest.mark.parametrize("text,value", [("1e3", 1000), ("1.5Gi", 3 * 2**29), ("0.5", 1), ("1n", 1), ("2k", 2000),
                                         ("+7", 7), ("1E2", 100), (".5Ki", 512), (MAX_QUANTITY, 2**63 - 1024)])
def test_quantities_are_exact_and_fractions_round_up(text, value):
    assert quantity_bytes(text) == value


@pytest.mark.parametrize("bad", ["1e400", "9" * 400, 2**63, 2**63 - 1023, "-1Gi", "-0", " 1Gi", "1Gi ", True, 1.5, "1e-400000"])
def test_quantities_out_of_range_or_malformed_are_refused(bad):
    with pytest.raises(ValueError):
        parse_quantity(bad)


@given(st.integers(0, 999_999), st.integers(0, 999_999))
def test_expert_id_round_trip(layer, expert):
    eid = ExpertId(layer, expert)
    assert ExpertId.parse(str(eid)) == eid


@pytest.mark.parametrize("bad", ["3-12", "3.12.1", "a.b", "03.1", "3.", ".3", "", "-1.2"])
def test_expert_id_rejects(bad):
    with pytest.raises(ValueError, match="not an expert id"):
        ExpertId.parse(bad)


def test_defaults_fill_in():
    spec = parse_spec(VALID["spec"])
    assert spec.model.family is None and spec.model.dtype == "auto"  # None: config.json's model_type
    assert spec.ray.mode == "Existing" and spec.ray.address is None
    assert spec.experts.replicas_per_group == 1
    assert spec.experts.tiers.policy == "RankAware"
    assert spec.experts.tiers.cold.path == "/var/cache/moe-experts"
    assert spec.autoscaling.mode == "Off"
    assert spec.ingress.route_prefix == "/"


def test_round_trip_uses_camel_case():
    spec = parse_spec(VALID["spec"])
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["experts"]["replicasPerGroup"] == 1
    assert MoEDeploymentSpec.model_validate(dumped) == spec


@pytest.mark.parametrize("case_id,mutation,path", CASES + SEMANTIC_CASES, ids=[c[0] for c in CASES + SEMANTIC_CASES])
def test_invalid_manifests_rejected_by_parser(case_id, mutation, path):
    doc = build(mutation, case_id)
    with pytest.raises(SpecError) as err:
        parse_spec(doc["spec"])
    accepted = {path, path.rsplit("[", 1)[0]} if path.endswith("]") else {path}
    assert any(p + ":" in line for line in err.value.problems for p in accepted), err.value.problems


@pytest.mark.parametrize("spec_patch,needle", [
    ({"ray": {"mode": "KubeRay"}}, "ray.kubeRay is required"),
    ({"autoscaling": {"minReplicasPerGroup": 5, "maxReplicasPerGroup": 2}}, "minReplicasPerGroup (5) is above"),
    ({"autoscaling": {"metrics": {"source": "Prometheus"}}}, "prometheusUrl is required"),
    ({"experts": {"groups": 2, "tiers": {"hot": {"budget": "1Gi"}, "warm": {"budget": "1Gi"}}, "shards": 3}},
     "spec.experts.shards: Extra inputs are not permitted"),
])
def test_cross_field_rules(spec_patch, needle):
    spec = {**VALID["spec"], **spec_patch}
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert needle in str(err.value)


def test_missing_spec():
    with pytest.raises(SpecError, match="spec: required field is missing"):
        parse_spec(None)


@pytest.mark.parametrize("path", sorted(glob.glob("examples/*.yaml")))
def test_examples_parse(path):
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") == "MoEDeployment":
            MoEDeployment.model_validate(doc)


def test_pruning_drops_unknown_fields_and_nulls_as_the_apiserver_does():
    from moe_operator.api.pruning import prune, spec_schema

    spec = {"model": {"path": "/m", "dtype": None}, "experts": {"groups": 2, "replicas_per_group": 2,
            "tiers": {"hot": {"budget": "1Gi"}, "warm": {"budget": "1Gi"}},
            "overrides": [{"expert": "0.1", "weights": {"path": "/w.safetensors", "sha": "x"}}]}}
    pruned, dropped = prune(spec, spec_schema(), "spec")
    assert dropped == ["spec.model.dtype: null", "spec.experts.replicas_per_group: unknown field",
                       "spec.experts.overrides[0].weights.sha: unknown field"]
    parsed = parse_spec(pruned)
    assert parsed.experts.replicas_per_group == 1 and parsed.model.dtype == "auto"  # the defaults, as in Kubernetes


def test_the_tier_policies_the_api_offers_are_the_stores():
    """One list: the CRD's enum and default come from the store's policies."""
    from moe_operator.api.models import TierSpec
    from moe_workers.store.policy import DEFAULT_POLICY, POLICIES

    field = TierSpec.model_fields["policy"]
    assert typing.get_args(field.annotation) == POLICIES and field.default == DEFAULT_POLICY


def test_kuberay_pins_need_a_worker_group_with_their_labels():
    kuberay = {"rayVersion": "2.60.0", "image": "moe-ray:1"}
    spec = {**VALID["spec"], "ray": {"mode": "KubeRay", "kubeRay": kuberay},
            "experts": {**VALID["spec"]["experts"], "groupNodes": [{"groups": [1], "rayNodeLabels": {"pool": "b"}}]}}
    # the one default group has no labels: nothing could take group 1
    with pytest.raises(SpecError, match=r"experts.groupNodes\[0\] asks for Ray node labels \{'pool': 'b'\}, "
                                        r"which no worker group .* \(experts: no labels\)"):
        parse_spec(spec)
    groups = [{"name": "a", "labels": {"pool": "a"}}, {"name": "b", "replicas": 2, "labels": {"pool": "b", "zone": "z1"}}]
    parse_spec({**spec, "ray": {"mode": "KubeRay", "kubeRay": {**kuberay, "workerGroups": groups}}})
    ingress_pinned = {**spec, "ingress": {"rayNodeLabels": {"pool": "c"}},
                      "ray": {"mode": "KubeRay", "kubeRay": {**kuberay, "workerGroups": groups}}}
    with pytest.raises(SpecError, match=r"ingress.rayNodeLabels asks for .*'pool': 'c'.*a: \{'pool': 'a'\}"):
        parse_spec(ingress_pinned)
    parse_spec({**spec, "ray": {"mode": "Existing"}})  # there the Ray nodes' own labels decide (checked live)
    twice = [{"name": "a"}, {"name": "a"}]
    with pytest.raises(SpecError, match=r"workerGroups.*entry \[1\] names worker group a again"):
        parse_spec({**spec, "ray": {"mode": "KubeRay", "kubeRay": {**kuberay, "workerGroups": twice}}})
