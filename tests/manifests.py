"""MoEDeployment manifests for the autoscaling tests: small replicas (a fraction of a CPU, 16 MiB
tiers and KV cache) so several groups fit on a 2-core machine."""

from __future__ import annotations

# what the skewed-router checkpoint needs to be rebalanced within a test's time: short windows,
# room for one spare copy of each hot expert in every group, no second decision (long cooldown)
SKEW_AUTOSCALING = {"mode": "Auto", "windowSeconds": 10, "stabilizationWindowSeconds": 4, "cooldownSeconds": 600,
                    "redundantExpertSlots": 4, "maxMovesPerStep": 16, "metrics": {"scrapeIntervalSeconds": 2}}


def small_deployment(name: str, model_path: str, groups: int, num_cpus: float, autoscaling: dict,
                     route_prefix: str | None = None) -> dict:
    ingress = {"numCpus": num_cpus, "kvCacheBudget": "16Mi"}
    if route_prefix is not None:
        ingress["routePrefix"] = route_prefix
    return {
        "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name},
        "spec": {"model": {"path": model_path}, "ingress": ingress,
                 "experts": {"groups": groups, "numCpus": num_cpus,
                             "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}},
                 "autoscaling": autoscaling},
    }
