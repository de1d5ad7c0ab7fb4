"""ray.mode KubeRay on the real apiserver, the operator's side: the RayService it owns, checked by
KubeRay's own CRDs (v1.5.0, as its module ships them: required fields, defaults, pruning, CEL), and
the status mapping through each stage of a RayService's life. No KubeRay controller runs here
(tests/e2e/test_kuberay_node.py runs the real one on a node): this test writes the RayService's
status as KubeRay writes it, for the stages a controller cannot be made to reach on cue (a replica
UNHEALTHY, an upgrade's pending cluster failing, KubeRay's terminal InitializingTimeout), and checks
the object the operator writes, that a steady state writes nothing, names KubeRay refuses, and a
RayService owned by someone else.
"""

from __future__ import annotations

import json
import signal

import pytest
import yaml

from kuberay_operator import crd_files
from moe_workers.model.random_init import write_random_mixtral
from moe_workers.serve.config import IMPORT_PATH
from operator_proc import Operator
from waiting import wait_for

pytestmark = pytest.mark.k8s
# a RayService of someone else's: the least KubeRay's CRD accepts
MINIMAL_SPEC = {"rayClusterConfig": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [
    {"name": "ray-head", "image": "rayproject/ray:2.60.0"}]}}}}}

def manifest(name, model_path, groups=2, shape=None, auth=False):
    spec = {"model": {"path": str(model_path)},
            "ray": {"mode": "KubeRay", "kubeRay": {"image": "registry.example/moe-worker:0.1", "workerReplicas": 2},
                    **({"authTokenSecretRef": {"name": "ray-auth", "key": "auth_token"}} if auth else {})},
            "experts": {"groups": groups, "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}}
    if shape:
        spec["model"]["shape"] = shape
    return {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name}, "spec": spec}


def condition(k8s, name, type_="Ready"):
    obj = k8s.kubectl_json("get", "moed", name)
    c = next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)
    return obj, c


def rs_condition(type_, status, reason, message, generation):
    return {"type": type_, "status": status, "reason": reason, "message": message or reason,
            "observedGeneration": generation, "lastTransitionTime": "2026-11-30T00:00:00Z"}


def app_status(state, deployments, message=""):
    """omitempty, as KubeRay's Go types serialise: no empty strings"""
    return {"applicationStatuses": {"default.kr": {"status": state, **({"message": message} if message else {}),
                                                   "serveDeploymentStatuses": {
        d: {"status": s, **({"message": m} if m else {})} for d, (s, m) in deployments.items()}}},
            "rayClusterName": "kr-x7k2p"}


def play_kuberay(k8s, name, generation, ready, app=None, upgrade=("False", "NoPendingCluster"), pending=None):
    """Write the RayService's status as KubeRay does (a whole status, as its Status().Update)."""
    status = {"observedGeneration": generation,
              "conditions": [rs_condition("Ready", *ready, generation),
                             rs_condition("UpgradeInProgress", *upgrade, "", generation)],
              **({"serviceStatus": "Running", "numServeEndpoints": 1} if ready[0] == "True" else {}),
              "activeServiceStatus": app or {}, "pendingServiceStatus": pending or {}}
    k8s.kubectl("patch", "rayservice", name, "--subresource=status", "--type=json", "-p",
                json.dumps([{"op": "add", "path": "/status", "value": status}]))


HEALTHY = {"Ingress": ("HEALTHY", ""), "ExpertShard-0": ("HEALTHY", ""), "ExpertShard-1": ("HEALTHY", "")}


