"""Generate the MoEDeployment CustomResourceDefinition from the pydantic models.

    python -m moe_operator.api.crd > crds/moedeployments.serving.moe.io.yaml

Pydantic writes JSON Schema 2020-12; the apiserver wants a *structural* OpenAPI v3 schema
(every node typed, no $ref, nullable instead of anyOf-with-null, boolean exclusiveMinimum).
`to_structural` does that translation; everything else (descriptions, enums, ranges, patterns,
defaults) comes straight from the models, so the CRD and the operator cannot disagree.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from . import models
from moe_operator.render.rayservice import DNS1035_LABEL, MAX_RAYSERVICE_NAME

def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        target.update(siblings)  # a field's own description wins over the class docstring
        return _resolve(target, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: Any) -> Any:
    if isinstance(node, list):
        return [_structural(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    # Optional[X]: anyOf [X, null] -> X (absence is how Kubernetes says "unset")
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) == 1:
            siblings = {k: v for k, v in node.items() if k != "anyOf"}
            node = {**options[0], **siblings}
        elif all(o.get("type") in ("number", "integer") for o in options):
            node.pop("anyOf")
            node["type"] = "number"
    if isinstance(node.get("description"), str):
        node["description"] = " ".join(node["description"].split())
    if node.get("default", 0) in (None, ""):  # apiserver v1.20 stores "" as null and refuses it
        node.pop("default")
    for key in ("title", "examples"):
        node.pop(key, None)
    if node.get("additionalProperties") is False:
        node.pop("additionalProperties")
    if node.get("additionalProperties") is True:  # dict[str, Any]: a Kubernetes object passed through as written
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if bound in node and not isinstance(node[bound], bool):
            node["minimum" if bound == "exclusiveMinimum" else "maximum"] = node[bound]
            node[bound] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    if node.get("type") == "object" and "properties" not in node and "additionalProperties" not in node:
        node["x-kubernetes-preserve-unknown-fields"] = True
    return {k: _structural(v) for k, v in node.items()}


def to_structural(model: type) -> dict[str, Any]:
    """A pydantic model as a structural OpenAPI v3 schema for a CRD."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs = schema.pop("$defs", {})
    return _structural(_resolve(schema, defs))


def _without_defaults(node: Any) -> Any:
    if isinstance(node, list):
        return [_without_defaults(n) for n in node]
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    return node


def build_crd() -> dict[str, Any]:
    spec_schema = to_structural(models.MoEDeploymentSpec)
    # status is written by the operator only: defaulting it on the server would hide omissions
    status_schema = _without_defaults(to_structural(models.MoEDeploymentStatus))
    status_schema["description"] = "Observed state, written by the operator."
    root = {
        "type": "object",
        "description": "MoEDeployment serves a Mixture-of-Experts model on Ray Serve: an Ingress "
        "deployment runs the dense part and routes tokens to ExpertShard deployments that each "
        "host a subset of the experts, kept in hot/warm/cold tiers, hot-swappable one by one.",
        "required": ["spec"],
        "x-kubernetes-validations": [{
            # the one rule that needs metadata: CEL at the root may read metadata.name
            "rule": f"!has(self.spec.ray) || !has(self.spec.ray.mode) || self.spec.ray.mode != 'KubeRay' || "
                    f"(size(self.metadata.name) <= {MAX_RAYSERVICE_NAME} && "
                    f"self.metadata.name.matches('{DNS1035_LABEL.pattern}'))",
            "message": f"metadata.name: with ray.mode KubeRay the name becomes the RayService's, which KubeRay "
                       f"requires to be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter) "
                       f"of at most {MAX_RAYSERVICE_NAME} characters",
        }],
        "properties": {
            "apiVersion": {"type": "string", "description": "serving.moe.io/v1alpha1"},
            "kind": {"type": "string", "description": "MoEDeployment"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{models.PLURAL}.{models.GROUP}",
            "labels": {"app.kubernetes.io/name": "moe-operator", "app.kubernetes.io/part-of": "moe-operator"},
        },
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": list(models.SHORT_NAMES),
                "categories": ["all", "moe"],
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.experts.replicasPerGroup",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                        {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason', "priority": 1},
                        {"name": "Groups", "type": "integer", "jsonPath": ".spec.experts.groups"},
                        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas",
                         "description": "Ready replicas per shard group"},
                        {"name": "Desired", "type": "integer", "jsonPath": ".spec.experts.replicasPerGroup", "priority": 1},
                        {"name": "Imbalance", "type": "number", "jsonPath": ".status.imbalance",
                         "description": "max/mean shard-group load"},
                        {"name": "Autoscaling", "type": "string", "jsonPath": ".status.autoscaling.phase", "priority": 1,
                         "description": "Steady, or the phase of a placement change"},
                        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


HEADER = "# Generated by `python -m moe_operator.api.crd` from moe_operator/api/models.py. Do not edit.\n"


def render_crd_yaml() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render_crd_yaml())
