"""StatusBoard: the app's directory of shard replicas (a Serve deployment with one replica).

A DeploymentHandle call reaches one replica of a deployment, not each, so every shard replica
reports itself here (every 2 s and after each reconfigure): its status for GET /moe/v1/status,
and its expert-channel endpoint, from which each ingress replica learns the channel's members.
The board also holds the channel token: a random secret made when the board starts, handed to
each shard with the answer to its report and to each ingress with the members, so only the app's
own ingress replicas can open the shards' channel ports.

Each Ingress replica is counted here too, by its membership polls (every second): an autoscaled
Ingress learns from `members` how many replicas it runs now, the size of the admission gate.

The board also keeps each node that hosts shard replicas supplied with warm spare workers
(`moe_workers.serve.spares`), so a replacement replica starts in a process already running.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time

from ray import serve

from moe_workers.serve.spares import CHECK_S, RayletSpares, SparePool

log = logging.getLogger("ray.serve")

REPORT_MAX_AGE_S = 10.0  # a replica that stopped reporting (killed) leaves the board after this
INGRESS_MAX_AGE_S = 5.0  # an Ingress replica that stopped polling (killed) stops counting after this


@serve.deployment(ray_actor_options={"num_cpus": 0.01})
class StatusBoard:
    def __init__(self, warm_spares: int = 0):
        self.reports: dict[str, tuple[float, dict]] = {}
        self.joined: dict[str, float] = {}  # replica -> when it first reported
        self.ingresses: dict[str, float] = {}  # Ingress replica -> its last membership poll
        self.token = secrets.token_hex(16)
        self._lock = threading.Lock()  # Serve calls methods from several threads; spares from its own
        self.pool = SparePool(want=warm_spares)
        self._raylets: dict[str, RayletSpares] = {}
        self.spare_error = ""
        self._stop = threading.Event()
        if warm_spares > 0:
            threading.Thread(target=self._keep_spares, name="warm-spares", daemon=True).start()

    def __del__(self):
        self._stop.set()

    def report(self, status: dict) -> str:
        """Record a replica's status; the channel token in return."""
        now = time.monotonic()
        with self._lock:
            self.reports[status["replica"]] = (now, status)
            self.joined.setdefault(status["replica"], now)
        return self.token

    def leave(self, replica: str) -> None:
        """A replica that is stopping leaves at once (it answers DRAINING meanwhile)."""
        with self._lock:
            self.reports.pop(replica, None)

    def forget(self, replica: str, endpoint: str) -> None:
        """An ingress found the replica's channel port closed (its process died): it leaves now
        rather than when its report ages out. A live replica reports again within 2 s."""
        with self._lock:
            got = self.reports.get(replica)
            if got is not None and got[1].get("endpoint") == endpoint:
                del self.reports[replica]

    def _fresh(self, max_age_s: float) -> list[tuple[float, dict]]:
        now = time.monotonic()
        with self._lock:  # gone replicas age out
            self.reports = {r: v for r, v in self.reports.items() if now - v[0] <= max_age_s}
            self.joined = {r: t for r, t in self.joined.items() if r in self.reports}
        return sorted(self.reports.values(), key=lambda v: (v[1]["group"], v[1]["replica"]))

    def snapshot(self, max_age_s: float = REPORT_MAX_AGE_S) -> list[dict]:
        now = time.monotonic()
        return [{**st, "age_s": round(now - t, 2)} for t, st in self._fresh(max_age_s)]

    def spares(self) -> dict:
        """Per node: the warm spare workers' pids and how many are starting."""
        return {"nodes": self.pool.view(), "error": self.spare_error}

    def _keep_spares(self) -> None:
        while not self._stop.wait(CHECK_S):
            try:
                self._spares_round()
                self.spare_error = ""
            except Exception as err:  # noqa: BLE001 - the next round retries; status shows why
                if str(err) != self.spare_error:
                    log.warning("warm spares: %s", err)
                self.spare_error = f"{type(err).__name__}: {err}"

    def _spares_round(self) -> None:
        """Each node hosting shard replicas: start the spares it lacks, once its replicas have
        settled, in the runtime environment they report (the one a replacement will ask for)."""
        import ray

        now = time.monotonic()
        fresh = [st for _, st in self._fresh(REPORT_MAX_AGE_S) if st.get("node_id") and st.get("runtime_env")]
        nodes: dict[str, tuple[str, float]] = {}  # node -> (runtime env, newest join)
        for st in fresh:
            joined = self.joined.get(st["replica"], now)
            env, newest = nodes.get(st["node_id"], (st["runtime_env"], joined))
            nodes[st["node_id"]] = (env, max(newest, joined))
        self.pool.forget(set(nodes))
        self._raylets = {n: r for n, r in self._raylets.items() if n in nodes}  # nodes gone: their clients too
        if not nodes:
            return
        addresses = {n["NodeID"]: f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}" for n in ray.nodes()
                     if n.get("Alive")}
        for node, (env, newest) in sorted(nodes.items()):
            if node not in addresses:
                continue
            raylet = self._raylets.get(node)
            if raylet is None or raylet.address != addresses[node]:
                raylet = self._raylets[node] = RayletSpares(addresses[node])
            start = self.pool.step(node, time.monotonic(), raylet.idle_workers(), newest)
            if start:
                raylet.prestart(env, start)
                log.info("warm spares: starting %d on node %s", start, node[:12])

    def leave_ingress(self, replica: str) -> None:
        """An Ingress replica that is stopping stops counting at once."""
        with self._lock:
            self.ingresses.pop(replica, None)

    def members(self, max_age_s: float = REPORT_MAX_AGE_S, ingress: str | None = None) -> dict:
        """The expert channel's members (replicas with an endpoint), its token, and `weights`:
        a digest of every expert version the replicas serve (it changes when a hot-swap commits
        or rolls back, not when experts move: the Ingress' prefix cache follows it).
        `ingress`: the polling Ingress replica, counted live until it stops polling for
        INGRESS_MAX_AGE_S; `ingress_replicas` is how many are."""
        now = time.monotonic()
        with self._lock:
            if ingress:
                self.ingresses[ingress] = now
            self.ingresses = {r: t for r, t in self.ingresses.items() if now - t <= INGRESS_MAX_AGE_S}
            live = len(self.ingresses)
        fresh = [st for _, st in self._fresh(max_age_s) if st.get("endpoint")]
        return {"token": self.token, "weights": weights_digest(fresh), "ingress_replicas": live,
                "members": [{**{k: st[k] for k in ("group", "replica", "endpoint", "experts")},
                             "local_endpoint": st.get("local_endpoint", ""), "node_id": st.get("node_id")}
                            for st in fresh]}


def weights_digest(reports: list[dict]) -> str:
    """One digest of the expert versions in replicas' reports (each expert's content digest)."""
    versions = sorted({(eid, str(v.get("digest", ""))) for st in reports
                       for eid, v in (st.get("versions") or {}).items()})
    return hashlib.sha256(json.dumps(versions).encode()).hexdigest()[:16]
