"""The Ingress' request router in Serve's proxy: prefix affinity (moe_workers.serve.proxy.prefix,
whose module doc says how), through Ray Serve's request-router extension point."""

from __future__ import annotations

import pickle
import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from moe_workers.serve.proxy.prefix import (IMBALANCE_THRESHOLD, MAX_PENDING, MAX_PREFIXES, PREFIX_HEADER,
                                            PrefixAffinity, parse_chain)


def request_chain(pending: PendingRequest) -> list[str]:
    """The x-moe-prefix chain of a request the proxy routes (its argument is Serve's pickled HTTP
    request, made by the proxy in this process; never anything a client sent)."""
    for arg in pending.args or ():
        if not isinstance(arg, bytes):
            continue
        try:
            scope = getattr(pickle.loads(arg), "asgi_scope", None)  # noqa: S301 - the proxy's own object
        except Exception:  # noqa: BLE001 - not a proxied HTTP request
            continue
        for name, value in (scope or {}).get("headers", ()):
            if name.lower() == PREFIX_HEADER:
                return parse_chain(value)
    return []


class PrefixAffinityRouter(RequestRouter):
    """Serve's request router for the Ingress (see the module doc)."""

    def initialize_state(self, imbalance_threshold: int = IMBALANCE_THRESHOLD, max_prefixes: int = MAX_PREFIXES):
        self.affinity = PrefixAffinity(max_prefixes, imbalance_threshold)
        self._chains: dict[str, list[str]] = {}  # internal request id -> its chain, until routed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        if pending_request is None:
            return [by_load]
        rid = pending_request.metadata.internal_request_id
        chain = self._chains.get(rid)
        if chain is None:
            if len(self._chains) >= MAX_PENDING:  # requests cancelled before they were routed
                del self._chains[next(iter(self._chains))]
            chain = self._chains[rid] = request_chain(pending_request)
        if not chain:
            return [by_load]
        names = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        load = {name: cache.get(r.replica_id) for name, r in names.items()}
        chosen = self.affinity.choose(chain, list(names), load)
        return [[names[chosen]], by_load] if chosen is not None else [by_load]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        chain = self._chains.pop(pending_request.metadata.internal_request_id, None)
        if chain:
            self.affinity.record(chain, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]):
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for gone in [r for r in self.affinity.held if r not in live]:
            self.affinity.forget(gone)
