"""Warm spare workers: a replaced shard replica starts in a process that is already running.

When a shard replica dies, Serve starts a replacement, and Ray gives it a new worker process.
That process imports Ray, Ray Serve and torch before our code runs: about 7 s of CPU, which on a
node busy serving the load the dead replica left behind took 11-15 s (2 cores). So each node that
hosts shard replicas keeps `warm_spares` idle Python workers, started by its raylet with the app's
runtime environment (Ray hands an actor only to an idle worker whose runtime environment matches)
and with the app's modules already imported (`preload`, the runtime environment's setup hook). A
replacement replica takes one and is serving in a few seconds; the board starts another once the
node has settled.

The pure part (`SparePool.step`) decides; `RayletSpares` asks the raylet (its gRPC service, as
Ray's own CLI does: `GetNodeStats` for the idle workers, `PrestartWorkers` for new ones).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

SETTLE_S = 10.0  # no spare while a node's shard replicas are starting (they would share its CPU)
PENDING_S = 60.0  # a requested spare not seen idle after this is given up (asked for again)
KEEP_ALIVE_S = 3600  # the raylet keeps an idle spare at least this long; then the board replaces it
CHECK_S = 5.0  # how often the board looks at each node
PRELOAD = ("torch", "moe_workers.serve.app")  # what a replica imports (ray.serve with the app)


def preload() -> None:
    """The app's setup hook (runs in each of its worker processes before the actor or task is
    assigned): import what a replica imports, so a spare is ready to host one. A failure only
    loses the head start: Ray would end a worker whose hook raised."""
    try:
        for module in PRELOAD:
            importlib.import_module(module)
    except Exception:  # noqa: BLE001 - the replica imports them again and reports the real error
        pass


@dataclass
class NodeSpares:
    """What the board knows of one node's spares."""

    spares: set[int] = field(default_factory=set)  # idle worker pids started for us
    taken_at: float | None = None  # when a replica last took one of them (it is starting there now)
    requested: int = 0  # spares asked for and not seen yet
    requested_at: float | None = None
    idle_before: frozenset[int] = frozenset()  # idle pids when we asked: those are not ours


@dataclass
class SparePool:
    """Per node: how many spares to start now, from the node's idle worker pids and when its
    newest shard replica joined. A node settles `settle_s` after its last join and after a
    replica last took one of its spares (a replacement starting there)."""

    want: int = 1
    settle_s: float = SETTLE_S
    pending_s: float = PENDING_S
    nodes: dict[str, NodeSpares] = field(default_factory=dict)

    def step(self, node: str, now: float, idle: set[int], last_join: float | None) -> int:
        n = self.nodes.setdefault(node, NodeSpares())
        if n.requested:  # idle workers that appeared since we asked are the spares we asked for
            new = sorted(idle - n.idle_before - n.spares)[:n.requested]
            n.spares.update(new)
            n.requested -= len(new)
            if n.requested and n.requested_at is not None and now - n.requested_at > self.pending_s:
                n.requested = 0  # never came (the raylet refused or it died starting): ask again
        if n.spares - idle:  # taken by a replica (or ended by the raylet): one may be starting in it
            n.spares &= idle
            n.taken_at = now
        starting = [t for t in (last_join, n.taken_at) if t is not None]
        if self.want <= 0 or n.requested or (starting and now - max(starting) < self.settle_s):
            return 0
        missing = self.want - len(n.spares)
        if missing <= 0:
            return 0
        n.requested, n.requested_at, n.idle_before = missing, now, frozenset(idle)
        return missing

    def forget(self, live_nodes: set[str]) -> None:
        for node in set(self.nodes) - live_nodes:
            del self.nodes[node]

    def view(self) -> dict[str, dict]:
        return {node: {"spares": sorted(n.spares), "starting": n.requested} for node, n in sorted(self.nodes.items())}


class RayletSpares:
    """A node's raylet: its idle Python workers, and new ones started for a runtime environment."""

    def __init__(self, address: str):
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import node_manager_pb2_grpc

        self.address = address
        self._stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(address))

    def idle_workers(self, timeout_s: float = 10.0) -> set[int]:
        from ray.core.generated import common_pb2, node_manager_pb2

        reply = self._stub.GetNodeStats(node_manager_pb2.GetNodeStatsRequest(include_memory_info=False),
                                        timeout=timeout_s)
        # a worker hosting no actor reports the nil actor id (every byte 0xff)
        return {w.pid for w in reply.core_workers_stats
                if w.worker_type == common_pb2.WORKER and w.language == common_pb2.PYTHON
                and set(w.actor_id) <= {0xFF} and not w.num_running_tasks}

    def prestart(self, runtime_env: str, n: int, keep_alive_s: int = KEEP_ALIVE_S, timeout_s: float = 10.0) -> None:
        """`runtime_env`: serialized exactly as the replicas' own (a replica reports it)."""
        from ray._private.utils import get_runtime_env_info
        from ray.core.generated import common_pb2, node_manager_pb2
        from ray.runtime_env import RuntimeEnv

        info = get_runtime_env_info(RuntimeEnv.deserialize(runtime_env))
        self._stub.PrestartWorkers(node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON, runtime_env_info=info, keep_alive_duration_secs=keep_alive_s,
            num_workers=n), timeout=timeout_s)
