"""Per-replica metrics of an ExpertShard, exported through Ray's metrics (Prometheus format on
each node's metrics export port). Best effort: serving never fails because of a metric."""

from __future__ import annotations

import threading
import time
from collections import deque

from moe_workers.step_profile import per_step
from moe_workers.store.store import TIERS


class ShardMetrics:
    def __init__(self, group: str, replica: str, app: str = ""):
        self.group, self.replica, self.app = group, replica, app
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        try:
            from ray.util.metrics import Counter, Gauge, Histogram
        except Exception:  # not inside Ray (unit use): record nothing
            self.enabled = False
            return
        self.enabled = True
        tags = ("app", "group", "replica")  # app: several MoEDeployments may share a Ray cluster
        self.expert_tokens = Counter("moe_expert_tokens", description="Tokens routed to each expert.",
                                     tag_keys=("layer", "expert", "group", "app"))
        self.replica_tokens = Counter("moe_replica_tokens", description="Expert-tokens computed by each shard replica.",
                                      tag_keys=tags)
        self.tier_bytes = Gauge("moe_tier_bytes", description="Bytes of expert weights resident per tier.",
                                tag_keys=tags + ("tier",))
        self.tier_experts = Gauge("moe_tier_experts", description="Experts resident per tier.", tag_keys=tags + ("tier",))
        self.tier_budget = Gauge("moe_tier_budget_bytes", description="Byte budget per tier.", tag_keys=tags + ("tier",))
        self.hits = Counter("moe_tier_hits", description="Lookups served by a tier.", tag_keys=tags + ("tier",))
        self.misses = Counter("moe_tier_misses", description="Lookups a tier could not serve.", tag_keys=tags + ("tier",))
        self.moved = Counter("moe_tier_moved_bytes", description="Bytes moved between tiers.",
                             tag_keys=tags + ("src", "dst"))
        self.promotion = Histogram("moe_tier_promotion_seconds", description="Time to move one expert up a tier.",
                                   boundaries=[0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10],
                                   tag_keys=tags + ("src", "dst"))
        self.prefetch_issued = Counter("moe_prefetch_issued", description="Experts promoted by prefetch hints.",
                                       tag_keys=tags)
        self.prefetch_used = Counter("moe_prefetch_used", description="Prefetched experts used before eviction.",
                                     tag_keys=tags)
        self.hint_accuracy = Gauge("moe_prefetch_hint_accuracy",
                                   description="Share of recent prefetch hints the layer's next call used.",
                                   tag_keys=tags)
        self.swaps = Counter("moe_hotswaps", description="Hot-swaps by outcome.", tag_keys=tags + ("outcome",))
        self.latency_p95 = Gauge("moe_expert_latency_p95_seconds", description="An expert's compute time on this "
                                 "replica, 95th percentile of its last 64 sampled calls (one call in 16 is timed an "
                                 "expert at a time).", tag_keys=("layer", "expert", "group", "app"))
        self.expert_misses = Counter("moe_expert_misses", description="Calls that found an expert out of the hot "
                                     "tier and waited for its promotion, per expert.",
                                     tag_keys=("layer", "expert", "group", "app"))
        self._exported_misses: dict[tuple[int, int], int] = {}
        self.swap_seconds = Histogram("moe_hotswap_seconds", description="Hot-swap duration, request to serving.",
                                      boundaries=[0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30], tag_keys=tags)

    def _tags(self, **extra) -> dict:
        return {"app": self.app, "group": self.group, "replica": self.replica, **extra}

    def tokens(self, layer: int, experts: list[int], counts: list[int]) -> None:
        if not self.enabled:
            return
        for e, n in zip(experts, counts):
            self.expert_tokens.inc(n, tags={"layer": str(layer), "expert": str(e), "group": self.group, "app": self.app})
        self.replica_tokens.inc(sum(counts), tags=self._tags())

    def latency(self, p95: dict[tuple[int, int], float]) -> None:
        """Each sampled expert's p95 compute seconds (`ExpertHealth.fresh_p95_seconds`), on the
        export thread."""
        if not self.enabled:
            return
        for (layer, e), seconds in p95.items():
            self.latency_p95.set(seconds, tags={"layer": str(layer), "expert": str(e), "group": self.group,
                                                "app": self.app})

    def on_move(self, src: str, dst: str, seconds: float, nbytes: int) -> None:
        if not self.enabled:
            return
        if nbytes:
            self.moved.inc(nbytes, tags=self._tags(src=src, dst=dst))
        if TIERS.index(dst) < (TIERS.index(src) if src in TIERS else 3):
            self.promotion.observe(seconds, tags=self._tags(src=src, dst=dst))

    def swap(self, record: dict) -> None:
        if not self.enabled:
            return
        self.swaps.inc(1, tags=self._tags(outcome=record["outcome"]))
        if record["outcome"] != "Failed":
            self.swap_seconds.observe(record["duration_s"], tags=self._tags())

    def export(self, store) -> None:
        """Gauges from the store's current state; counters by their increase since last export."""
        if not self.enabled:
            return
        for tier, r in store.residency().items():
            self.tier_bytes.set(r["bytes"], tags=self._tags(tier=tier))
            self.tier_experts.set(r["experts"], tags=self._tags(tier=tier))
        for tier, b in store.budgets().items():
            if b is not None:
                self.tier_budget.set(b, tags=self._tags(tier=tier))
        st = store.stats
        if st.hint_accuracy is not None:
            self.hint_accuracy.set(st.hint_accuracy, tags=self._tags())
        with self._lock:
            for tier in TIERS:
                self._inc(self.hits, f"hit.{tier}", st.hits[tier], tier=tier)
                self._inc(self.misses, f"miss.{tier}", st.misses[tier], tier=tier)
            self._inc(self.prefetch_issued, "pf.issued", st.prefetch_issued)
            self._inc(self.prefetch_used, "pf.used", st.prefetch_used)
            for (layer, e), n in store.misses_by_key().items():  # by their increase: only experts that missed
                delta = n - self._exported_misses.get((layer, e), 0)
                if delta > 0:
                    self.expert_misses.inc(delta, tags={"layer": str(layer), "expert": str(e), "group": self.group,
                                                        "app": self.app})
                self._exported_misses[(layer, e)] = n

    def _inc(self, counter, name: str, total: float, **tags) -> None:
        delta = total - self._last.get(name, 0)
        if delta > 0:
            counter.inc(delta, tags=self._tags(**tags))
        self._last[name] = total


