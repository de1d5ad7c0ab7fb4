"""The CRD in crds/ is generated from the pydantic models and is a valid structural schema."""

from __future__ import annotations

from pathlib import Path

import yaml

from moe_operator.api.crd import build_crd, render_crd_yaml

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "moedeployments.serving.moe.io.yaml"


def test_committed_crd_matches_models():
    assert CRD_FILE.read_text() == render_crd_yaml(), (
        "crds/ drifted from moe_operator.api.models; regenerate with: "
        "python -m moe_operator.api.crd > crds/moedeployments.serving.moe.io.yaml"
    )


def _walk(node, path="openAPIV3Schema"):
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_documented():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert "$ref" not in yaml.safe_dump(schema)
    for path, node in _walk(schema):
        typed = "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        assert typed, f"{path} has no type"
        assert node.get("additionalProperties") is not False, f"{path}: additionalProperties false is not structural"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, True), bool), f"{path}.{bound} must be a boolean in OpenAPI v3"
        if path.startswith("openAPIV3Schema.spec") and path.count(".") >= 2 and not path.endswith("[]"):
            assert node.get("description"), f"{path} has no description"


def test_contract_names():
    crd = build_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "moedeployments.serving.moe.io"
    assert spec["group"] == "serving.moe.io"
    assert spec["names"]["kind"] == "MoEDeployment" and spec["names"]["shortNames"] == ["moed"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.experts.replicasPerGroup"
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Ready", "Replicas", "Imbalance", "Age"} <= columns
