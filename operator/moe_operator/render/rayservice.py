"""MoEDeployment -> KubeRay RayService (ray.io/v1) owned by it (pure; no cluster).

The rendered Serve application goes into `serveConfigV2` as YAML, exactly as the Ray REST
backend would PUT it, so both backends serve the same thing.
"""

from __future__ import annotations

import hashlib
import json
import re

import yaml

from moe_operator.api import models
from moe_operator.api.models import MoEDeploymentSpec
from moe_operator.names import MANAGED_BY, MOEDEPLOYMENT_LABEL, RENDERED_SPEC_ANNOTATION

RAYSERVICE_API_VERSION = "ray.io/v1"
# KubeRay refuses a RayService whose name is not a DNS-1035 label of at most 47 characters: its
# RayCluster adds 6 characters, and "<cluster>-serve-svc" must still fit in 63
MAX_RAYSERVICE_NAME = 47
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# the Secret key KubeRay reads the Ray token from (rayClusterConfig.authOptions.secretName)
KUBERAY_TOKEN_KEY = "auth_token"


def name_problem(name: str) -> str | None:
    """Why KubeRay would refuse `name` as a RayService name, or None."""
    if len(name) > MAX_RAYSERVICE_NAME:
        return (f"metadata.name: {name!r} is {len(name)} characters; with ray.mode KubeRay the name becomes the "
                f"RayService's, which KubeRay limits to {MAX_RAYSERVICE_NAME}")
    if not DNS1035_LABEL.match(name):
        return (f"metadata.name: {name!r} is not a DNS-1035 label (lower-case letters, digits and '-', starting "
                "with a letter, ending with a letter or digit); with ray.mode KubeRay the name becomes the "
                "RayService's, which KubeRay requires to be one")
    return None


def spec_digest(spec: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _resources(cpu, memory, gpus: int) -> dict:
    limits = {"cpu": str(cpu), "memory": str(memory)}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(limits), "limits": limits}


def _worker_group(kr: models.KubeRayCluster, group: models.KubeRayWorkerGroup, container: dict, pod: dict,
                  pod_labels: dict) -> dict:
    """One workerGroupSpec: a fixed size (the operator scales replicas inside Ray, not Pods), the
    group's Ray node labels as KubeRay 1.5's `labels` (never rayStartParams['labels'], which it refuses)."""
    resources = _resources(group.cpu if group.cpu is not None else kr.worker_cpu,
                           group.memory if group.memory is not None else kr.worker_memory,
                           group.gpus if group.gpus is not None else kr.worker_gpus)
    worker_container = {**container, "resources": resources}
    if kr.allow_realtime:  # the replicas run on the workers (the head schedules none)
        worker_container["securityContext"] = {"capabilities": {"add": ["SYS_NICE"]}}
    out = {"groupName": group.name, "replicas": group.replicas, "minReplicas": group.replicas,
           "maxReplicas": group.replicas, "rayStartParams": {},
           "template": {"metadata": {"labels": pod_labels}, "spec": {**pod, "containers": [worker_container]}}}
    if group.labels:
        out["labels"] = dict(group.labels)
    return out


SERVE_PORT = 8000  # Serve's proxy in the RayService's cluster (the operator's MOE_SERVE_HTTP_PORT is for Existing)


def render_rayservice(namespace: str, name: str, uid: str, spec: MoEDeploymentSpec, application: dict,
                      http_port: int = SERVE_PORT) -> dict:
    """The RayService for this MoEDeployment, owned by it (garbage-collected with it)."""
    if spec.ray.mode != "KubeRay" or spec.ray.kube_ray is None:
        raise ValueError("render_rayservice needs spec.ray.mode KubeRay with spec.ray.kubeRay set")
    kr = spec.ray.kube_ray
    labels = {"app.kubernetes.io/name": "moe-deployment", "app.kubernetes.io/instance": name,
              "app.kubernetes.io/managed-by": MANAGED_BY, MOEDEPLOYMENT_LABEL: name}
    container = {"name": "ray", "image": kr.image, "imagePullPolicy": "IfNotPresent"}
    if kr.volume_mounts:
        container["volumeMounts"] = [dict(m) for m in kr.volume_mounts]
    pod = {"volumes": [dict(v) for v in kr.volumes]} if kr.volumes else {}
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},  # the head schedules no replicas
        "template": {"metadata": {"labels": labels}, "spec": {**pod, "containers": [{
            **container, "resources": _resources(kr.head_cpu, kr.head_memory, 0),
            "ports": [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                      {"containerPort": http_port, "name": "serve"}]}]}},
    }
    groups = kr.worker_groups or [models.KubeRayWorkerGroup(name="experts", replicas=kr.worker_replicas)]
    workers = [_worker_group(kr, g, container, pod, labels) for g in groups]
    serve_config = {"http_options": {"host": "0.0.0.0", "port": http_port}, "applications": [application]}
    cluster = {"rayVersion": kr.ray_version, "headGroupSpec": head, "workerGroupSpecs": workers}
    if spec.ray.auth_token_secret_ref is not None:  # Ray token auth on every Pod, from the user's Secret
        cluster["authOptions"] = {"mode": "token", "secretName": spec.ray.auth_token_secret_ref.name}
    rs_spec = {"serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False), "rayClusterConfig": cluster}
    if kr.upgrade_strategy is not None:
        rs_spec["upgradeStrategy"] = {"type": kr.upgrade_strategy}
    return {
        "apiVersion": RAYSERVICE_API_VERSION,
        "kind": "RayService",
        "metadata": {
            "name": name, "namespace": namespace, "labels": labels,
            "annotations": {RENDERED_SPEC_ANNOTATION: spec_digest(rs_spec)},
            "ownerReferences": [{"apiVersion": models.API_VERSION, "kind": models.KIND, "name": name, "uid": uid,
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": rs_spec,
    }
