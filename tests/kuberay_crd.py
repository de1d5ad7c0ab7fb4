"""A RayService CRD (ray.io/v1) with KubeRay's structure, written by us from KubeRay's published
API (`rayservice_types.go`, `raycluster_types.go`, KubeRay 1.3 and later), for tests that play
KubeRay's part on a real apiserver.

What it keeps of the real one, because the operator's behaviour depends on it:
- a structural schema: unknown fields are pruned, so a field we render that KubeRay does not
  know would vanish (and a pass comparing spec would write forever);
- required fields: `spec.rayClusterConfig`, its `headGroupSpec.template`, a worker group's
  `groupName`, `minReplicas`, `maxReplicas` and `template`, a container's `name`;
- defaults the apiserver fills in: a container port's `protocol: TCP`, a worker group's
  `replicas: 0`, `minReplicas: 0`, `maxReplicas: 2147483647`, `numOfHosts: 1`;
- `authOptions` (`mode` token/disabled, `secretName`);
- the status subresource and its shape: conditions, `observedGeneration`, `serviceStatus`,
  `numServeEndpoints`, and per cluster the Serve applications and their deployments.
The Pod template is reduced to the fields a RayService usually sets (KubeRay embeds the whole
PodTemplateSpec); the CEL rules (`managedBy`, immutable fields) are left out: v1.20 has no CEL.
"""

from __future__ import annotations

STRING = {"type": "string"}
INT = {"type": "integer", "format": "int32"}
STRING_MAP = {"type": "object", "additionalProperties": STRING}
QUANTITIES = {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": True,
                                                          "anyOf": [{"type": "integer"}, {"type": "string"}]}}
OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}

CONTAINER = {"type": "object", "required": ["name"], "properties": {
    "name": STRING, "image": STRING, "imagePullPolicy": STRING,
    "command": {"type": "array", "items": STRING}, "args": {"type": "array", "items": STRING},
    "env": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
        "name": STRING, "value": STRING, "valueFrom": OPEN}}},
    "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"], "properties": {
        "containerPort": INT, "name": STRING, "protocol": {"type": "string", "default": "TCP"}}}},
    "resources": {"type": "object", "properties": {"limits": QUANTITIES, "requests": QUANTITIES}},
    "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["mountPath", "name"], "properties": {
        "mountPath": STRING, "name": STRING, "readOnly": {"type": "boolean"}}}},
}}

POD_TEMPLATE = {"type": "object", "properties": {
    "metadata": {"type": "object", "properties": {"labels": STRING_MAP, "annotations": STRING_MAP}},
    "spec": {"type": "object", "required": ["containers"], "properties": {
        "containers": {"type": "array", "items": CONTAINER},
        "initContainers": {"type": "array", "items": CONTAINER},
        "volumes": {"type": "array", "items": OPEN},
        "nodeSelector": STRING_MAP, "serviceAccountName": STRING,
        "tolerations": {"type": "array", "items": OPEN}, "affinity": OPEN}},
}}

RAY_CLUSTER_SPEC = {"type": "object", "required": ["headGroupSpec"], "properties": {
    "rayVersion": STRING,
    "enableInTreeAutoscaling": {"type": "boolean"},
    "authOptions": {"type": "object", "properties": {
        "mode": {"type": "string", "enum": ["disabled", "token"]}, "secretName": STRING,
        "enableK8sTokenAuth": {"type": "boolean"}}},
    "headGroupSpec": {"type": "object", "required": ["template"], "properties": {
        "rayStartParams": STRING_MAP, "serviceType": STRING, "enableIngress": {"type": "boolean"},
        "template": POD_TEMPLATE}},
    "workerGroupSpecs": {"type": "array", "items": {
        "type": "object", "required": ["groupName", "maxReplicas", "minReplicas", "template"], "properties": {
            "groupName": STRING,
            "replicas": {**INT, "default": 0}, "minReplicas": {**INT, "default": 0},
            "maxReplicas": {**INT, "default": 2147483647}, "numOfHosts": {**INT, "default": 1},
            "rayStartParams": STRING_MAP, "suspend": {"type": "boolean"}, "template": POD_TEMPLATE}}},
}}

SERVICE_STATUS = {"type": "object", "properties": {
    "applicationStatuses": {"type": "object", "additionalProperties": {"type": "object", "properties": {
        "status": STRING, "message": STRING,
        "serveDeploymentStatuses": {"type": "object", "additionalProperties": {"type": "object", "properties": {
            "status": STRING, "message": STRING}}}}}},
    "rayClusterName": STRING, "rayClusterStatus": OPEN, "targetCapacity": INT, "trafficRoutedPercent": INT,
}}

CONDITION = {"type": "object", "required": ["lastTransitionTime", "message", "reason", "status", "type"], "properties": {
    "type": STRING, "status": {"type": "string", "enum": ["True", "False", "Unknown"]}, "reason": STRING,
    "message": STRING, "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
    "lastTransitionTime": {"type": "string", "format": "date-time"}}}

RAYSERVICE_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "rayservices.ray.io"},
    "spec": {"group": "ray.io", "scope": "Namespaced",
             "names": {"kind": "RayService", "plural": "rayservices", "singular": "rayservice",
                       "listKind": "RayServiceList", "categories": ["all"]},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "additionalPrinterColumns": [
                               {"name": "service status", "type": "string", "jsonPath": ".status.serviceStatus"},
                               {"name": "num serve endpoints", "type": "string",
                                "jsonPath": ".status.numServeEndpoints"}],
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "apiVersion": STRING, "kind": STRING, "metadata": {"type": "object"},
                               "spec": {"type": "object", "required": ["rayClusterConfig"], "properties": {
                                   "serveConfigV2": STRING,
                                   "rayClusterConfig": RAY_CLUSTER_SPEC,
                                   "rayClusterDeletionDelaySeconds": {**INT, "minimum": 0},
                                   "serveService": OPEN,
                                   "upgradeStrategy": {"type": "object", "properties": {"type": STRING}},
                                   "excludeHeadPodFromServeSvc": {"type": "boolean"},
                                   "suspend": {"type": "boolean"}}},
                               "status": {"type": "object", "properties": {
                                   "conditions": {"type": "array", "items": CONDITION,
                                                  "x-kubernetes-list-type": "map",
                                                  "x-kubernetes-list-map-keys": ["type"]},
                                   "lastUpdateTime": {"type": "string", "format": "date-time"},
                                   "serviceStatus": STRING,
                                   "activeServiceStatus": SERVICE_STATUS,
                                   "pendingServiceStatus": SERVICE_STATUS,
                                   "numServeEndpoints": INT,
                                   "observedGeneration": {"type": "integer", "format": "int64"}}}}}}}]},
}

# a RayService someone else wrote: the smallest spec the schema accepts
MINIMAL_SPEC = {"rayClusterConfig": {"headGroupSpec": {"template": {"spec": {"containers": [
    {"name": "ray-head", "image": "rayproject/ray:2.60.0"}]}}}}}
