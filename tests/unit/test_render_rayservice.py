"""The KubeRay RayService rendered from a MoEDeployment (no cluster)."""

from __future__ import annotations

import pytest
import yaml

from moe_operator.api.validation import parse_spec
from moe_operator.planner.initial import initial_placement
from moe_operator.api.validation import SpecError
from moe_operator.backends.kuberay import contains, needs_write
from moe_operator.reconcile import same_config
from moe_operator.names import RENDERED_SPEC_ANNOTATION
from moe_operator.render.rayservice import name_problem, render_rayservice
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
    assert [(g["groupName"], g["replicas"], g["labels"]) for g in cluster["workerGroupSpecs"]] == [
        ("pool-a", 2, {"pool": "a"}), ("pool-b", 2, {"pool": "b"})]
    worker = cluster["workerGroupSpecs"][0]
    pod = worker["template"]["spec"]
    assert pod["volumes"] == [{"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "models", "mountPath": "/models", "readOnly": True}]
    limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "2"}
    assert worker["template"]["spec"]["containers"][0]["image"] == "ghcr.io/example/moe-workers:0.1.0"


def test_the_workers_get_sys_nice_only_when_real_time_is_allowed():
    spec = _spec()
    app = render_application("prod", "m", spec, initial_placement(32, 8, spec.experts.groups))

    def containers(rs):
        cluster = rs["spec"]["rayClusterConfig"]
        return (cluster["headGroupSpec"]["template"]["spec"]["containers"][0],
                cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0])

    head, worker = containers(render_rayservice("prod", "m", "u", spec, app))
    assert "securityContext" not in head and "securityContext" not in worker  # the default: no capability
    raw = yaml.safe_load(open(KUBERAY_EXAMPLE))["spec"]
    raw["ray"]["kubeRay"]["allowRealtime"] = True
    allowed = render_rayservice("prod", "m", "u", parse_spec(raw), app)
    head, worker = containers(allowed)
    assert worker["securityContext"] == {"capabilities": {"add": ["SYS_NICE"]}}
    assert "securityContext" not in head  # the head runs no replica
    assert needs_write(render_rayservice("prod", "m", "u", spec, app), allowed)  # a new pod template


def test_existing_mode_is_refused():
    spec = _spec()
    spec.ray.mode = "Existing"
    with pytest.raises(ValueError, match="mode KubeRay"):
        render_rayservice("ns", "n", "u", spec, {})


def _rendered(spec=None, groups=None):
    spec = spec or _spec()
    if groups:
        spec.experts.groups = groups
    app = render_application("prod", "mixtral-8x7b", spec, initial_placement(32, 8, spec.experts.groups))
    return render_rayservice("prod", "mixtral-8x7b", "uid-123", spec, app)


@pytest.mark.parametrize("name,ok", [("mixtral-8x7b", True), ("a" * 47, True), ("a" * 48, False),
                                     ("mixtral.8x7b", False), ("8x7b", False), ("mixtral-", False)])
def test_names_kuberay_refuses(name, ok):
    problem = name_problem(name)
    assert (problem is None) == ok
    if not ok:
        assert problem.startswith("metadata.name") and ("47" in problem or "DNS-1035" in problem)


