"""MoEDeployment -> KubeRay RayService (ray.io/v1) owned by it (pure; no cluster).

The rendered Serve application goes into `serveConfigV2` as YAML, exactly as the Ray REST
backend would PUT it, so both backends serve the same thing.
"""

from __future__ import annotations

import yaml

from moe_operator.api import models
from moe_operator.api.models import MoEDeploymentSpec

RAYSERVICE_API_VERSION = "ray.io/v1"
MANAGED_BY = "moe-operator"


def _resources(cpu, memory, gpus: int) -> dict:
    limits = {"cpu": str(cpu), "memory": str(memory)}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(limits), "limits": limits}


def render_rayservice(namespace: str, name: str, uid: str, spec: MoEDeploymentSpec, application: dict,
                      http_port: int = 8000) -> dict:
    """The RayService for this MoEDeployment, owned by it (garbage-collected with it)."""
    if spec.ray.mode != "KubeRay" or spec.ray.kube_ray is None:
        raise ValueError("render_rayservice needs spec.ray.mode KubeRay with spec.ray.kubeRay set")
    kr = spec.ray.kube_ray
    labels = {"app.kubernetes.io/name": "moe-deployment", "app.kubernetes.io/instance": name,
              "app.kubernetes.io/managed-by": MANAGED_BY, f"{models.GROUP}/moedeployment": name}
    container = {"name": "ray", "image": kr.image, "imagePullPolicy": "IfNotPresent"}
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},  # the head schedules no replicas
        "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
            **container, "resources": _resources(2, "8Gi", 0),
            "ports": [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                      {"containerPort": http_port, "name": "serve"}]}]}},
    }
    workers = {
        "groupName": "experts",
        "replicas": kr.worker_replicas, "minReplicas": kr.worker_replicas, "maxReplicas": kr.worker_replicas,
        "rayStartParams": {},
        "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
            **container, "resources": _resources(kr.worker_cpu, kr.worker_memory, kr.worker_gpus)}]}},
    }
    serve_config = {"http_options": {"host": "0.0.0.0", "port": http_port}, "applications": [application]}
    return {
        "apiVersion": RAYSERVICE_API_VERSION,
        "kind": "RayService",
        "metadata": {
            "name": name, "namespace": namespace, "labels": labels,
            "ownerReferences": [{"apiVersion": models.API_VERSION, "kind": models.KIND, "name": name, "uid": uid,
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
            "rayClusterConfig": {"rayVersion": kr.ray_version, "headGroupSpec": head, "workerGroupSpecs": [workers]},
        },
    }


def rayservice_ready(rayservice: dict) -> tuple[bool, str]:
    """(serving, why) from a RayService's status, for the MoEDeployment's Ready condition."""
    status = rayservice.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True", c.get("message") or c.get("reason") or ""
    service = status.get("serviceStatus")
    if service:
        return service == "Running", f"RayService serviceStatus {service}"
    return False, "RayService has no status yet"
