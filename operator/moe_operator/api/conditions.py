"""Conditions as constants with reasons, set by a pure helper that changes only what changed."""

from __future__ import annotations

from moe_workers.rfc3339 import format_rfc3339

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
ROUTING_ANOMALY = "RoutingAnomaly"  # the Ingress' routing anomaly detector alerts (observe.routing_anomaly)

# reasons
INVALID_SPEC = "InvalidSpec"
UNSUPPORTED_MODEL = "UnsupportedModel"  # config.json's model_type (or a quantization) we cannot compute yet
DEPLOYING = "Deploying"
SERVING = "Serving"
REBALANCING = "Rebalancing"  # Progressing: a make-before-break placement change is under way (its phase in the message)
REPLICAS_NOT_READY = "ReplicasNotReady"  # Degraded: a group has fewer ready replicas than it asks for
ALL_REPLICAS_READY = "AllReplicasReady"  # Degraded=False: every replica serves
DEPLOY_FAILED = "DeployFailed"
REPLICA_START_FAILED = "ReplicaStartFailed"  # a deployment's replicas raise in their constructor: its exception
RAY_UNREACHABLE = "RayUnreachable"
RECONCILED = "Reconciled"
SECRET_UNAVAILABLE = "SecretUnavailable"  # a Secret the spec names is missing, unreadable or lacks the key
RAY_NOT_CONFIGURED = "RayNotConfigured"  # no Ray address in the spec nor in the operator's settings
STOPPED = "Stopped"  # standalone: the `moectl up` that served the app has exited (or was killed)
UNSCHEDULABLE = "Unschedulable"  # Ray cannot place a replica: what it needs and what the cluster has
# KubeRay mode (moe_operator.backends.kuberay_status)
WAITING_FOR_KUBERAY = "WaitingForKubeRay"  # KubeRay has not observed the RayService we wrote
UPGRADING = "Upgrading"  # KubeRay is moving the app to a new Ray cluster
UNHEALTHY = "Unhealthy"  # the application or one of its deployments is UNHEALTHY
NO_SERVE_ENDPOINTS = "NoServeEndpoints"  # the app runs but KubeRay's Service has no endpoint
DEPLOYMENT_UNHEALTHY = "DeploymentUnhealthy"  # Degraded: names the deployments
# RoutingAnomaly
EXPERT_SURGE = "ExpertSurge"  # True: an expert's share of its layer surged past surgeFactor x its baseline
ENTROPY_DROP = "EntropyDrop"  # True: a layer's routing entropy fell under entropyFloor (no surge beside it)
NO_ANOMALY = "NoAnomaly"  # False: the detector reads every window and alerts on none (or is warming up)
DETECTOR_UNAVAILABLE = "DetectorUnavailable"  # Unknown: the app's report has no detector, or it cannot read a window

# Event reasons beside the conditions' (an Event posted on a pass' outcome carries Ready's reason);
# every Event is (type, reason, message), posted by one function per runner (the kopf handlers'
# `_post`, standalone's log)
NORMAL, WARNING = "Normal", "Warning"  # Event types
HOT_SWAP_SERVING = "HotSwapServing"  # an override's new weights serve on every replica
HOT_SWAP_FAILED = "HotSwapFailed"  # an override was refused (the replica's reason)
HOT_SWAP_ROLLED_BACK = "HotSwapRolledBack"  # an override removed: the checkpoint's version serves again
REBALANCE_STARTED = "RebalanceStarted"  # the autoscaler set a target placement (status.autoscaling.target)
REBALANCE_RECOMMENDED = "RebalanceRecommended"  # autoscaling mode Recommend: what a rebalance would move
REBALANCE_NOT_NEEDED = "RebalanceNotNeeded"  # a requested rebalance found nothing worth moving
REBALANCED = "Rebalanced"  # the target placement serves (the make-before-break change is done)
API_KEYS_CHANGED = "ApiKeysChanged"  # the API-key Secret changed; the keys apply in place
# RoutingAnomaly turned True, or names other experts (a Warning with the shares; its reason the condition's)
AUTO_QUARANTINED = "AutoQuarantined"  # spec.routing.autoQuarantine took a surging expert out (or lifted one)
AUTO_QUARANTINE_REFUSED = "AutoQuarantineRefused"  # ... would pass maxQuarantinedShare: the expert keeps serving


def now_rfc3339() -> str:
    return format_rfc3339()


def set_condition(conditions: list[dict], type_: str, status: bool | str, reason: str, message: str = "",
                  generation: int | None = None, now: str | None = None) -> list[dict]:
    """A new list with `type_` set; lastTransitionTime moves only when the status flips."""
    status_str = status if isinstance(status, str) else ("True" if status else "False")
    message = message or reason  # apiserver v1.20 turns "" into null in a merge patch and refuses it
    out, found = [], False
    for c in conditions:
        if c.get("type") != type_:
            out.append(c)
            continue
        found = True
        changed = c.get("status") != status_str
        out.append({
            "type": type_, "status": status_str, "reason": reason, "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": (now or now_rfc3339()) if changed else c.get("lastTransitionTime"),
        })
    if not found:
        out.append({"type": type_, "status": status_str, "reason": reason, "message": message,
                    "observedGeneration": generation, "lastTransitionTime": now or now_rfc3339()})
    return out


def get_condition(conditions: list[dict], type_: str) -> dict | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: list[dict], type_: str) -> bool:
    c = get_condition(conditions, type_)
    return c is not None and c.get("status") == "True"