def test_auth_token_secret_becomes_kuberays_auth_options():
    raw = yaml.safe_load(open(KUBERAY_EXAMPLE))["spec"]
    raw["ray"].pop("authTokenSecretRef")
    assert "authOptions" not in _rendered(parse_spec(raw))["spec"]["rayClusterConfig"]
    raw["ray"]["authTokenSecretRef"] = {"name": "ray-token", "key": "auth_token"}
    cluster = _rendered(parse_spec(raw))["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    raw["ray"]["authTokenSecretRef"] = {"name": "ray-token"}  # our default key, "token", is not what KubeRay reads
    with pytest.raises(SpecError, match="key auth_token"):
        parse_spec(raw)


def test_a_steady_state_needs_no_write_despite_crd_defaults():
    desired = _rendered()
    live = yaml.safe_load(yaml.safe_dump(desired))  # what the apiserver returns, with KubeRay's defaults filled in
    live["metadata"].update(resourceVersion="7", finalizers=["ray.io/rayservice-finalizer"])
    worker = live["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    worker.update(numOfHosts=1, priority=0)
    for port in live["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]:
        port["protocol"] = "TCP"
    assert live["spec"] != desired["spec"] and contains(live["spec"], desired["spec"])
    assert needs_write(live, desired) is None
    # a real change: a new digest
    assert needs_write(live, _rendered(groups=2)) == "the rendered spec changed"
    # someone edited what we own
    worker["replicas"] = 9
    assert needs_write(live, desired) == "the live spec differs from what was written"


def test_removing_a_field_changes_the_digest():
    raw = yaml.safe_load(open(KUBERAY_EXAMPLE))["spec"]
    with_auth = _rendered()  # the example sets spec.ray.authTokenSecretRef
    raw["ray"].pop("authTokenSecretRef")
    without = _rendered(parse_spec(raw))
    # the live object still holds everything `without` sets, but its digest says authOptions must go
    assert contains(with_auth["spec"], without["spec"])
    assert needs_write(with_auth, without) == "the rendered spec changed"
    assert with_auth["metadata"]["annotations"][RENDERED_SPEC_ANNOTATION] != \
        without["metadata"]["annotations"][RENDERED_SPEC_ANNOTATION]


def test_same_config_is_value_equality():
    ours = {"name": "a", "deployments": [{"name": "Ingress", "ray_actor_options": {"num_cpus": 1}}]}
    assert same_config({"deployments": [{"ray_actor_options": {"num_cpus": 1.0}, "name": "Ingress"}], "name": "a"}, ours)
    assert not same_config(None, ours)
    assert not same_config({"name": "a", "deployments": [{"name": "Ingress", "ray_actor_options": {}}]}, ours)


def test_worker_groups_carry_ray_node_labels_and_their_own_sizes():
    raw = yaml.safe_load(open(KUBERAY_EXAMPLE))["spec"]
    raw["ray"]["kubeRay"].update({
        "headCpu": "500m", "headMemory": "2Gi", "upgradeStrategy": "NewCluster",
        "workerGroups": [{"name": "pool-a", "replicas": 1, "labels": {"pool": "a"}},
                         {"name": "pool-b", "replicas": 3, "labels": {"pool": "b"}, "cpu": "2", "gpus": 0}]})
    raw["experts"]["groupNodes"] = [{"groups": [0], "rayNodeLabels": {"pool": "a"}},
                                    {"groups": [1], "rayNodeLabels": {"pool": "b"}}]
    spec = parse_spec(raw)
    app = render_application("prod", "m", spec, initial_placement(32, 8, spec.experts.groups))
    rs = render_rayservice("prod", "m", "u", spec, app)
    cluster = rs["spec"]["rayClusterConfig"]
    a, b = cluster["workerGroupSpecs"]
    assert (a["groupName"], a["replicas"], a["labels"]) == ("pool-a", 1, {"pool": "a"})
    assert (b["groupName"], b["minReplicas"], b["maxReplicas"], b["labels"]) == ("pool-b", 3, 3, {"pool": "b"})
    assert "labels" not in a["rayStartParams"] and "labels" not in b["rayStartParams"]  # KubeRay refuses that
    # a group's own size, else the kubeRay defaults
    assert a["template"]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "16", "memory": "128Gi",
                                                                          "nvidia.com/gpu": "2"}
    assert b["template"]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "2", "memory": "128Gi"}
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert head == {"cpu": "500m", "memory": "2Gi"}
    assert rs["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    # the pins reach Serve as each shard group's label_selector, as in mode Existing
    shards = {d["name"]: d for d in app["deployments"]}
    assert shards["ExpertShard-1"]["ray_actor_options"]["label_selector"] == {"pool": "b"}
    # without workerGroups: one unlabelled group, no upgradeStrategy written (KubeRay's default)
    raw = yaml.safe_load(open(KUBERAY_EXAMPLE))["spec"]
    del raw["ray"]["kubeRay"]["workerGroups"], raw["experts"]["groupNodes"]
    plain = render_rayservice("prod", "m", "u", parse_spec(raw), app)
    assert [g["groupName"] for g in plain["spec"]["rayClusterConfig"]["workerGroupSpecs"]] == ["experts"]
    assert "labels" not in plain["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert "upgradeStrategy" not in plain["spec"]
