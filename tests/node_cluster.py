"""The Ray cluster of examples/ray-cluster.yaml and the operator's chart values for a test node:
shared by the node e2e test and `bench/control_plane.py --node`."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = str(REPO / "helm" / "moe-operator")


def ray_cluster(models: Path, image: str) -> list[dict]:
    """examples/ray-cluster.yaml with the locally built image and a host directory of models."""
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / "ray-cluster.yaml").read_text()) if d]
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        pod = d["spec"]["template"]["spec"]
        pod["terminationGracePeriodSeconds"] = 1
        for c in pod["containers"]:
            c["image"], c["imagePullPolicy"] = image, "Never"
        for v in pod["volumes"]:
            if v["name"] == "models":
                v["hostPath"]["path"] = str(models)
    return docs


def as_yaml(docs: list[dict]) -> str:
    return "\n---\n".join(yaml.safe_dump(d) for d in docs)


def helm_install_args(operator_image: str, serve_ip: str, models: Path, namespace: str) -> list[str]:
    """`helm install rel CHART ...` with the local operator image, the model volume read-only at
    /models (the allowed root) and the ray-serve Service as the endpoint host."""
    repo, tag = operator_image.rsplit(":", 1)
    sets = [f"image.repository={repo}", f"image.tag={tag}", "image.pullPolicy=Never",
            f"ray.endpointHost={serve_ip}", "terminationGracePeriodSeconds=1",
            "extraVolumes[0].name=models", f"extraVolumes[0].hostPath.path={models}",
            "extraVolumeMounts[0].name=models", "extraVolumeMounts[0].mountPath=/models",
            "extraVolumeMounts[0].readOnly=true"]
    args = ["install", "rel", CHART, "--namespace", namespace, "--create-namespace"]
    for s in sets:
        args += ["--set", s]
    return args


def moedeployment(ray_ip: str, name: str = "tiny", model: str = "/models/tiny") -> dict:
    return {
        "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name},
        "spec": {"model": {"path": model},
                 "ray": {"address": f"http://{ray_ip}:8265"},
                 "ingress": {"numCpus": 0.25, "kvCacheBudget": "16Mi", "routePrefix": f"/{name}"},
                 "experts": {"groups": 2, "numCpus": 0.25,
                             "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"},
                                       "cold": {"path": f"/var/cache/moe-experts/{name}"}}}},
    }
