"""Where this replica runs, as Ray knows it (the ingress and the shard replicas both ask)."""

from __future__ import annotations


def ray_placement() -> tuple[str | None, str | None]:
    """This replica's Ray node id and runtime environment (serialized): the board starts warm
    spares on the node in exactly this environment, the one Serve asks for when it replaces a
    replica; the ingress reaches replicas with its own node id on their Unix sockets."""
    try:
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ctx.runtime_env.serialize()
    except Exception:  # noqa: BLE001 - outside Ray (unit use)
        return None, None


def node_address() -> str:
    """The address Ray uses for this node (127.0.0.1 on a local head): the channel listens there."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (unit use)
        return "127.0.0.1"
