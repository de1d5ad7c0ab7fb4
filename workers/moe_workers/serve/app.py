"""The Ray Serve application: one Ingress (dense part + HTTP API), ExpertShard deployments and
the StatusBoard.

    serve run moe_workers.serve.app:build_app model_path=/models/m ...   (or a Serve config file
    with import_path moe_workers.serve.app:build_app and typed args; that is what the operator
    renders)
"""


from ray import serve

from moe_workers.serve.board import StatusBoard
from moe_workers.serve.config import (HEALTH_CHECK_PERIOD_S, INGRESS, AppArgs, admission, ingress_actor_options,
                                      ingress_autoscaling_config, ingress_count, ingress_router_config,
                                      shard_actor_options)
from moe_workers.serve.ingress import Ingress
from moe_workers.serve.shard import ExpertShard

__all__ = ["ExpertShard", "Ingress", "StatusBoard", "build_app"]


def build_app(args: AppArgs) -> serve.Application:
    """The Serve application for these typed args (placement from args.placement, if given;
    Serve configs override it per deployment through user_config)."""
    placement = args.placement or {}
    board = StatusBoard.bind(args.warm_spares)
    shards = {}
    for name in args.group_names():
        options = {"name": name, "health_check_period_s": HEALTH_CHECK_PERIOD_S,
                   "ray_actor_options": shard_actor_options(args, name)}
        if args.placement is not None:
            options["user_config"] = {"experts": list(placement.get(name, []))}
        shards[name] = ExpertShard.options(**options).bind(args.model_path, args.dtype, args.torch_threads,
                                                           args.allowed_weight_roots, board, args.family,
                                                           args.wake_latency_us(), args.pin_shard_cpus,
                                                           args.realtime_priority, args.shard_spin_us)
    autoscaling = ingress_autoscaling_config(args)
    options = {"name": INGRESS, "health_check_period_s": HEALTH_CHECK_PERIOD_S,
               **({"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": args.ingress_replicas}),
               "ray_actor_options": ingress_actor_options(args),
               **admission(args)}
    if args.placement is not None:  # serve.run; a Serve config says the router (its args do not)
        options["request_router_config"] = ingress_router_config(args.prefix_routing)
        options["user_config"] = {"placement": placement, "ingress_replicas": ingress_count(args)}
    return Ingress.options(**options).bind(args.model_copy(update={"placement": None}).model_dump(), shards, board)