PHASE_BOUNDS = [0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1]
LATENCY_BOUNDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class IngressMetrics:
    """Serving latency and load per ingress replica (the engine's Observer), and the router's
    behaviour (see routing_stats): gauges over the last export window, plus load per shard group
    as the ingress dispatched it."""

    def __init__(self, app: str, replica: str):
        self.app, self.replica = app, replica
        self._queued: deque = deque()  # (record, value, tags) the engine reported, not yet recorded
        try:
            from ray.util.metrics import Counter, Gauge, Histogram
        except Exception:
            self.enabled = False
            return
        self.enabled = True
        tags = ("app", "replica")
        self.ttft = Histogram("moe_time_to_first_token_seconds", description="Submission to first generated token.",
                              boundaries=LATENCY_BOUNDS, tag_keys=tags)
        self.itl = Histogram("moe_inter_token_latency_seconds", description="Between consecutive tokens of a sequence.",
                             boundaries=LATENCY_BOUNDS, tag_keys=tags)
        self.e2e = Histogram("moe_request_latency_seconds", description="Submission to the end of a sequence.",
                             boundaries=LATENCY_BOUNDS, tag_keys=tags + ("finish_reason",))
        self.prompt_tokens = Counter("moe_prompt_tokens", description="Prompt tokens of finished sequences.",
                                     tag_keys=tags)
        self.generation_tokens = Counter("moe_generation_tokens", description="Tokens generated.", tag_keys=tags)
        self.running = Gauge("moe_requests_running", description="Sequences in the running batch.", tag_keys=tags)
        self.waiting = Gauge("moe_requests_waiting", description="Sequences waiting for KV cache space.", tag_keys=tags)
        self.kv_used = Gauge("moe_kv_cache_used_bytes", description="KV cache bytes held by sequences.", tag_keys=tags)
        self.kv_budget = Gauge("moe_kv_cache_budget_bytes", description="KV cache bytes of this replica.", tag_keys=tags)
        self.kv_blocks_used = Gauge("moe_kv_cache_blocks_used", description="KV cache blocks held by sequences.",
                                    tag_keys=tags)
        self.kv_blocks = Gauge("moe_kv_cache_blocks", description="KV cache blocks of this replica.", tag_keys=tags)
        self.prefix_queried = Counter("moe_prefix_cache_queried_tokens", description="Prompt tokens looked up in the "
                                      "prefix cache at admission.", tag_keys=tags)
        self.prefix_hits = Counter("moe_prefix_cache_hit_tokens", description="Prompt tokens found computed in the "
                                   "prefix cache (not computed again).", tag_keys=tags)
        self.preemptions = Counter("moe_preemptions", description="Sequences preempted for KV cache blocks (their "
                                   "tokens computed again later).", tag_keys=tags)
        self.attention_fallbacks = Counter("moe_attention_fallbacks", description="Times decode attention left "
                                           "its configured path (flex) for the gather; status says why.",
                                           tag_keys=tags)
        self.chunked_prefills = Counter("moe_chunked_prefills", description="Prompts prefilled over more than one "
                                        "step (spec.ingress.maxNumBatchedTokens).", tag_keys=tags)
        self._last: dict[str, int] = {}
        self.rejected = Counter("moe_requests_rejected", description="Requests refused before work: 503 (queue full), "
                                "401 (API key).", tag_keys=tags + ("code",))
        self.entropy = Gauge("moe_routing_entropy", description="Entropy of expert selection / log(experts), per layer "
                             "(1: uniform).", tag_keys=tags + ("layer",))
        self.activation = Gauge("moe_activation_rate", description="Experts a step activates over all experts "
                                "(share of expert parameters touched per step).", tag_keys=tags)
        self.switching = Gauge("moe_expert_switch_rate", description="Share of consecutive tokens of a sequence whose "
                               "top-1 expert changes, per layer.", tag_keys=tags + ("layer",))
        self.anomaly = Gauge("moe_routing_anomaly", description="1 while the routing anomaly detector alerts on a "
                             "layer's expert (kind surge or entropy), 0 once it cleared.",
                             tag_keys=tags + ("layer", "expert", "kind", "key"))
        self._anomalies: set[tuple[str, str, str, str]] = set()  # the alerts set to 1 last time
        self.key_tokens = Counter("moe_key_expert_tokens", description="Expert-tokens routed for each API key id "
                                  "(first 8 hex of the key's SHA-256; '-' without a key; at most 32 ids a window apart, "
                                  "the rest as 'other').", tag_keys=tags + ("key",))
        self.step_phase = Histogram("moe_step_phase_seconds", description="A step's time in each phase (attention, "
                                    "router, exchange, exchange.wait, ...): each second, the mean a step over that "
                                    "second's steps (one observation a second, not one a step).",
                                    boundaries=PHASE_BOUNDS, tag_keys=tags + ("phase",))
        self._profile: dict | None = None
        self.group_tokens = Counter("moe_group_tokens", description="Expert-tokens the ingress sent to each shard group.",
                                    tag_keys=tags + ("group",))
        self.shm_fallbacks = Counter("moe_channel_shm_fallbacks", description="Connections to a shard replica on "
                                     "this node that stayed on the Unix socket because a shared-memory segment could "
                                     "not be made or was refused (status: channel.shm_error says why).",
                                     tag_keys=tags)
        self.capacity_rerouted = Counter("moe_capacity_rerouted_tokens", description="Tokens routed again because "
                                         "an expert they chose was full (spec.routing.capacityFactor), per layer.",
                                         tag_keys=tags + ("layer",))

    def export(self, window: dict) -> None:
        if not self.enabled:
            return
        base = {"app": self.app, "replica": self.replica}
        for layer, v in enumerate(window.get("entropy") or []):
            if v is not None:
                self.entropy.set(v, tags={**base, "layer": str(layer)})
        for layer, v in enumerate(window.get("switching_rate") or []):
            if v is not None:
                self.switching.set(v, tags={**base, "layer": str(layer)})
        if window.get("activation_rate") is not None:
            self.activation.set(window["activation_rate"], tags=base)

    def anomalies(self, active: list[dict]) -> None:
        """moe_routing_anomaly: 1 for each alert now, 0 for those that cleared since the last call
        (the key's id is a label: at most one series per alert, so the cardinality stays that of
        the alerts)."""
        if not self.enabled:
            return
        now = {(str(a["layer"]), str(a["expert"]), a["kind"], a["key"]) for a in active}
        for labels in self._anomalies | now:
            tags = {**self._base(), **dict(zip(("layer", "expert", "kind", "key"), labels))}
            self.anomaly.set(1 if labels in now else 0, tags=tags)
        self._anomalies = now

    def keys(self, tokens: dict[str, int]) -> None:
        """moe_key_expert_tokens by each key id's expert-tokens in the window."""
        if self.enabled:
            for key, n in tokens.items():
                if n:
                    self.key_tokens.inc(n, tags={**self._base(), "key": key})

    # -- the engine's Observer ----------------------------------------------------------------
    # A Ray metric's record costs 50-175 us (its C++ side, under the GIL): one per token on the
    # step's path cost a batch-1 decode step more than a layer's expert exchange, and a batch-64
    # step 64 of them. The engine's calls only queue the value; `flush()`, on the ingress'
    # metrics thread, records them.

    def first_token(self, seconds: float) -> None:
        if self.enabled:
            self._queued.append((self.ttft.observe, seconds, self._base()))

    def inter_token(self, seconds: float) -> None:
        if self.enabled:
            self._queued.append((self.itl.observe, seconds, self._base()))

    def finished(self, req, seconds: float) -> None:
        if not self.enabled:
            return
        reason = str(req.finish_reason or "")
        self._queued.append((self.e2e.observe, seconds, {**self._base(), "finish_reason": reason}))
        self._queued.append((self.prompt_tokens.inc, len(req.prompt), self._base()))
        if req.produced:
            self._queued.append((self.generation_tokens.inc, len(req.produced), self._base()))

    def flush(self) -> int:
        """Record what the engine queued; the count. Offers the GIL to the step thread between
        records (a record holds it throughout)."""
        n = 0
        while self._queued:
            record, value, tags = self._queued.popleft()
            record(value, tags=tags)
            n += 1
            if n % 4 == 0:
                time.sleep(0)
        return n

    def load(self, engine: dict) -> None:
        """Gauges and counters from the Ingress' engine_stats() (counters by their increase)."""
        if not self.enabled:
            return
        base, kv = self._base(), engine["kv"]
        self.running.set(engine["running"], tags=base)
        self.waiting.set(engine["waiting"], tags=base)
        self.kv_used.set(kv["blocks_used"] * kv["block_bytes"], tags=base)
        self.kv_budget.set(kv["bytes"], tags=base)
        self.kv_blocks_used.set(kv["blocks_used"], tags=base)
        self.kv_blocks.set(kv["blocks_total"], tags=base)
        for counter, name in ((self.prefix_queried, "prefix_queried_tokens"), (self.prefix_hits, "prefix_hit_tokens"),
                              (self.preemptions, "preemptions"), (self.chunked_prefills, "chunked_prefills"),
                              (self.attention_fallbacks, "attention_fallbacks")):
            delta = kv[name] - self._last.get(name, 0)
            if delta > 0:
                counter.inc(delta, tags=base)
            self._last[name] = kv[name]

    def channel(self, stats: dict) -> None:
        """Counters from the expert channel's stats (by their increase)."""
        if not self.enabled:
            return
        delta = stats["shm_fallbacks"] - self._last.get("shm_fallbacks", 0)
        if delta > 0:
            self.shm_fallbacks.inc(delta, tags=self._base())
        self._last["shm_fallbacks"] = stats["shm_fallbacks"]

    def phases(self, profile: dict) -> None:
        """Each phase's mean seconds a step since the last call (`step_profile.per_step`), one
        observation a phase: on the metrics thread each second, never on the step's path."""
        if not self.enabled:
            return
        steps, means = per_step(self._profile, profile)
        self._profile = profile
        for phase, seconds in means.items():
            self.step_phase.observe(seconds, tags={**self._base(), "phase": phase})

    def reject(self, code: int) -> None:
        if self.enabled:
            self.rejected.inc(1, tags={**self._base(), "code": str(code)})

    def _base(self) -> dict:
        return {"app": self.app, "replica": self.replica}

    def rerouted(self, layer: int, tokens: int) -> None:
        if self.enabled and tokens:
            self.capacity_rerouted.inc(tokens, tags={"app": self.app, "replica": self.replica, "layer": str(layer)})

    def dispatched(self, group: str, tokens: int) -> None:
        if self.enabled and tokens:
            self.group_tokens.inc(tokens, tags={"app": self.app, "replica": self.replica, "group": group})
