"""Invalid MoEDeployment manifests, each with the field its error must name.

Used twice: the real apiserver must reject each one through the CRD schema (tests/e2e), and the
operator's own parser must reject the same ones (tests/unit), so neither path lets them through.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

VALID: dict[str, Any] = {
    "apiVersion": "serving.moe.io/v1alpha1",
    "kind": "MoEDeployment",
    "metadata": {"name": "invalid-case"},
    "spec": {
        "model": {"path": "/models/mixtral-tiny"},
        "experts": {
            "groups": 2,
            "tiers": {"hot": {"budget": "256Mi"}, "warm": {"budget": "1Gi"}},
            "overrides": [{"expert": "1.3", "weights": {"path": "/models/patch.safetensors"}}],
        },
    },
}


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def apply(doc: dict) -> None:
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list) and int(last) == len(node):
            node.append(value)
        else:
            node[int(last) if last.isdigit() else last] = value
    return apply


_DELETE = object()

# (case id, mutation, field path the error must name); list-level rules (a duplicate entry) are
# reported by the apiserver at the entry and by pydantic at the list, so both paths are accepted.
CASES: list[tuple[str, Callable[[dict], None], str]] = [
    ("groups-wrong-type", _set("spec.experts.groups", "four"), "spec.experts.groups"),
    ("groups-zero", _set("spec.experts.groups", 0), "spec.experts.groups"),
    ("groups-too-many", _set("spec.experts.groups", 5000), "spec.experts.groups"),
    ("replicas-negative", _set("spec.experts.replicasPerGroup", -1), "spec.experts.replicasPerGroup"),
    ("autoscaling-mode-unknown", _set("spec.autoscaling.mode", "Sometimes"), "spec.autoscaling.mode"),
    ("tier-policy-unknown", _set("spec.experts.tiers.policy", "FIFO"), "spec.experts.tiers.policy"),
    ("dtype-unknown", _set("spec.model.dtype", "int4"), "spec.model.dtype"),
    ("model-path-missing", _set("spec.model.path", _DELETE), "spec.model.path"),
    ("model-path-relative", _set("spec.model.path", "models/mixtral"), "spec.model.path"),
    ("tiers-missing", _set("spec.experts.tiers", _DELETE), "spec.experts.tiers"),
    ("hot-budget-malformed", _set("spec.experts.tiers.hot.budget", "16GB"), "spec.experts.tiers.hot.budget"),
    ("warm-budget-not-a-quantity", _set("spec.experts.tiers.warm.budget", "lots"), "spec.experts.tiers.warm.budget"),
    ("expert-id-dash", _set("spec.experts.overrides.0.expert", "3-12"), "spec.experts.overrides[0].expert"),
    ("expert-id-three-parts", _set("spec.experts.overrides.0.expert", "3.12.1"), "spec.experts.overrides[0].expert"),
    ("sha256-malformed", _set("spec.experts.overrides.0.weights.sha256", "xyz"), "spec.experts.overrides[0].weights.sha256"),
    ("weights-not-safetensors", _set("spec.experts.overrides.0.weights.path", "/models/patch.bin"), "spec.experts.overrides[0].weights.path"),
    ("imbalance-threshold-below-one", _set("spec.autoscaling.imbalanceThreshold", 0.5), "spec.autoscaling.imbalanceThreshold"),
    ("ingress-cpus-zero", _set("spec.ingress.numCpus", 0), "spec.ingress.numCpus"),
    ("ray-mode-unknown", _set("spec.ray.mode", "Docker"), "spec.ray.mode"),
    ("ray-address-no-scheme", _set("spec.ray.address", "ray-head:8265"), "spec.ray.address"),
    ("prefetch-lookahead-too-far", _set("spec.experts.tiers.prefetch.lookaheadLayers", 99), "spec.experts.tiers.prefetch.lookaheadLayers"),
    # the schema and the parser agree on types and ranges (each was accepted by one of them only)
    ("budget-negative-integer", _set("spec.experts.tiers.hot.budget", -5), "spec.experts.tiers.hot.budget"),
    ("budget-negative-string", _set("spec.experts.tiers.warm.budget", "-1Gi"), "spec.experts.tiers.warm.budget"),
    ("budget-with-spaces", _set("spec.experts.tiers.warm.budget", " 1Gi"), "spec.experts.tiers.warm.budget"),
    ("budget-above-int64", _set("spec.experts.tiers.hot.budget", 2**63), "spec.experts.tiers.hot.budget"),
    ("groups-boolean", _set("spec.experts.groups", True), "spec.experts.groups"),
    ("replicas-boolean", _set("spec.experts.replicasPerGroup", True), "spec.experts.replicasPerGroup"),
    ("pinned-integer", _set("spec.experts.tiers.warm.pinned", 1), "spec.experts.tiers.warm.pinned"),
    ("cpus-string", _set("spec.ingress.numCpus", "2"), "spec.ingress.numCpus"),
    ("model-path-nul", _set("spec.model.path", "/models/a\x00b"), "spec.model.path"),
    ("cold-path-nul", _set("spec.experts.tiers.cold.path", "/cache/\x00"), "spec.experts.tiers.cold.path"),
    ("override-path-nul", _set("spec.experts.overrides.0.weights.path", "/w/\x00.safetensors"),
     "spec.experts.overrides[0].weights.path"),
    ("ingress-autoscaling-target-zero", _set("spec.ingress.autoscaling.targetOngoingRequests", 0),
     "spec.ingress.autoscaling.targetOngoingRequests"),
    ("ingress-autoscaling-kv-above-one", _set("spec.ingress.autoscaling.targetKvCacheUsage", 1.5),
     "spec.ingress.autoscaling.targetKvCacheUsage"),
    ("ingress-autoscaling-max-zero", _set("spec.ingress.autoscaling.maxReplicas", 0),
     "spec.ingress.autoscaling.maxReplicas"),
    ("node-label-value-space", _set("spec.experts.rayNodeLabels", {"pool": "a b"}), "spec.experts.rayNodeLabels.pool"),
    ("group-nodes-no-groups", _set("spec.experts.groupNodes", [{"groups": [], "rayNodeLabels": {"pool": "a"}}]),
     "spec.experts.groupNodes[0].groups"),
    ("duplicate-override", _set("spec.experts.overrides.1", {"expert": "1.3", "weights": {"path": "/models/other.safetensors"}}), "spec.experts.overrides[1]"),
    ("group-nodes-group-twice-in-entry", _set("spec.experts.groupNodes", [{"groups": [1, 1], "rayNodeLabels": {"pool": "a"}}]),
     "spec.experts.groupNodes"),
    # cross-field rules: CEL in the CRD (x-kubernetes-validations, the error at the rule's fieldPath
    # below the object named here), the models' validators in the parser (at the object)
    ("group-nodes-unknown-group", _set("spec.experts.groupNodes", [{"groups": [2], "rayNodeLabels": {"pool": "a"}}]),
     "spec.experts.groupNodes"),
    ("ingress-autoscaling-min-above-max", lambda d: d["spec"].setdefault("ingress", {}).update(
        {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}), "spec.ingress.autoscaling"),
    ("autoscaling-min-above-max", lambda d: d["spec"].setdefault("autoscaling", {}).update(
        {"minReplicasPerGroup": 5, "maxReplicasPerGroup": 2}), "spec.autoscaling"),
    ("prometheus-without-url", _set("spec.autoscaling.metrics", {"source": "Prometheus"}),
     "spec.autoscaling.metrics"),
    ("kuberay-without-cluster", _set("spec.ray", {"mode": "KubeRay"}), "spec.ray"),
    ("kuberay-token-key", _set("spec.ray", {"mode": "KubeRay", "kubeRay": {"image": "moe-ray:1"},
                                            "authTokenSecretRef": {"name": "ray-auth", "key": "token"}}),
     "spec.ray"),
]


# Accepted by the apiserver (its schema cannot say "a whole number of bytes, at least 1" or bound a
# quantity string), refused by the parser: the operator marks the object Ready=False InvalidSpec
# naming the field (tests/unit: parser and the reconcile pass; tests/e2e: the apiserver accepts).
SEMANTIC_CASES: list[tuple[str, Callable[[dict], None], str]] = [
    (f"kv-budget-{i}", _set("spec.ingress.kvCacheBudget", v), "spec.ingress.kvCacheBudget")
    for i, v in enumerate([0, "0", "0.5", "1e-9", "1n", "1e400", "9" * 400, "1.5"])
] + [
    ("hot-budget-huge", _set("spec.experts.tiers.hot.budget", "8Ei"), "spec.experts.tiers.hot.budget"),
    ("cold-budget-fraction", _set("spec.experts.tiers.cold.budget", "100m"), "spec.experts.tiers.cold.budget"),
    ("request-bytes-zero", _set("spec.ingress.maxRequestBytes", "0Ki"), "spec.ingress.maxRequestBytes"),
    # across entries: each entry against each other is over the apiserver's CEL cost budget
    ("group-nodes-group-twice", _set("spec.experts.groupNodes", [{"groups": [0], "rayNodeLabels": {"pool": "a"}},
                                                                  {"groups": [1, 0], "rayNodeLabels": {"pool": "b"}}]),
     "spec.experts.groupNodes"),
    ("node-label-key-bad", _set("spec.ingress.rayNodeLabels", {"-pool": "a"}), "spec.ingress.rayNodeLabels"),
]


def build(mutation: Callable[[dict], None], name: str) -> dict:
    doc = copy.deepcopy(VALID)
    doc["metadata"]["name"] = name
    if mutation is not None:
        mutation(doc)
    return doc
