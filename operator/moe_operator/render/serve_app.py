"""MoEDeployment spec + placement -> Ray Serve application config (pure; no cluster)."""

from __future__ import annotations

from moe_operator.api.models import MoEDeploymentSpec
from moe_operator.api.types import quantity_bytes
from moe_operator.names import app_name
from moe_workers.serve.config import AppArgs, IngressScaling, group_name, serve_application


def tier_config(spec: MoEDeploymentSpec) -> dict:
    """The shard's user_config["tiers"] (moe_workers.store.TierConfig fields)."""
    t = spec.experts.tiers
    return {
        "hot_budget": quantity_bytes(t.hot.budget),
        "warm_budget": quantity_bytes(t.warm.budget),
        "cold_dir": t.cold.path,
        "cold_budget": quantity_bytes(t.cold.budget) if t.cold.budget is not None else None,
        "policy": t.policy,
        "idle_demotion_s": t.idle_demotion_seconds,
        "prefetch": t.prefetch.enabled,
        "pinned": t.warm.pinned,
    }


def overrides_config(spec: MoEDeploymentSpec) -> dict[str, dict]:
    """expert -> {"path", "sha256"} for the shards hosting it (hot-swaps)."""
    out = {}
    for o in spec.experts.overrides:
        entry = {"path": o.weights.path}
        if o.weights.sha256:
            entry["sha256"] = o.weights.sha256
        out[o.expert] = entry
    return out


def ingress_scaling(spec: MoEDeploymentSpec) -> IngressScaling | None:
    a = spec.ingress.autoscaling
    if a is None:
        return None
    return IngressScaling(min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                          target_ongoing_requests=a.target_ongoing_requests,
                          target_kv_cache_usage=a.target_kv_cache_usage,
                          upscale_delay_s=a.upscale_delay_seconds, downscale_delay_s=a.downscale_delay_seconds)


def app_args(name: str, spec: MoEDeploymentSpec, allowed_roots: list[str] | None = None) -> AppArgs:
    return AppArgs(
        model_path=spec.model.path,
        family=spec.model.family,
        served_model_name=spec.model.served_model_name or name,
        dtype=spec.model.dtype,
        max_model_len=spec.model.max_model_len,
        max_batch_size=spec.ingress.max_batch_size,
        kv_cache_budget_bytes=quantity_bytes(spec.ingress.kv_cache_budget),
        kv_block_size=spec.ingress.kv_block_size,
        prefix_caching=spec.ingress.prefix_caching,
        max_num_batched_tokens=spec.ingress.max_num_batched_tokens,
        max_queued_requests=spec.ingress.max_queued_requests,
        include_reasoning=spec.ingress.include_reasoning,
        max_request_bytes=quantity_bytes(spec.ingress.max_request_bytes),
        cpu_wake_latency_us=spec.ingress.cpu_wake_latency_microseconds,
        realtime_priority=spec.ingress.realtime_priority,
        num_groups=spec.experts.groups,
        ingress_replicas=spec.ingress.replicas,
        ingress_autoscaling=ingress_scaling(spec),
        prefix_routing=spec.ingress.prefix_routing,
        ingress_node_labels=dict(spec.ingress.ray_node_labels),
        group_node_labels={group_name(g): labels for g, labels in spec.experts.node_labels().items()},
        ingress_num_cpus=spec.ingress.num_cpus,
        ingress_num_gpus=spec.ingress.num_gpus,
        shard_num_cpus=spec.experts.num_cpus,
        shard_num_gpus=spec.experts.num_gpus,
        pin_shard_cpus=spec.experts.pin_cpus,
        warm_spares=spec.experts.warm_spares,
        allowed_weight_roots=list(allowed_roots or []),
    )


def render_application(namespace: str, name: str, spec: MoEDeploymentSpec, placement: dict[str, list[str]],
                       allowed_roots: list[str] | None = None,
                       shard_experts: dict[str, list[str]] | None = None,
                       api_key_digests: list[str] | None = None,
                       auto_quarantine: list[str] | None = None) -> dict:
    """One entry of the Serve config's `applications` for this MoEDeployment. Tiers, overrides,
    prefetch, the quarantine and the anomaly thresholds go into user_config (applied in place); allowed roots into the
    static args.
    `shard_experts`: what the groups host when it differs from the routing placement (a
    make-before-break rebalance in progress). `auto_quarantine`: experts quarantined on a routing
    anomaly (`containment`), on top of the spec's."""
    prefetch = spec.experts.tiers.prefetch
    return serve_application(app_name(namespace, name), spec.ingress.route_prefix,
                             app_args(name, spec, allowed_roots), placement,
                             spec.experts.replicas_per_group,
                             tiers=tier_config(spec), overrides=overrides_config(spec),
                             prefetch_lookahead=prefetch.lookahead_layers if prefetch.enabled else 0,
                             shard_experts=shard_experts, api_key_digests=api_key_digests,
                             quarantine=list(spec.routing.quarantine) + list(auto_quarantine or []),
                             anomaly=spec.routing.anomaly.user_config(), capacity_factor=spec.routing.capacity_factor)


def merge_applications(current: list[dict], ours: dict) -> list[dict]:
    """The cluster's applications with ours added or replaced, everyone else's kept as they are
    (the Serve REST PUT replaces the whole config)."""
    others = [a for a in current if a.get("name") != ours["name"]]
    clash = [a["name"] for a in others if a.get("route_prefix") == ours["route_prefix"]]
    if clash:
        raise ValueError(f"route prefix {ours['route_prefix']} is already used by application {clash[0]}; "
                         "set spec.ingress.routePrefix to a free prefix")
    return others + [ours]
