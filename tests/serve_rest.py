"""Deploy Serve configs on the test Ray head through the operator's REST client."""

from __future__ import annotations

from moe_operator.backends.ray_rest import RayServeClient
from moe_operator.reconcile import http_options


def client(head) -> RayServeClient:
    return RayServeClient(head.dashboard_url, head.token)


def deploy(head, apps: list[dict], timeout_s: float = 180.0) -> None:
    c = client(head)
    c.put({"http_options": http_options(head.serve_http_port), "applications": apps})
    c.wait_running([a["name"] for a in apps], timeout_s)


def delete_all(head) -> None:
    client(head).delete_all()


def two_group_app(path, layers: int, experts: int, vocab_size: int = 96, **args) -> tuple[dict, object]:
    """A tiny Mixtral written at `path`, served by 2 shard groups (even experts in group 0, odd in
    group 1) with a small batch and KV cache: its placement and AppArgs (`args` override)."""
    from checkpoints import make_mixtral
    from moe_workers.serve.config import AppArgs

    make_mixtral(path, vocab_size=vocab_size, num_local_experts=experts, num_hidden_layers=layers,
                 max_position_embeddings=256)
    placement = {f"ExpertShard-{g}": [f"{l}.{e}" for l in range(layers) for e in range(experts) if e % 2 == g]
                 for g in range(2)}
    return placement, AppArgs(**{"model_path": str(path), "served_model_name": "m", "num_groups": 2,
                                 "max_batch_size": 8, "kv_cache_budget_bytes": 8 * 2**20,
                                 "max_queued_requests": 32, **args})
