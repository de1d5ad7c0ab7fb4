"""ray.mode KubeRay against the real KubeRay controller, everything in Pods on a real node (Kubernetes
1.35, containerd 2): KubeRay 1.5's CRDs and operator Deployment built from its module -> `helm install`
our operator -> `kubectl apply` a MoEDeployment with mode KubeRay -> our RayService -> KubeRay's
RayCluster -> head and worker Pods running our Ray image, the workers in two labelled groups with a
shard group pinned to each -> completions through the RayService's serve Service equal to the
in-process model -> moectl hot-swap -> a change that needs a new Ray cluster (the head's memory),
rolled out by KubeRay's NewCluster upgrade under 2 clients with no failed request, the status we
report at each phase read from what KubeRay wrote -> a RayService KubeRay refuses: its reason in our
status -> delete: KubeRay's cluster gone with it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from safetensors.torch import save_file

from kuberay_operator import NAME as KUBERAY, NAMESPACE as KUBERAY_NS, as_yaml, crd_files, manifests
from load_clients import Load
from node_cluster import helm_install_args
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.random_init import write_random_mixtral
from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
from moe_workers.store.versions import file_sha256
from waiting import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.node]
MOECTL = str(Path(sys.executable).with_name("moectl"))
NS = "moe-system"
NAME = "kr"
APP = f"default.{NAME}"  # our application's name in Serve (NAMESPACE.NAME)


def moedeployment(head_memory: str = "1536Mi") -> dict:
    """Two worker groups of one Pod each, labelled pool=a / pool=b, a shard group pinned to each; the
    model from the node's disk at /models (read-only), as a user would mount a volume of checkpoints."""
    return {
        "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": NAME},
        "spec": {
            "model": {"path": "/models/tiny"},
            "ray": {"mode": "KubeRay",
                    "kubeRay": {"image": IMAGE["ray"], "headCpu": "150m", "headMemory": head_memory,
                                # two clusters side by side during an upgrade fit the node's 2 CPUs
                                "workerCpu": "350m", "workerMemory": "2560Mi",
                                "workerGroups": [{"name": "pool-a", "labels": {"pool": "a"}},
                                                 {"name": "pool-b", "labels": {"pool": "b"}}],
                                "volumes": [{"name": "models", "hostPath": {"path": IMAGE["models"]}}],
                                "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}]}},
            "ingress": {"numCpus": 0.25, "kvCacheBudget": "16Mi", "routePrefix": f"/{NAME}",
                        "rayNodeLabels": {"pool": "a"}},
            "experts": {"groups": 2, "numCpus": 0.25, "warmSpares": 0,
                        "groupNodes": [{"groups": [0], "rayNodeLabels": {"pool": "a"}},
                                       {"groups": [1], "rayNodeLabels": {"pool": "b"}}],
                        "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"},
                                  "cold": {"path": "/tmp/moe-experts"}}},
        },
    }


IMAGE: dict[str, str] = {}


def _status(k8s) -> tuple[dict, dict]:
    obj = k8s.kubectl_json("get", "moed", NAME)
    st = obj.get("status") or {}
    return st, {c["type"]: c for c in st.get("conditions") or []}


def _rayservice(k8s) -> dict:
    return k8s.kubectl_json("get", "rayservice", NAME)


def _dump(k8s) -> str:
    out = [k8s.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout,
           k8s.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-3000:],
           k8s.kubectl("get", "rayservice", NAME, "-o", "jsonpath={.status}", check=False).stdout[-3000:],
           k8s.kubectl("get", "moed", NAME, "-o", "jsonpath={.status.conditions}", check=False).stdout,
           k8s.kubectl("-n", KUBERAY_NS, "logs", f"deploy/{KUBERAY}", "--tail=30", check=False).stdout[-3000:],
           k8s.kubectl("-n", NS, "logs", "statefulset/rel-moe-operator", "--tail=60", check=False).stdout[-3000:]]
    return "\n".join(out)


def _serve_ip(k8s) -> str:
    return k8s.kubectl("get", "svc", f"{NAME}-serve-svc", "-o", "jsonpath={.spec.clusterIP}").stdout


