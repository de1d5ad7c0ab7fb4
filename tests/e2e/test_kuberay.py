"""ray.mode KubeRay on the real apiserver: the operator owns a RayService and maps its status.

KubeRay's own CRD cannot be fetched on these machines, so the test installs a stand-in with
KubeRay's group, version, kind and plural (ray.io/v1 RayService, status subresource, fields
preserved). No KubeRay controller and no Pods run here: the test plays KubeRay's part by writing
the RayService's status, and checks the object the operator writes, its ownership, and the
status mapping both ways.
"""

from __future__ import annotations

import json
import signal

import pytest
import yaml

from moe_workers.model.random_init import write_random_mixtral
from moe_workers.serve.config import IMPORT_PATH
from operator_proc import Operator
from waiting import wait_for

pytestmark = pytest.mark.k8s

RAYSERVICE_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "rayservices.ray.io"},
    "spec": {"group": "ray.io", "scope": "Namespaced",
             "names": {"kind": "RayService", "plural": "rayservices", "singular": "rayservice", "listKind": "RayServiceList"},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                               "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]},
}


def manifest(name, model_path, groups=2, shape=None):
    spec = {"model": {"path": str(model_path)},
            "ray": {"mode": "KubeRay", "kubeRay": {"image": "registry.example/moe-worker:0.1", "workerReplicas": 2}},
            "experts": {"groups": groups, "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}}
    if shape:
        spec["model"]["shape"] = shape
    return {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name}, "spec": spec}


def condition(k8s, name, type_="Ready"):
    obj = k8s.kubectl_json("get", "moed", name)
    c = next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)
    return obj, c


def play_kuberay_ready(k8s, name):
    """What KubeRay writes once the app serves."""
    k8s.kubectl("patch", "rayservice", name, "--subresource=status", "--type=merge", "-p", json.dumps({"status": {
        "serviceStatus": "Running",
        "conditions": [{"type": "Ready", "status": "True", "reason": "NonZeroServeEndpoints",
                        "message": "Number of serve endpoints is greater than 0",
                        "lastTransitionTime": "2026-11-29T00:00:00Z"}]}}))


def test_operator_owns_a_rayservice_and_maps_its_status(crd_installed, tmp_path):
    k8s = crd_installed
    k8s.kubectl("apply", "-f", "-", input=json.dumps(RAYSERVICE_CRD))
    wait_for(lambda: k8s.kubectl("get", "rayservices", check=False).returncode == 0, timeout_s=60,
             what="RayService CRD served")
    roots = tmp_path / "models"
    model = write_random_mixtral(roots / "tiny", num_layers=2, num_experts=4, hidden_size=32, intermediate_size=64,
                                 vocab_size=128)
    log = open(tmp_path / "operator.log", "w+")
    op = Operator(k8s, None, str(roots), log)
    op.start()
    try:
        k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest("kr", model)))
        rs = wait_for(lambda: k8s.kubectl_json("get", "rayservices", "-o", "json")["items"], timeout_s=120,
                      what="RayService created")[0]
        owner = k8s.kubectl_json("get", "moed", "kr")
        assert rs["metadata"]["name"] == "kr"
        assert rs["metadata"]["ownerReferences"] == [{
            "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "name": "kr",
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        config = yaml.safe_load(rs["spec"]["serveConfigV2"])
        app = config["applications"][0]
        assert app["name"] == "default.kr" and app["import_path"] == IMPORT_PATH
        assert [d["name"] for d in app["deployments"]] == ["Ingress", "ExpertShard-0", "ExpertShard-1"]
        assert app["deployments"][1]["user_config"]["tiers"]["hot_budget"] == 16 * 2**20
        workers = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
        assert workers["replicas"] == 2 and workers["template"]["spec"]["containers"][0]["image"] == \
            "registry.example/moe-worker:0.1"
        # KubeRay has not reported it serving yet: Ready=False with its reason, and retried
        _, ready = wait_for(lambda: (r := condition(k8s, "kr"))[1] and r, what="a Ready condition")
        assert ready["status"] == "False" and ready["reason"] == "RayServiceNotReady"
        play_kuberay_ready(k8s, "kr")
        obj, ready = wait_for(lambda: (r := condition(k8s, "kr"))[1]["status"] == "True" and r, timeout_s=120,
                              what="Ready=True after the RayService is")
        st = obj["status"]
        assert ready["reason"] == "Serving" and st["rayService"] == "kr"
        assert st["endpoint"] == "http://kr-serve-svc.default.svc:8000/v1"
        assert [(g["name"], g["readyReplicas"]) for g in st["groups"]] == [("ExpertShard-0", 1), ("ExpertShard-1", 1)]

        # a spec change re-renders the owned RayService in place (same object, new serveConfigV2)
        uid = rs["metadata"]["uid"]
        k8s.kubectl("patch", "moed", "kr", "--type=merge", "-p", json.dumps({"spec": {"experts": {"groups": 3}}}))

        def three_groups():
            r = k8s.kubectl_json("get", "rayservice", "kr")
            names = [d["name"] for d in yaml.safe_load(r["spec"]["serveConfigV2"])["applications"][0]["deployments"]]
            return r if len(names) == 4 else None

        assert wait_for(three_groups, what="3 groups in serveConfigV2")["metadata"]["uid"] == uid

        # a RayService of the same name that someone else owns is not taken over
        k8s.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "ray.io/v1", "kind": "RayService",
                                                           "metadata": {"name": "taken"}, "spec": {}}))
        k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest("taken", model)))
        _, bad = wait_for(lambda: (r := condition(k8s, "taken"))[1] and r, what="taken: a Ready condition")
        assert bad["status"] == "False" and bad["reason"] == "DeployFailed" and "not owned by this MoEDeployment" in bad["message"]
        assert k8s.kubectl_json("get", "rayservice", "taken")["spec"] == {}

        # the operator cannot read config.json on the Ray Pods: spec.model.shape says what it needs
        elsewhere = roots / "on-the-ray-pods"
        k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest("noshape", elsewhere)))
        _, bad = wait_for(lambda: (r := condition(k8s, "noshape"))[1] and r, what="noshape: InvalidSpec")
        assert bad["reason"] == "InvalidSpec" and "set spec.model.shape" in bad["message"]
        shape = {"numLayers": 2, "numExperts": 4, "topK": 2, "hiddenSize": 32, "intermediateSize": 64, "dtype": "float32"}
        k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest("shaped", elsewhere, shape=shape)))
        wait_for(lambda: k8s.kubectl("get", "rayservice", "shaped", check=False).returncode == 0, what="shaped's RayService")

        # deletion: the finalizer removes the RayService before the object goes
        for n in ("kr", "shaped", "noshape", "taken"):
            k8s.kubectl("delete", "moed", n, "--wait=true", "--timeout=120s")
        left = [r["metadata"]["name"] for r in k8s.kubectl_json("get", "rayservices")["items"]]
        assert left == ["taken"]  # the one the operator never owned stays
    finally:
        op.kill(signal.SIGTERM)
        log.seek(0)
        print(log.read()[-5000:])
        k8s.kubectl("delete", "rayservice", "--all", check=False)
