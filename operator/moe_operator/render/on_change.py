"""What changing each spec field does to a running application, found by rendering (pure).

Ray Serve applies a changed config to running replicas only for its lightweight options
(num_replicas, autoscaling_config, user_config, max_ongoing_requests, max_queued_requests, the
graceful-shutdown and health-check settings: "Updating Applications In-Place" in Serve's docs; the
update types in Serve's DeploymentConfig); any other change to a deployment, and any change to
the application's `args`, `import_path` or `runtime_env`, replaces its replicas. So each field's
effect is read off the Serve config we render: `classify` compares two rendered applications, and
`on_change` renders a base spec before and after setting one field to another valid value
(`PROBES`). The API reference shows the result per field
(moe_operator.reference), and a test checks that every field of the spec has a probe or a stated
reason (`NOT_RENDERED`), so a new field cannot go unclassified.
"""

from __future__ import annotations

import copy

from moe_operator.api.validation import parse_spec
from moe_operator.planner.initial import initial_placement
from moe_operator.render.serve_app import render_application

IN_PLACE = "in place"
RESTART = "restarts replicas"
RESTART_SOME = "restarts the replicas of the deployments it concerns; the others keep running"
OPERATOR = "operator only"  # read by the operator (or the planner); the rendered application is the same

LIGHTWEIGHT = {"num_replicas", "autoscaling_config", "user_config", "max_ongoing_requests", "max_queued_requests",
               "graceful_shutdown_timeout_s", "graceful_shutdown_wait_loop_s", "health_check_period_s",
               "health_check_timeout_s"}
APP_STATIC = ("import_path", "args", "runtime_env", "route_prefix")  # route_prefix: not on Serve's in-place list

BASE = {
    "model": {"path": "/models/mixtral", "shape": {"numLayers": 4, "numExperts": 8, "topK": 2, "hiddenSize": 64,
                                                   "intermediateSize": 128}},
    "ray": {"address": "http://127.0.0.1:8265"},
    "experts": {"groups": 2, "tiers": {"hot": {"budget": "512Mi"}, "warm": {"budget": "1Gi"},
                                       "cold": {"path": "/var/cache/moe-experts"}}},
    "ingress": {},
}

