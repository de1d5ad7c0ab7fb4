"""The Ingress' Serve autoscaling policy when it also follows KV cache use (spec.ingress.autoscaling.
targetKvCacheUsage).

Serve's own policy keeps about `target_ongoing_requests` requests on each replica. A replica whose
requests have long contexts fills its KV cache first: new requests then wait (or preempt) however
few are running. Each Ingress replica reports the share of its KV blocks in use as a custom
autoscaling metric (`record_autoscaling_stats`); this policy asks for as many replicas as the
larger of the two wants. Serve applies the bounds and the up / down delays around it, as for its
own policy (Serve instantiates the class once with the policy kwargs, in its controller).
"""

from __future__ import annotations

KV_METRIC = "kv_cache_usage"  # the share of a replica's KV cache blocks in use (0..1)


def replicas_for_kv(current: int, usages: list[float], target: float) -> float:
    """Replicas that would hold the KV blocks in use now at `target` use each (the total in use
    spread evenly); `current` when no replica reported."""
    if not usages or current <= 0:
        return float(current)
    return sum(usages) / len(usages) * current / target


class KvAwarePolicy:
    def __init__(self, target_kv_cache_usage: float):
        if not 0 < target_kv_cache_usage <= 1:
            raise ValueError(f"target_kv_cache_usage must be in (0, 1], got {target_kv_cache_usage}")
        self.target = target_kv_cache_usage

    def __call__(self, ctx) -> tuple[float, dict]:
        from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

        by_requests, state = replica_queue_length_autoscaling_policy(ctx)
        usages = list(((ctx.aggregated_metrics or {}).get(KV_METRIC) or {}).values())
        return max(by_requests, replicas_for_kv(ctx.current_num_replicas, usages, self.target)), state
