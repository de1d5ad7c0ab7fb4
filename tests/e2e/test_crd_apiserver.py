"""The MoEDeployment CRD on a real kube-apiserver + etcd."""

from __future__ import annotations

import glob
import json
import re

import pytest
import yaml

from invalid_manifests import CASES, SEMANTIC_CASES, VALID, build

pytestmark = pytest.mark.k8s


def test_crd_established_with_subresources(crd_installed):
    crd = crd_installed.kubectl_json("get", "crd", "moedeployments.serving.moe.io")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True"
    assert conditions.get("NonStructuralSchema") != "True"
    resources = crd_installed.kubectl("api-resources", "--api-group=serving.moe.io", "-o", "wide").stdout
    assert re.search(r"moedeployments\s+moed\s+serving\.moe\.io/v1alpha1\s+true\s+MoEDeployment", resources), resources


@pytest.mark.parametrize("path", sorted(glob.glob("examples/*.yaml")))
def test_examples_apply(crd_installed, path):
    out = crd_installed.kubectl("apply", "-f", path).stdout
    assert "created" in out or "configured" in out or "unchanged" in out
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") == "MoEDeployment":
            got = crd_installed.kubectl_json("get", "moed", doc["metadata"]["name"])
            # what the user wrote is stored as written, nothing pruned
            for key, value in doc["spec"]["model"].items():
                assert got["spec"]["model"][key] == value


def test_schema_defaults_applied(crd_installed):
    doc = build(None, "defaults-applied")
    crd_installed.kubectl("apply", "-f", "-", input=json.dumps(doc))
    got = crd_installed.kubectl_json("get", "moed", "defaults-applied")["spec"]
    assert got["experts"]["replicasPerGroup"] == 1
    assert got["experts"]["tiers"]["policy"] == "RankAware"
    # no default family: an unset spec.model.family means config.json's model_type decides
    assert "family" not in got["model"]


def _names_field(message: str, path: str) -> bool:
    return path in message


@pytest.mark.parametrize("case_id,mutation,path", CASES, ids=[c[0] for c in CASES])
def test_invalid_manifest_rejected_by_apiserver(crd_installed, case_id, mutation, path):
    doc = build(mutation, case_id)
    # --validate=false: no client-side check, so this is the apiserver's own verdict (what kopf,
    # helm and every API client get)
    proc = crd_installed.kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0, f"{case_id} was accepted"
    assert _names_field(proc.stderr, path), f"{case_id}: error does not name {path}: {proc.stderr}"
    gone = crd_installed.kubectl("get", "moed", case_id, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


@pytest.mark.parametrize("case_id,mutation,path", SEMANTIC_CASES, ids=[c[0] for c in SEMANTIC_CASES])
def test_what_the_schema_cannot_say_is_accepted_by_the_apiserver(crd_installed, case_id, mutation, path):
    """The parser refuses these (tests/unit) and the operator marks them InvalidSpec; the
    apiserver stores them: this test notices if the schema starts refusing them."""
    proc = crd_installed.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(build(mutation, case_id)),
                                 check=False)
    assert proc.returncode == 0, proc.stderr


_PLAIN = [c for c in CASES if c[0] in ("model-path-missing", "hot-budget-malformed", "expert-id-dash")]


@pytest.mark.parametrize("case_id,mutation,path", _PLAIN, ids=[c[0] for c in _PLAIN])
def test_invalid_manifest_rejected_by_plain_kubectl(crd_installed, case_id, mutation, path):
    proc = crd_installed.kubectl("apply", "-f", "-", input=json.dumps(build(mutation, case_id)), check=False)
    assert proc.returncode != 0
    leaf = path.rsplit(".", 1)[-1]
    assert leaf in proc.stderr, proc.stderr


def test_missing_spec_rejected(crd_installed):
    doc = {k: v for k, v in VALID.items() if k != "spec"}
    doc["metadata"] = {"name": "no-spec"}
    proc = crd_installed.kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0 and "spec: Required value" in proc.stderr, proc.stderr


def test_scale_subresource(crd_installed):
    doc = build(None, "scalable")
    crd_installed.kubectl("apply", "-f", "-", input=json.dumps(doc))
    crd_installed.kubectl("scale", "moed/scalable", "--replicas=3")
    got = crd_installed.kubectl_json("get", "moed", "scalable")
    assert got["spec"]["experts"]["replicasPerGroup"] == 3
    scale = json.loads(crd_installed.kubectl(
        "get", "--raw", "/apis/serving.moe.io/v1alpha1/namespaces/default/moedeployments/scalable/scale").stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    # the schema's range applies through the scale subresource too
    proc = crd_installed.kubectl("scale", "moed/scalable", "--replicas=1000", check=False)
    assert proc.returncode != 0 and "replicasPerGroup" in proc.stderr


def test_status_subresource_is_separate(crd_installed):
    doc = build(None, "status-sub")
    crd_installed.kubectl("apply", "-f", "-", input=json.dumps(doc))
    patch = json.dumps({"status": {"replicas": 2, "imbalance": 1.5,
                                   "conditions": [{"type": "Ready", "status": "True", "reason": "Serving"}]}})
    crd_installed.kubectl("patch", "moed", "status-sub", "--subresource=status", "--type=merge", "-p", patch)
    got = crd_installed.kubectl_json("get", "moed", "status-sub")
    assert got["status"]["replicas"] == 2
    # a status written through the main resource is ignored (status subresource semantics)
    crd_installed.kubectl("patch", "moed", "status-sub", "--type=merge", "-p", json.dumps({"status": {"replicas": 9}}))
    assert crd_installed.kubectl_json("get", "moed", "status-sub")["status"]["replicas"] == 2
    table = crd_installed.kubectl("get", "moed", "status-sub").stdout
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "READY", "GROUPS", "REPLICAS", "IMBALANCE", "AGE"]
    assert row.split()[:5] == ["status-sub", "True", "2", "2", "1.5"]


def test_explain_shows_documentation(crd_installed):
    out = crd_installed.kubectl("explain", "moedeployment.spec").stdout
    assert "Desired state of a MoEDeployment" in out
    for field in ("model", "ray", "ingress", "experts", "autoscaling"):
        assert re.search(rf"^\s+{field}\s", out, re.M), f"{field} missing from explain:\n{out}"
    tiers = crd_installed.kubectl("explain", "moedeployment.spec.experts.tiers.policy").stdout
    assert "RecencyFrequency" in tiers
    budget = crd_installed.kubectl("explain", "moedeployment.spec.experts.tiers.hot.budget").stdout
    assert "per replica" in budget


def test_unprivileged_user_cannot_create(crd_installed):
    doc = build(None, "not-allowed")
    proc = crd_installed.kubectl("apply", "-f", "-", input=json.dumps(doc), check=False,
                                 kubeconfig=crd_installed.developer_kubeconfig)
    assert proc.returncode != 0 and "forbidden" in proc.stderr.lower()
