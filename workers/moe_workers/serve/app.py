"""The Ray Serve application: one Ingress (dense part + HTTP API), ExpertShard deployments and
the StatusBoard.

    serve run moe_workers.serve.app:build_app model_path=/models/m ...   (or a Serve config file
    with import_path moe_workers.serve.app:build_app and typed args; that is what the operator
    renders)
"""


from ray import serve

from moe_workers.serve.board import StatusBoard
from moe_workers.serve.config import INGRESS, AppArgs
from moe_workers.serve.ingress import Ingress
from moe_workers.serve.shard import ExpertShard

__all__ = ["ExpertShard", "Ingress", "StatusBoard", "admission", "build_app"]


# requests beside a full batch a replica takes (health, models, metrics, and those about to start
# as others finish), so a full batch never blocks them behind the proxy's queue
ADMISSION_HEADROOM = 8


def admission(args: AppArgs) -> dict:
    """The Ingress' admission gate, enforced by Serve's router in the proxy: a replica takes a
    batch of requests (plus a little headroom); up to max_queued_requests more wait in the proxy
    for a place; beyond that the proxy answers 503 with Retry-After: 1 without reaching a
    replica, so refusing a request costs the proxy's HTTP handling and nothing of the model's."""
    return {"max_ongoing_requests": args.max_batch_size + ADMISSION_HEADROOM,
            "max_queued_requests": max(1, args.max_queued_requests),
            "backpressure_config": {"status_code": 503, "retry_after_s": 1}}


def build_app(args: AppArgs) -> serve.Application:
    """The Serve application for these typed args (placement from args.placement, if given;
    Serve configs override it per deployment through user_config)."""
    placement = args.placement or {}
    board = StatusBoard.bind()
    shards = {}
    for name in args.group_names():
        options = {"name": name, "ray_actor_options": {"num_cpus": args.shard_num_cpus, "num_gpus": args.shard_num_gpus}}
        if args.placement is not None:
            options["user_config"] = {"experts": list(placement.get(name, []))}
        shards[name] = ExpertShard.options(**options).bind(args.model_path, args.dtype, args.torch_threads,
                                                           args.allowed_weight_roots, board, args.family)
    options = {"name": INGRESS, "num_replicas": args.ingress_replicas,
               "ray_actor_options": {"num_cpus": args.ingress_num_cpus, "num_gpus": args.ingress_num_gpus},
               **admission(args)}
    if args.placement is not None:
        options["user_config"] = {"placement": placement}
    return Ingress.options(**options).bind(args.model_copy(update={"placement": None}).model_dump(), shards, board)
