"""The KubeRay RayService rendered from a MoEDeployment (no cluster)."""

from __future__ import annotations

import pytest
import yaml

from moe_operator.api.validation import parse_spec
from moe_operator.planner.initial import initial_placement
from moe_operator.render.rayservice import rayservice_ready, render_rayservice
from moe_operator.render.serve_app import render_application

KUBERAY_EXAMPLE = "examples/moedeployment-kuberay.yaml"


def _spec():
    return parse_spec(yaml.safe_load(open(KUBERAY_EXAMPLE))["spec"])


def test_rayservice_carries_the_same_serve_app_and_ownership():
    spec = _spec()
    app = render_application("prod", "mixtral-8x7b", spec, initial_placement(32, 8, spec.experts.groups))
    rs = render_rayservice("prod", "mixtral-8x7b", "uid-123", spec, app)
    assert rs["apiVersion"] == "ray.io/v1" and rs["kind"] == "RayService"
    owner = rs["metadata"]["ownerReferences"][0]
    assert owner == {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "name": "mixtral-8x7b",
                     "uid": "uid-123", "controller": True, "blockOwnerDeletion": True}
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert serve["applications"] == [app]
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    worker = cluster["workerGroupSpecs"][0]
    assert worker["replicas"] == 4
    limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "2"}
    assert worker["template"]["spec"]["containers"][0]["image"] == "ghcr.io/example/moe-workers:0.1.0"


def test_existing_mode_is_refused():
    spec = _spec()
    spec.ray.mode = "Existing"
    with pytest.raises(ValueError, match="mode KubeRay"):
        render_rayservice("ns", "n", "u", spec, {})


@pytest.mark.parametrize("status,expected", [
    ({}, (False, "RayService has no status yet")),
    ({"serviceStatus": "Running"}, (True, "RayService serviceStatus Running")),
    ({"serviceStatus": "WaitForServeDeploymentReady"}, (False, "RayService serviceStatus WaitForServeDeploymentReady")),
    ({"conditions": [{"type": "Ready", "status": "False", "reason": "Initializing", "message": "cluster starting"}]},
     (False, "cluster starting")),
    ({"conditions": [{"type": "Ready", "status": "True", "reason": "NonZeroServeEndpoints"}]},
     (True, "NonZeroServeEndpoints")),
])
def test_status_mapping(status, expected):
    assert rayservice_ready({"status": status}) == expected
