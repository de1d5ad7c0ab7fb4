"""The Helm chart: lint, rendered objects for representative values, install/upgrade/uninstall on
the real apiserver, and its RBAC: the operator run out of cluster with the chart's ServiceAccount
token reconciles a MoEDeployment, and that ServiceAccount is refused everything else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from waiting import wait_for

pytestmark = pytest.mark.k8s
REPO = Path(__file__).resolve().parents[2]
CHART = str(REPO / "helm" / "moe-operator")
KOPF = str(Path(sys.executable).with_name("kopf"))


def render(k8s, *sets: str) -> list[dict]:
    args = ["template", "rel", CHART, "--namespace", "moe-system"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(k8s.helm(*args).stdout) if d]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def test_lint(k8s):
    r = k8s.helm("lint", CHART, "--strict")
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout


def test_chart_crd_is_the_generated_one():
    assert (REPO / "helm/moe-operator/crds/moedeployments.serving.moe.io.yaml").read_text() == \
        (REPO / "crds/moedeployments.serving.moe.io.yaml").read_text()


def test_default_render_least_privilege_cluster_wide(k8s):
    docs = render(k8s)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Service", "ServiceAccount", "StatefulSet"]
    rules = by_kind(docs, "ClusterRole")[0]["rules"]
    assert {(tuple(r["apiGroups"]), tuple(r["resources"])) for r in rules} == {
        (("serving.moe.io",), ("moedeployments",)), (("serving.moe.io",), ("moedeployments/status",)),
        (("",), ("events",)), (("events.k8s.io",), ("events",))}
    assert all("*" not in r["verbs"] and "delete" not in r["verbs"] for r in rules)
    sts = by_kind(docs, "StatefulSet")[0]
    labels = sts["metadata"]["labels"]
    for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                "app.kubernetes.io/managed-by", "helm.sh/chart"):
        assert key in labels
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "ghcr.io/moe-operator/moe-operator:0.1.0"
    assert "--all-namespaces" in c["args"][0] and "--standalone" in c["args"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["MOE_ALLOWED_ROOTS"] == "/models" and env["MOE_METRICS_HOST"] == "0.0.0.0"
    assert env["MOE_SERVE_HTTP_HOST"] == "0.0.0.0"  # Ray in Pods: the proxy must answer its Service
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_namespaced_kuberay_ha_render(k8s):
    docs = render(k8s, "watchNamespaces={team-a,team-b}", "kuberay.enabled=true", "replicas=3",
                  "ray.tokenSecret=ray-token", "metrics.serviceMonitor.enabled=true", "grafanaDashboard.enabled=true",
                  "image.tag=1.2.3")
    assert not by_kind(docs, "ClusterRole")
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    resources = {res for r in roles[0]["rules"] for res in r["resources"]}
    assert {"rayservices", "kopfpeerings"} <= resources and "secrets" not in resources
    assert sorted(p["metadata"]["namespace"] for p in by_kind(docs, "KopfPeering")) == ["team-a", "team-b"]
    sts = by_kind(docs, "StatefulSet")[0]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert sts["spec"]["replicas"] == 3 and c["image"].endswith(":1.2.3")
    assert "--namespace=team-a --namespace=team-b" in c["args"][0]
    assert "--peering=rel-moe-operator --priority=$((100 - ${HOSTNAME##*-}))" in c["args"][0]
    assert {"name": "MOE_RAY_TOKEN_FILE", "value": "/var/run/secrets/moe-operator/ray/token"} in c["env"]
    assert by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["port"] == "metrics"
    dash = by_kind(docs, "ConfigMap")[0]
    panels = json.loads(dash["data"]["moe-operator.json"])["panels"]
    assert any("ray_moe_expert_tokens" in t["expr"] for p in panels for t in p["targets"])
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    assert "ray_moe_time_to_first_token_seconds_bucket" in exprs and "ray_moe_inter_token_latency_seconds_bucket" in exprs
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_routing_alerts_are_off_by_default_and_render_when_enabled(k8s):
    assert not by_kind(render(k8s), "PrometheusRule")
    [rule] = by_kind(render(k8s, "prometheusRule.enabled=true", "prometheusRule.entropyFloor=0.3",
                            "prometheusRule.labels.release=kps"), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "kps"
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert rules["MoERoutingAnomaly"]["expr"].endswith("(ray_moe_routing_anomaly) == 1")
    assert rules["MoERoutingEntropyLow"]["expr"].endswith("(ray_moe_routing_entropy) < 0.3")
    # Prometheus' own templates reach the rule as written, not expanded by helm
    assert "{{ $labels.key }}" in rules["MoERoutingAnomaly"]["annotations"]["description"]


def test_metrics_off_and_secret_reading_opt_in(k8s):
    docs = render(k8s, "metrics.enabled=false", "readTokenSecrets=true")
    assert not by_kind(docs, "Service")
    rules = by_kind(docs, "ClusterRole")[0]["rules"]
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]} in rules


@pytest.mark.parametrize("value,needle", [
    ("replicas=0", "/replicas"),
    ("allowedRoots={models}", "'models' does not match pattern '^/'"),
    ("ray.address=ray-head:8265", "/ray/address"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("metrics.port=80", "/metrics/port"),
    ("frobnicate=1", "frobnicate"),
    ("prometheusRule.entropyFloor=2", "/prometheusRule/entropyFloor"),
])
def test_bad_values_fail_with_a_message(k8s, value, needle):
    r = k8s.helm("template", "rel", CHART, "--set", value, check=False)
    assert r.returncode != 0 and needle in r.stderr, r.stderr


def test_install_upgrade_uninstall_and_rbac(k8s, tmp_path):
    ns = "moe-system"
    k8s.kubectl("create", "namespace", ns)
    try:
        # helm 4 applies the chart's CRDs server-side: the MoEDeployment CRD kubectl applied before (other tests
        # of this session, or a user's `kubectl apply -f crds/`) has kubectl's field manager, and helm stops on
        # the conflict unless told to take the fields over (the docs say so)
        pre = k8s.kubectl("get", "crd", "moedeployments.serving.moe.io", check=False).returncode == 0
        k8s.helm("install", "moe", CHART, "--namespace", ns, "--set", "allowedRoots={" + str(tmp_path) + "}",
                 *(["--force-conflicts"] if pre else []))
        sts = k8s.kubectl_json("get", "statefulset", "moe-moe-operator", "-n", ns)
        assert sts["spec"]["replicas"] == 1
        assert k8s.kubectl("get", "crd", "moedeployments.serving.moe.io").returncode == 0
        k8s.helm("upgrade", "moe", CHART, "--namespace", ns, "--reuse-values", "--set", "replicas=2")
        assert k8s.kubectl_json("get", "statefulset", "moe-moe-operator", "-n", ns)["spec"]["replicas"] == 2
        assert k8s.kubectl("get", "clusterkopfpeering", "moe-moe-operator").returncode == 0
        k8s.helm("upgrade", "moe", CHART, "--namespace", ns, "--reuse-values", "--set", "replicas=1")

        # the ServiceAccount's own token (TokenRequest), as an in-cluster Pod would have it
        token = k8s.kubectl("create", "token", "moe-moe-operator", "-n", ns).stdout.strip()
        sa_kubeconfig = tmp_path / "sa-kubeconfig"
        sa_kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "sa",
            "clusters": [{"name": "c", "cluster": yaml.safe_load(k8s.kubeconfig.read_text())["clusters"][0]["cluster"]}],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa", "namespace": "default"}}]}))

        def can_i(*args):
            return k8s.kubectl("auth", "can-i", *args, check=False, kubeconfig=sa_kubeconfig).stdout.strip()

        assert can_i("patch", "moedeployments.serving.moe.io", "-A") == "yes"
        assert can_i("patch", "moedeployments.serving.moe.io", "--subresource=status", "-A") == "yes"
        assert can_i("create", "events", "-n", "default") == "yes"
        for refused in (["get", "secrets", "-n", ns], ["list", "secrets", "-A"], ["create", "pods/exec", "-n", "default"],
                        ["delete", "moedeployments.serving.moe.io", "-A"], ["create", "rayservices.ray.io", "-A"],
                        ["list", "customresourcedefinitions"], ["create", "clusterrolebindings"],
                        ["get", "configmaps", "-n", ns], ["create", "pods", "-n", "default"]):
            assert can_i(*refused) == "no", refused

        # the operator with exactly that identity reconciles a MoEDeployment (render-only Ray side)
        model = tmp_path / "m"
        from moe_workers.model.random_init import write_random_mixtral

        write_random_mixtral(model, num_layers=2, num_experts=4, hidden_size=32, intermediate_size=64)
        env = {**os.environ, "KUBECONFIG": str(sa_kubeconfig), "MOE_ALLOWED_ROOTS": str(tmp_path),
               "MOE_RAY_BACKEND": "render-only", "MOE_RENDER_ONLY_DIR": str(tmp_path / "render")}
        log = open(tmp_path / "operator.log", "w+")
        op = subprocess.Popen([KOPF, "run", "--standalone", "--all-namespaces", "-m", "moe_operator.handlers.operator"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            k8s.kubectl("apply", "-f", "-", input=json.dumps({
                "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "rbac"},
                "spec": {"model": {"path": str(model)}, "experts": {"groups": 2, "tiers": {
                    "hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}}}))

            def ready():
                st = k8s.kubectl_json("get", "moed", "rbac").get("status") or {}
                return next((c for c in st.get("conditions", []) if c["type"] == "Ready" and c["status"] == "True"), None)

            wait_for(ready, timeout_s=120, what="Ready with the chart's RBAC")
            events = k8s.kubectl_json("get", "events", "--field-selector", "involvedObject.name=rbac")["items"]
            assert any(e["reason"] == "Serving" for e in events)
            k8s.kubectl("delete", "moed", "rbac", "--wait=true", "--timeout=60s")
            # a Secret the chart does not let the operator read: a condition that names the Helm value
            k8s.kubectl("apply", "-f", "-", input=json.dumps({
                "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "keys"},
                "spec": {"model": {"path": str(model)}, "ingress": {"apiKeySecretRef": {"name": "k", "key": "keys"}},
                         "experts": {"groups": 2, "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}}}))

            def refused():
                st = k8s.kubectl_json("get", "moed", "keys").get("status") or {}
                return next((c for c in st.get("conditions", []) if c["type"] == "Ready"
                             and c["reason"] == "SecretUnavailable"), None)

            c = wait_for(refused, timeout_s=60, what="SecretUnavailable without RBAC on Secrets")
            assert c["status"] == "False" and "not readable by the operator (Helm value readTokenSecrets)" in c["message"]
            k8s.kubectl("delete", "moed", "keys", "--wait=true", "--timeout=60s")
            log.seek(0)
            forbidden = [l for l in log.read().splitlines() if "Forbidden" in l or "forbidden" in l]
            assert not forbidden, forbidden[:3]
        finally:
            os.killpg(op.pid, signal.SIGTERM)
            op.wait(timeout=60)
        k8s.helm("uninstall", "moe", "--namespace", ns)
        left = k8s.kubectl("get", "statefulset,serviceaccount,service", "-n", ns, "-l",
                           "app.kubernetes.io/instance=moe", "-o", "name").stdout.strip()
        assert left == ""
        assert k8s.kubectl("get", "clusterrole", "moe-moe-operator", check=False).returncode != 0
        assert k8s.kubectl("get", "crd", "moedeployments.serving.moe.io").returncode == 0  # Helm keeps CRDs
    finally:
        k8s.helm("uninstall", "moe", "--namespace", ns, check=False)
        k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)