# field path (as the API reference spells it) -> another valid value
PROBES: dict[str, object] = {
    "model.path": "/models/mixtral-v2",
    "model.family": "qwen3_moe",
    "model.dtype": "float32",
    "model.servedModelName": "mixtral-prod",
    "model.maxModelLen": 1024,
    "model.shape.numLayers": 6,
    "model.shape.numExperts": 16,
    "model.shape.topK": 4,
    "model.shape.hiddenSize": 128,
    "model.shape.intermediateSize": 256,
    "model.shape.dtype": "float16",
    "model.shape.sparseLayers": [1, 3],
    "ingress.replicas": 2,
    "ingress.autoscaling.minReplicas": 2,
    "ingress.autoscaling.maxReplicas": 8,
    "ingress.autoscaling.targetOngoingRequests": 16,
    "ingress.autoscaling.targetKvCacheUsage": 0.8,
    "ingress.autoscaling.upscaleDelaySeconds": 30,
    "ingress.autoscaling.downscaleDelaySeconds": 600,
    "ingress.numCpus": 2,
    "ingress.numGpus": 1,
    "ingress.routePrefix": "/mixtral",
    "ingress.maxBatchSize": 16,
    "ingress.kvCacheBudget": "2Gi",
    "ingress.kvBlockSize": 32,
    "ingress.prefixCaching": False,
    "ingress.maxNumBatchedTokens": 1024,
    "ingress.maxQueuedRequests": 128,
    "ingress.includeReasoning": False,
    "ingress.maxRequestBytes": "8Mi",
    "ingress.cpuWakeLatencyMicroseconds": 20,
    "ingress.realtimePriority": 0,
    "experts.groups": 4,
    "experts.replicasPerGroup": 2,
    "experts.numCpus": 2,
    "experts.numGpus": 1,
    "experts.pinCpus": False,
    "experts.warmSpares": 0,
    "experts.tiers.hot.budget": "1Gi",
    "experts.tiers.warm.budget": "2Gi",
    "experts.tiers.warm.pinned": False,
    "experts.tiers.cold.path": "/mnt/nvme/experts",
    "experts.tiers.cold.budget": "100Gi",
    "experts.tiers.policy": "LFU",
    "experts.tiers.idleDemotionSeconds": 60,
    "experts.tiers.prefetch.enabled": False,
    "experts.tiers.prefetch.lookaheadLayers": 2,
    "ingress.rayNodeLabels": {"pool": "a"},
    "experts.rayNodeLabels": {"pool": "a"},
    "experts.groupNodes[].groups": [1],
    "experts.groupNodes[].rayNodeLabels": {"pool": "b"},
    "experts.overrides[].expert": "1.3",
    "experts.overrides[].weights.path": "/weights/expert-1.3-v2.safetensors",
    "experts.overrides[].weights.sha256": "ab" * 32,
    "autoscaling.mode": "Auto",
    "autoscaling.imbalanceThreshold": 1.5,
    "autoscaling.windowSeconds": 120,
    "autoscaling.stabilizationWindowSeconds": 600,
    "autoscaling.cooldownSeconds": 900,
    "autoscaling.maxMovesPerStep": 4,
    "autoscaling.redundantExpertSlots": 2,
    "autoscaling.minReplicasPerGroup": 2,
    "autoscaling.maxReplicasPerGroup": 8,
    "autoscaling.targetTokensPerSecondPerReplica": 500,
    "autoscaling.metrics.source": "Prometheus",
    "autoscaling.metrics.prometheusUrl": "http://prometheus:9090",
    "autoscaling.metrics.scrapeUrls": ["http://10.0.0.7:8080/metrics"],
    "autoscaling.metrics.scrapeIntervalSeconds": 30,
    "routing.quarantine": ["1.3"],
    "routing.maxQuarantinedShare": 0.5,
    "routing.anomaly.entropyFloor": 0.2,
    "routing.anomaly.surgeFactor": 5.0,
    "routing.anomaly.minShareFactor": 3.0,
    "routing.anomaly.minTokens": 256,
    "routing.anomaly.warmupWindows": 6,
    "routing.autoQuarantine": True,
    "routing.capacityFactor": 1.25,
}

# fields a probe needs set beside it, before and after (a value the probe's value requires)
WITH: dict[str, dict[str, object]] = {
    "autoscaling.metrics.source": {"autoscaling.metrics.prometheusUrl": "http://prometheus:9090"},
}

# fields whose change the Serve config of one cluster cannot show, and what it does instead
NEW_CLUSTER = "KubeRay builds a new Ray cluster and switches traffic to it once it serves"
API_KEYS = f"{IN_PLACE} (the keys' digests reach the Ingress through its user_config)"
NOT_RENDERED: dict[str, str] = {
    "ingress.prefixRouting": "no replica restarts; Serve builds a proxy's router for the app once, so a proxy "
                             "already routing to it keeps the router it has until it restarts (new proxies, and "
                             "the app created anew, take the new setting)",
    "ray.mode": "refused while the application serves (Ready=False, InvalidSpec; it keeps serving): delete the "
                "object and create it anew",
    "ray.address": "refused while the application serves on another cluster (Ready=False, InvalidSpec; it keeps "
                   "serving): delete the object and create it anew",
    "ray.authTokenSecretRef.name": OPERATOR,
    "ray.authTokenSecretRef.key": OPERATOR,
    "ray.kubeRay.rayVersion": NEW_CLUSTER,
    "ray.kubeRay.image": NEW_CLUSTER,
    "ray.kubeRay.workerReplicas": "KubeRay scales the running Ray cluster",
    "ray.kubeRay.workerCpu": NEW_CLUSTER,
    "ray.kubeRay.workerMemory": NEW_CLUSTER,
    "ray.kubeRay.workerGpus": NEW_CLUSTER,
    "ray.kubeRay.allowRealtime": NEW_CLUSTER,
    "ray.kubeRay.headCpu": NEW_CLUSTER,
    "ray.kubeRay.volumes": NEW_CLUSTER,
    "ray.kubeRay.volumeMounts": NEW_CLUSTER,
    "ray.kubeRay.headMemory": NEW_CLUSTER,
    "ray.kubeRay.workerGroups[].name": NEW_CLUSTER,
    "ray.kubeRay.workerGroups[].replicas": "KubeRay scales the running Ray cluster",
    "ray.kubeRay.workerGroups[].labels": NEW_CLUSTER,
    "ray.kubeRay.workerGroups[].cpu": NEW_CLUSTER,
    "ray.kubeRay.workerGroups[].memory": NEW_CLUSTER,
    "ray.kubeRay.workerGroups[].gpus": NEW_CLUSTER,
    "ray.kubeRay.upgradeStrategy": "KubeRay's choice for later changes of the Ray cluster (nothing restarts)",
    "ingress.apiKeySecretRef.name": API_KEYS,
    "ingress.apiKeySecretRef.key": API_KEYS,
}


