"""KubeRay's operator in a test node cluster, installed as its own manifests would: its CRDs and
ClusterRole as the ray-operator module ships them (config/crd, config/rbac, copied into the cache
by scripts/testenv), a ServiceAccount bound to that role, and a Deployment running the
ray-operator binary built from the same module (the image scripts/testenv builds)."""

from __future__ import annotations

from pathlib import Path

import yaml

NAMESPACE = "kuberay-system"
NAME = "kuberay-operator"


def crd_files(kuberay_dir: Path) -> list[Path]:
    return sorted((kuberay_dir / "crd").glob("*.yaml"))


def manifests(kuberay_dir: Path, image: str) -> list[dict]:
    role = yaml.safe_load((kuberay_dir / "rbac" / "role.yaml").read_text())
    labels = {"app.kubernetes.io/name": NAME}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, "namespace": NAMESPACE}},
        role,
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": NAME},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "serviceAccountName": NAME, "terminationGracePeriodSeconds": 1,
                      "containers": [{
                          "name": "manager", "image": image, "imagePullPolicy": "Never",
                          # one replica: no leader election (its Lease role is not installed)
                          "args": ["--enable-leader-election=false", "--log-stdout-encoder=console"],
                          "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8082}, "periodSeconds": 2},
                          "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                                        "limits": {"memory": "512Mi"}},
                          "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                              "capabilities": {"drop": ["ALL"]}}}]}}}},
    ]


def as_yaml(docs: list[dict]) -> str:
    return "\n---\n".join(yaml.safe_dump(d) for d in docs)
