"""MoEDeployment spec + placement -> Ray Serve application config (pure; no cluster)."""

from __future__ import annotations

from moe_operator.api.models import MoEDeploymentSpec
from moe_operator.api.types import quantity_bytes
from moe_workers.serve.config import AppArgs, serve_application


def app_name(namespace: str, name: str) -> str:
    """Serve application name: unique per MoEDeployment on a shared Ray cluster."""
    return f"{namespace}.{name}"


def app_args(name: str, spec: MoEDeploymentSpec) -> AppArgs:
    return AppArgs(
        model_path=spec.model.path,
        served_model_name=spec.model.served_model_name or name,
        dtype=spec.model.dtype,
        max_model_len=spec.model.max_model_len,
        max_batch_size=spec.ingress.max_batch_size,
        kv_cache_budget_bytes=quantity_bytes(spec.ingress.kv_cache_budget),
        max_queued_requests=spec.ingress.max_queued_requests,
        num_groups=spec.experts.groups,
        ingress_replicas=spec.ingress.replicas,
        ingress_num_cpus=spec.ingress.num_cpus,
        shard_num_cpus=spec.experts.num_cpus,
        shard_num_gpus=spec.experts.num_gpus,
    )


def render_application(namespace: str, name: str, spec: MoEDeploymentSpec, placement: dict[str, list[str]]) -> dict:
    """One entry of the Serve config's `applications` for this MoEDeployment."""
    return serve_application(app_name(namespace, name), spec.ingress.route_prefix, app_args(name, spec), placement,
                             spec.experts.replicas_per_group)


def merge_applications(current: list[dict], ours: dict) -> list[dict]:
    """The cluster's applications with ours added or replaced, everyone else's kept as they are
    (the Serve REST PUT replaces the whole config)."""
    others = [a for a in current if a.get("name") != ours["name"]]
    clash = [a["name"] for a in others if a.get("route_prefix") == ours["route_prefix"]]
    if clash:
        raise ValueError(f"route prefix {ours['route_prefix']} is already used by application {clash[0]}; "
                         "set spec.ingress.routePrefix to a free prefix")
    return others + [ours]