def classify(before: dict, after: dict) -> str:
    """How Serve applies the change from one rendered application to the other."""
    if before == after:
        return OPERATOR
    if any(before.get(k) != after.get(k) for k in APP_STATIC):
        return RESTART
    old = {d["name"]: d for d in before.get("deployments", [])}
    new = {d["name"]: d for d in after.get("deployments", [])}
    if set(old) != set(new):
        return RESTART
    restarted = [name for name, d in new.items()
                 if {k for k in set(d) | set(old[name]) if d.get(k) != old[name].get(k)} - LIGHTWEIGHT]
    if not restarted:
        return IN_PLACE
    return RESTART if len(restarted) == len(new) else RESTART_SOME


# list fields: the entry a probe of one of its fields changes (made when there is none)
LIST_ENTRIES: dict[str, dict] = {
    "experts.overrides[]": {"expert": "0.1", "weights": {"path": "/weights/expert-0.1.safetensors"}},
    "experts.groupNodes[]": {"groups": [0], "rayNodeLabels": {"pool": "a"}},
}


def _set(spec: dict, path: str, value) -> dict:
    out = copy.deepcopy(spec)
    target = out
    for prefix, entry in LIST_ENTRIES.items():
        if path.startswith(prefix + "."):  # the list's first entry
            *where, name = prefix.removesuffix("[]").split(".")
            parent = out
            for key in where:
                parent = parent.setdefault(key, {})
            target, path = parent.setdefault(name, [copy.deepcopy(entry)])[0], path[len(prefix) + 1:]
            break
    *parents, leaf = path.split(".")
    for key in parents:
        target = target.setdefault(key, {})
    target[leaf] = value
    return out


def _render(raw: dict) -> dict:
    spec = parse_spec(raw)
    shape = spec.model.shape
    layers = shape.sparse_layers if shape.sparse_layers else shape.num_layers
    placement = initial_placement(layers, shape.num_experts, spec.experts.groups)
    return render_application("default", "mixtral", spec, placement, ["/models", "/weights", "/var/cache", "/mnt"])


def on_change(path: str) -> str:
    """What changing the field at `path` does to a running application."""
    if path in NOT_RENDERED:
        return NOT_RENDERED[path]
    return classify(*(_render(raw) for raw in probe(path)))


def probe(path: str) -> tuple[dict, dict]:
    """The raw spec before and after the probe change of the field at `path`."""
    if path not in PROBES:
        raise KeyError(f"{path}: no probe value and no stated effect (moe_operator.render.on_change)")
    base = BASE
    for prefix, entry in LIST_ENTRIES.items():
        if path.startswith(prefix + "."):  # an entry present before and after
            first = next(iter(entry))
            base = _set(BASE, f"{prefix}.{first}", entry[first])
    for other, value in WITH.get(path, {}).items():
        base = _set(base, other, value)
    return base, _set(base, path, PROBES[path])