def rayservice_writes(k8s) -> float:
    """Creates and updates of RayServices the apiserver has served (its own request counter; our
    status writes go to the status subresource and are not counted)."""
    total = 0.0
    for line in k8s.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        if line.startswith("apiserver_request_total{") and 'resource="rayservices"' in line and \
                'subresource=""' in line and any(f'verb="{v}"' in line for v in ("POST", "PUT", "PATCH")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def reason_is(k8s, name, reason, type_="Ready"):
    return lambda: (r := condition(k8s, name, type_))[1] and r[1]["reason"] == reason and r


def test_operator_owns_a_rayservice_and_maps_its_status(crd_installed, tmp_path):
    k8s = crd_installed
    for f in crd_files(k8s.kuberay_dir):
        k8s.kubectl("apply", "--server-side", "-f", str(f))
    wait_for(lambda: k8s.kubectl("get", "rayservices", check=False).returncode == 0, timeout_s=60,
             what="RayService CRD served")
    roots = tmp_path / "models"
    model = write_random_mixtral(roots / "tiny", num_layers=2, num_experts=4, hidden_size=32, intermediate_size=64,
                                 vocab_size=128)
    log = open(tmp_path / "operator.log", "w+")
    op = Operator(k8s, None, str(roots), log)
    op.start()
    try:
        # token auth asked for, and KubeRay 1.5.0's CRD has no authOptions: nothing is written (KubeRay
        # would start a cluster without the token), the reason named
        k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest("kr", model, auth=True)))
        _, c = wait_for(lambda: (r := condition(k8s, "kr"))[1] and "authOptions" in r[1]["message"] and r,
                        what="the missing authOptions named")
        assert c["status"] == "False" and "would run without the token authentication" in c["message"], c
        assert not k8s.kubectl_json("get", "rayservices")["items"]
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
        # the CRD's defaults are in the live object, and nothing we render was pruned
        assert workers["numOfHosts"] == 1 and workers["minReplicas"] == 2
        head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        assert {p["protocol"] for p in head["ports"]} == {"TCP"}
        assert "authOptions" not in rs["spec"]["rayClusterConfig"]
        assert rs["metadata"]["generation"] == 1

        writes = rayservice_writes(k8s)
        assert writes >= 1
        # KubeRay has not observed it yet (no status): not concluded from
        _, ready = wait_for(reason_is(k8s, "kr", "WaitingForKubeRay"), what="WaitingForKubeRay")
        assert ready["status"] == "False" and "generation 1" in ready["message"]
        # the cluster starts, the app deploys
        play_kuberay(k8s, "kr", 1, ("False", "Initializing", "Waiting for the RayCluster"), upgrade=(
            "False", "Initializing"), app=app_status("DEPLOYING", {**HEALTHY, "ExpertShard-1": ("UPDATING", "")}))
        _, ready = wait_for(reason_is(k8s, "kr", "Deploying"), what="Deploying")
        assert "ExpertShard-1" in ready["message"]
        assert condition(k8s, "kr", "Progressing")[1]["status"] == "True"
        play_kuberay(k8s, "kr", 1, ("True", "NonZeroServeEndpoints", "Number of serve endpoints is greater than 0"),
                     app=app_status("RUNNING", HEALTHY))
        obj, ready = wait_for(reason_is(k8s, "kr", "Serving"), timeout_s=120, what="Ready=True once the app runs")
        st = obj["status"]
        assert ready["status"] == "True" and st["rayService"] == "kr"
        assert st["endpoint"] == "http://kr-serve-svc.default.svc:8000/v1"
        assert [(g["name"], g["readyReplicas"]) for g in st["groups"]] == [("ExpertShard-0", 1), ("ExpertShard-1", 1)]
        assert st["selector"] == "serving.moe.io/moedeployment=kr,ray.io/node-type=worker"
        # every pass above (the retries while not Ready, the observe timer's) read the RayService
        # and wrote nothing, despite the defaults the CRD added
        passes = open(tmp_path / "operator.log").read().count("KubeRay has not observed generation 1")
        assert passes >= 1 and rayservice_writes(k8s) == writes
        assert k8s.kubectl_json("get", "rayservice", "kr")["metadata"]["generation"] == 1

        # the app turns unhealthy while KubeRay's Ready stays True (endpoints alone): not Ready,
        # Degraded names the deployment
        play_kuberay(k8s, "kr", 1, ("True", "NonZeroServeEndpoints", "Number of serve endpoints is greater than 0"),
                     app=app_status("UNHEALTHY", {**HEALTHY, "ExpertShard-0": ("UNHEALTHY", "health check failed")}))
        _, ready = wait_for(reason_is(k8s, "kr", "Unhealthy"), what="Unhealthy")
        degraded = condition(k8s, "kr", "Degraded")[1]
        assert ready["status"] == "False" and degraded["status"] == "True"
        assert degraded["message"] == "ExpertShard-0 UNHEALTHY: health check failed"
        # an upgrade to a new Ray cluster is Progressing, not Ready
        play_kuberay(k8s, "kr", 1, ("True", "NonZeroServeEndpoints", "Number of serve endpoints is greater than 0"),
                     app=app_status("RUNNING", HEALTHY), upgrade=("True", "BothActivePendingClustersExist"),
                     pending={"rayClusterName": "kr-9fz2q", "applicationStatuses": {"default.kr": {"status": "DEPLOYING"}}})
        _, ready = wait_for(reason_is(k8s, "kr", "Upgrading"), what="Upgrading")
        assert "kr-9fz2q" in ready["message"] and condition(k8s, "kr", "Progressing")[1]["reason"] == "Upgrading"
        play_kuberay(k8s, "kr", 1, ("True", "NonZeroServeEndpoints", "Number of serve endpoints is greater than 0"),
                     app=app_status("RUNNING", HEALTHY))
        wait_for(reason_is(k8s, "kr", "Serving"), what="Serving again")
        assert condition(k8s, "kr", "Degraded")[1]["status"] == "False"

        # a spec change re-renders the owned RayService in place (same object, new serveConfigV2)
        uid = rs["metadata"]["uid"]
        k8s.kubectl("patch", "moed", "kr", "--type=merge", "-p", json.dumps({"spec": {"experts": {"groups": 3}}}))

        def three_groups():
            r = k8s.kubectl_json("get", "rayservice", "kr")
            names = [d["name"] for d in yaml.safe_load(r["spec"]["serveConfigV2"])["applications"][0]["deployments"]]
            return r if len(names) == 4 else None

        rs = wait_for(three_groups, what="3 groups in serveConfigV2")
        assert rs["metadata"]["uid"] == uid and rs["metadata"]["generation"] == 2
        # KubeRay's status is still generation 1's, RUNNING with two groups: not Ready
        _, ready = wait_for(reason_is(k8s, "kr", "WaitingForKubeRay"), what="WaitingForKubeRay after the change")
        assert "generation 2" in ready["message"]
        # the in-place update fails (KubeRay's Ready stays True on endpoints): DeployFailed, with Serve's message
        play_kuberay(k8s, "kr", 2, ("True", "NonZeroServeEndpoints", "Number of serve endpoints is greater than 0"),
                     app=app_status("DEPLOY_FAILED", HEALTHY, "Deploying ExpertShard-2 failed: ModuleNotFoundError"))
        _, ready = wait_for(reason_is(k8s, "kr", "DeployFailed"), what="DeployFailed")
        assert "ModuleNotFoundError" in ready["message"]
        # a new (pending) cluster whose replicas raise in their constructor: the exception, not "Upgrading"
        start_failed = ("The deployment failed to start 3 times in a row. This may be due to a problem with its "
                        "constructor or initial health check failing. See controller logs for details. Error:\n"
                        "Traceback (most recent call last):\n  File \"ingress.py\", line 120, in __init__\n"
                        "moe_workers.model.family.CheckpointError: KV cache budget 64 bytes holds 0 blocks")
        pending = app_status("DEPLOY_FAILED", {**HEALTHY, "Ingress": ("DEPLOY_FAILED", start_failed)},
                             "Failed to update the deployments ['Ingress'].")
        play_kuberay(k8s, "kr", 2, ("True", "NonZeroServeEndpoints", "Number of serve endpoints is greater than 0"),
                     app=app_status("RUNNING", HEALTHY), upgrade=("True", "BothActivePendingClustersExist"),
                     pending={**pending, "rayClusterName": "kr-9fz2q"})
        _, ready = wait_for(reason_is(k8s, "kr", "ReplicaStartFailed"), what="ReplicaStartFailed on the pending cluster")
        assert "kr-9fz2q" in ready["message"]
        assert "Ingress: CheckpointError: KV cache budget 64 bytes holds 0 blocks" in ready["message"]
        # KubeRay gives up (its initializing timeout): reported as terminal
        play_kuberay(k8s, "kr", 2, ("False", "InitializingTimeout", "RayService failed to become ready within the "
                                    "configured timeout of 10m0s"))
        _, ready = wait_for(lambda: (r := condition(k8s, "kr"))[1] and "InitializingTimeout" in r[1]["message"] and r,
                            what="the terminal timeout")
        assert ready["reason"] == "DeployFailed" and "change the MoEDeployment" in ready["message"]
        assert k8s.kubectl_json("get", "rayservice", "kr")["metadata"]["generation"] == 2

        # names KubeRay refuses are refused here first
        for bad in ("kr.v2", "k" * 48):  # refused by the CRD's root CEL rule, naming the limit
            proc = k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest(bad, model)), check=False)
            assert proc.returncode != 0 and "KubeRay requires to be a DNS-1035 label" in proc.stderr, proc.stderr
            assert "at most 47 characters" in proc.stderr
            assert k8s.kubectl("get", "moed", bad, check=False).returncode != 0

        # a RayService of the same name that someone else owns is not taken over
        k8s.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "ray.io/v1", "kind": "RayService",
                                                           "metadata": {"name": "taken"}, "spec": MINIMAL_SPEC}))
        k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest("taken", model)))
        _, bad = wait_for(lambda: (r := condition(k8s, "taken"))[1] and r, what="taken: a Ready condition")
        assert bad["status"] == "False" and bad["reason"] == "DeployFailed" and "not owned by this MoEDeployment" in bad["message"]
        assert "serveConfigV2" not in k8s.kubectl_json("get", "rayservice", "taken")["spec"]

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