def _moectl(k8s, *args):
    return subprocess.run([MOECTL, *args], env=k8s.env, capture_output=True, text=True, timeout=400)


def test_kuberay_controller_serves_swaps_and_upgrades(k8s_node, tmp_path, record_property):
    k8s = k8s_node
    models = tmp_path / "models"
    model = write_random_mixtral(models / "tiny", num_layers=2, num_experts=4, hidden_size=32,
                                 intermediate_size=64, vocab_size=BYTE_VOCAB_SIZE, router_scale=10,
                                 max_position_embeddings=1024)
    write_byte_tokenizer(model)
    tmp_path.chmod(0o755)
    models.chmod(0o755)
    IMAGE.update(ray=k8s.ray_image, models=str(models))
    reference = InProcessModel(model)
    kuberay_dir = k8s.kuberay_dir

    try:
        k8s.helm(*helm_install_args(k8s.operator_image, "127.0.0.1", models, NS), "--set", "kuberay.enabled=true",
                 "--wait", "--timeout", "180s")
        # KubeRay not installed: Ready=False naming what is missing
        k8s.kubectl("apply", "-f", "-", input=json.dumps(moedeployment()))
        wait_for(lambda: "RayService CRD (ray.io/v1) is not installed" in
                 _status(k8s)[1].get("Ready", {}).get("message", ""), timeout_s=60, what="the missing CRD named")

        # KubeRay as its module ships it: CRDs (server-side: too large for the last-applied annotation); with
        # no controller yet, we say KubeRay has not looked at the RayService
        for f in crd_files(kuberay_dir):
            k8s.kubectl("apply", "--server-side", "-f", str(f))
        wait_for(lambda: _status(k8s)[1].get("Ready", {}).get("reason") == "WaitingForKubeRay", timeout_s=120,
                 what="WaitingForKubeRay while no controller runs")
        # (token auth, spec.ray.authTokenSecretRef, needs a KubeRay whose CRD has authOptions, which 1.5.0's has
        # not: the operator refuses to write such a RayService; tests/e2e/test_kuberay.py checks it)
        # its RBAC and the operator as a Deployment
        k8s.kubectl("apply", "-f", "-", input=as_yaml(manifests(kuberay_dir, k8s.kuberay_image)))
        k8s.kubectl("-n", KUBERAY_NS, "rollout", "status", f"deploy/{KUBERAY}", "--timeout=120s")

        # what we report while KubeRay brings the cluster up, then Ready from KubeRay's own status
        t0, seen = time.monotonic(), []

        def ready():
            st, conds = _status(k8s)
            if "Ready" in conds and (not seen or seen[-1] != conds["Ready"]["reason"]):
                seen.append(conds["Ready"]["reason"])
            return conds.get("Ready", {}).get("status") == "True" and (st, conds)
        try:
            st, conds = wait_for(ready, timeout_s=900, interval_s=2, what="MoEDeployment Ready=True")
        except AssertionError:
            raise AssertionError(f"not Ready (reasons seen: {seen})\n{_dump(k8s)}")
        figures = {"ready_s": round(time.monotonic() - t0)}
        assert conds["Ready"]["reason"] == "Serving"
        # KubeRay brings a first cluster up as its pending one: a deploy, never read as an upgrade
        assert "Deploying" in seen and "Upgrading" not in seen, seen
        rs = _rayservice(k8s)
        ks_ready = next(c for c in rs["status"]["conditions"] if c["type"] == "Ready")
        assert ks_ready["status"] == "True", rs["status"]  # KubeRay's own verdict agrees
        cluster = rs["status"]["activeServiceStatus"]["rayClusterName"]
        rc = k8s.kubectl_json("get", "raycluster", cluster)
        groups = {g["groupName"]: g.get("labels") for g in rc["spec"]["workerGroupSpecs"]}
        assert groups == {"pool-a": {"pool": "a"}, "pool-b": {"pool": "b"}}
        pods = k8s.kubectl_json("get", "pods", "-l", f"ray.io/cluster={cluster}")["items"]
        assert sorted(p["metadata"]["labels"]["ray.io/node-type"] for p in pods) == ["head", "worker", "worker"]
        assert {p["spec"]["containers"][0]["image"] for p in pods} == {k8s.ray_image}

        serve = f"http://{_serve_ip(k8s)}:8000/{NAME}"
        prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]

        def tokens(p, url=serve):
            r = requests.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 5, "temperature": 0},
                              timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        want_old = [reference.generate([p], 5, stop_at_eos=True)[0] for p in prompts]
        assert [tokens(p) for p in prompts] == want_old

        # hot-swap through the operator, on the KubeRay cluster's replicas
        new = {w: (t * 40).contiguous() for w, t in reference.experts.weights[(1, 1)].items()}
        (models / "weights").mkdir()
        f = models / "weights" / "e-1.1.safetensors"
        save_file({f"{w}.weight": t for w, t in new.items()}, str(f))
        f.chmod(0o644)
        swapped = InProcessModel(model)
        swapped.experts.weights[(1, 1)] = new
        want_new = [swapped.generate([p], 5, stop_at_eos=True)[0] for p in prompts]
        assert want_new != want_old
        r = _moectl(k8s, "hot-swap", NAME, "--expert", "1.1", "--weights", "/models/weights/e-1.1.safetensors",
                    "--sha256", file_sha256(f), "--wait", "--timeout", "300")
        assert r.returncode == 0, (r.stdout, r.stderr, _dump(k8s))
        assert [tokens(p) for p in prompts] == want_new

        # a change that needs a new Ray cluster, under 2 clients: KubeRay's NewCluster upgrade
        phases, t1 = [], time.monotonic()
        with Load(serve, clients=2) as load:
            k8s.kubectl("apply", "-f", "-", input=json.dumps(moedeployment(head_memory="1600Mi")))

            def upgraded():
                st, conds = _status(k8s)
                rs = _rayservice(k8s)
                up = next((c for c in (rs.get("status") or {}).get("conditions") or []
                           if c["type"] == "UpgradeInProgress"), {})
                phases.append((conds.get("Ready", {}).get("reason"), up.get("status")))
                active = ((rs.get("status") or {}).get("activeServiceStatus") or {}).get("rayClusterName")
                return (active not in (None, cluster) and conds.get("Ready", {}).get("status") == "True"
                        and st.get("observedGeneration") == k8s.kubectl_json("get", "moed", NAME)["metadata"]["generation"])
            try:
                wait_for(upgraded, timeout_s=900, interval_s=2, what="the new Ray cluster serving")
            except AssertionError:
                raise AssertionError(f"upgrade did not finish (phases {sorted(set(phases))})\n{_dump(k8s)}")
            time.sleep(3)
        figures.update(upgrade_s=round(time.monotonic() - t1), upgrade_ok=load.ok, upgrade_failed=load.failed)
        record_property("figures", json.dumps(figures))
        print(f"kuberay e2e: {figures}")
        assert load.failed == 0, (load.ok, load.errors[:5])
        assert load.ok > 0
        # while KubeRay prepared the new cluster, we said so (its UpgradeInProgress=True, our Upgrading)
        assert ("Upgrading", "True") in phases, sorted(set(phases))
        new_cluster = _rayservice(k8s)["status"]["activeServiceStatus"]["rayClusterName"]
        assert new_cluster != cluster
        head = k8s.kubectl_json("get", "pods", "-l", f"ray.io/cluster={new_cluster},ray.io/node-type=head")["items"][0]
        assert head["spec"]["containers"][0]["resources"]["limits"]["memory"] == "1600Mi"
        # the new cluster loads the checkpoint and the swapped expert again: the spec's override is the truth
        assert [tokens(p) for p in prompts] == want_new


        # delete: the RayService goes with the MoEDeployment, and KubeRay takes its clusters down
        k8s.kubectl("delete", "moed", NAME, "--wait=true", "--timeout=120s")
        wait_for(lambda: not k8s.kubectl_json("get", "rayservice")["items"]
                 and not k8s.kubectl_json("get", "raycluster")["items"], timeout_s=180, what="RayService and clusters gone")
    finally:
        k8s.kubectl("delete", "moed", NAME, "--ignore-not-found", "--wait=true", "--timeout=120s", check=False)
        k8s.helm("uninstall", "rel", "--namespace", NS, check=False)
