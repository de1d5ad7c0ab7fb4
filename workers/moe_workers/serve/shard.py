"""ExpertShard: one Serve deployment per shard group; each replica hosts the group's experts.

Serve manages the replicas (start, restart, scale, `reconfigure()` with the expert set, tier
budgets and hot-swaps); the per-layer traffic arrives on the replica's expert channel
(`moe_workers.transport`), whose endpoint the replica reports to the StatusBoard.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter as TokenCounter

import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from moe_workers.device import replica_device
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.serve.expert_call import compute_call
from moe_workers.serve.expert_health import ExpertHealth
from moe_workers.serve.cpus import CpuClaim
from moe_workers.expert_ids import expert_key
from moe_workers.rfc3339 import format_rfc3339
from moe_workers.serve.memory import current_rss_bytes, peak_rss_bytes
from moe_workers.serve.metrics import ShardMetrics
from moe_workers.serve.node import node_address, ray_placement
from moe_workers.store.store import StoreFull, TierConfig, TieredExpertStore
from moe_workers.store.versions import CHECKPOINT, SwapError, load_expert_file
from moe_workers.transport import ExchangeServer

DRAIN_GRACE_S = 2.0  # a stopping replica finishes the requests it is computing for at most this long


@serve.deployment
class ExpertShard:
    """Hosts the experts named in its user_config in a TieredExpertStore; computes them for the
    ingress. user_config: {"experts": [L.E, ...], "tiers": {...TierConfig}, "overrides":
    {L.E: {"path": ..., "sha256": ...}}}; changes apply in place (reconfigure)."""

    def __init__(self, model_path: str, dtype: str, torch_threads: int, allowed_weight_roots: list[str] | None = None,
                 board: DeploymentHandle | None = None, family: str | None = None,
                 wake_latency_us: int | None = None, pin_cpus: bool = True, realtime_priority: int = 0,
                 shm_spin_us: int = 0):
        torch.set_num_threads(torch_threads)
        self.cpu_claim = CpuClaim()
        if pin_cpus:  # before any thread of ours starts: they inherit it
            self.cpu_claim.take(torch_threads)
        else:
            self.cpu_claim.reason = "not asked (pinCpus false)"
        self.ckpt = Checkpoint(model_path, family)
        self.cfg = self.ckpt.config.with_dtype(dtype)
        self.allowed_roots = list(allowed_weight_roots or [])
        ctx = serve.get_replica_context()
        self.group = ctx.deployment
        self.replica = ctx.replica_id.unique_id
        self.app = ctx.replica_id.deployment_id.app_name
        self.metrics = ShardMetrics(self.group, self.replica, self.app)
        # the hot tier on the GPU Ray assigned (spec.experts.numGpus), else host memory
        self.store = TieredExpertStore(self.ckpt, self.cfg.dtype, TierConfig(), device=replica_device(),
                                       on_move=self.metrics.on_move)
        self.overrides: dict[str, dict] = {}  # applied: expert -> {"path", "sha256"}
        self.swaps: dict[str, dict] = {}  # last swap per expert, as status reports it
        self._swap_seq = 0
        self.load: TokenCounter = TokenCounter()
        self._exported_load: TokenCounter = TokenCounter()
        self._load_lock = threading.Lock()
        self.compute_s = 0.0
        self.compute_cpu_s = 0.0  # CPU time of the calls themselves (compute_s is wall, time-sliced)
        self.calls = 0
        self.health = ExpertHealth()  # sampled compute latency and errors per expert
        self._config_lock = threading.Lock()
        self._stop = threading.Event()
        self.board = board
        self._tokens: list[str] = []  # channel tokens accepted (from the board)
        self._report_now = threading.Event()
        self.node_id, self.runtime_env = ray_placement()
        self.baseline_rss_bytes = current_rss_bytes()  # torch + Ray + this code, before any expert
        self.channel = ExchangeServer(self._compute, lambda: self._tokens, host=node_address(),
                                      torch_threads=torch_threads, wake_latency_us=wake_latency_us,
                                      realtime_priority=realtime_priority, shm_spin_s=shm_spin_us / 1e6)
        threading.Thread(target=self._maintain, name="store-maintenance", daemon=True).start()

    def reconfigure(self, config: dict) -> None:
        """Expert set and budgets first (new experts loaded before routing reaches them), then
        swaps and rollbacks. A refused swap is recorded, never raised: the old version serves."""
        with self._config_lock:
            keys = [expert_key(eid) for eid in config.get("experts", [])]
            self.store.configure(keys, TierConfig.from_dict(config.get("tiers")))
            hosted = {f"{l}.{e}" for l, e in keys}
            wanted = {eid: o for eid, o in (config.get("overrides") or {}).items() if eid in hosted}
            for eid in sorted(set(self.overrides) - set(wanted)):
                if eid in hosted:
                    self._swap(eid, None)
                self.overrides.pop(eid, None)
            for eid, o in sorted(wanted.items()):
                if self.overrides.get(eid) != o:
                    self._swap(eid, o)
        self._report_now.set()

    def tune_channel(self, wake_latency_us: int | None, realtime_priority: int | None = None,
                     shm_spin_us: int | None = None) -> None:
        """Ask for this CPU wake-up latency while requests come (None: never), run small
        requests at this real-time priority (0: the fair class; None: keep), and poll a shared-
        memory connection for its next request this long before sleeping (None: keep);
        bench/serving.py compares the ways in one window."""
        self.channel.wake.set_limit(wake_latency_us)
        if realtime_priority is not None:
            self.channel.realtime.set_priority(realtime_priority)
        if shm_spin_us is not None:
            self.channel.shm_spin_s = max(0, shm_spin_us) / 1e6

    def check_health(self) -> None:
        """Serve restarts a replica whose channel stopped accepting connections."""
        if not self.channel.alive():
            raise RuntimeError("the expert channel's listener stopped")

    def __del__(self):
        """Serve is stopping this replica (scale-down, redeploy): leave the board, answer new
        channel requests DRAINING (the ingress sends them to another replica) and let the ones
        being computed finish."""
        try:
            self.channel.drain()
            self._stop.set()
            self.cpu_claim.release()
            if self.board is not None:
                self.board.leave.remote(self.replica)
            deadline = time.monotonic() + DRAIN_GRACE_S
            while self.channel.busy and time.monotonic() < deadline:
                time.sleep(0.01)
            self.channel.close()
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass

    def _swap(self, eid: str, override: dict | None) -> None:
        key = expert_key(eid)
        record = {"expert": eid, "started_at": format_rfc3339(), "path": (override or {}).get("path", "checkpoint")}
        t0 = time.perf_counter()
        try:
            if override is None:
                version = self.store.swap(key, lambda: self.ckpt.expert_stored(*key), CHECKPOINT)
                record["outcome"] = "RolledBack"
            else:
                version = self.store.swap(key, lambda: load_expert_file(
                    override["path"], *key, self.ckpt.config, self.allowed_roots, override.get("sha256")),
                    override["path"])
                record["outcome"] = "Serving"
                self.overrides[eid] = override
            record["digest"] = version.digest
        except (SwapError, StoreFull, OSError) as err:
            record.update(outcome="Failed", reason=str(err), digest=self.store.experts()[eid]["digest"])
            if override is not None:
                self.overrides[eid] = override  # applied = attempted: the same spec is not retried in a loop
        record["duration_s"] = round(time.perf_counter() - t0, 4)
        self._swap_seq += 1
        record["seq"] = self._swap_seq  # lets a watcher tell a new attempt from an old record
        self.swaps[eid] = record
        self.metrics.swap(record)

    def _compute(self, layer: int, x: torch.Tensor, experts: list[int], counts: list[int],
                 prefetch: list[tuple[int, int]], out: torch.Tensor, top1: list[int] | None = None) -> None:
        """Rows of x grouped by expert (`counts[i]` rows for `experts[i]`) -> their outputs in
        `out` (a channel request; runs on the connection's thread); `top1[i]`: how many of those
        rows chose the expert first (for the store's policy). No inference-mode entry:
        neither the rows nor the weights require grad, so nothing is recorded without one, and
        entering it costs tens of microseconds a request between a replica's idle gaps."""
        t0, c0 = time.perf_counter(), time.thread_time()
        keys = [(layer, e) for e in experts]
        first = [k for k, n in zip(keys, top1) if n] if top1 is not None else ()
        timer = self.health.record if self.health.sample_next() else None
        try:
            compute_call(self.store, self.cfg, keys, counts, first, prefetch, x, out, timer)
        except BaseException:
            self.health.failed(keys)
            raise
        with self._load_lock:
            for key, n in zip(keys, counts):
                self.load[key] += n
            self.compute_s += time.perf_counter() - t0
            self.compute_cpu_s += time.thread_time() - c0
            self.calls += 1

    def _export_load(self) -> None:
        """Token counters to Ray's metrics, by their increase since the last export (off the
        request path: a metric call per expert per layer would cost more than the compute)."""
        with self._load_lock:
            now = dict(self.load)
        by_layer: dict[int, tuple[list[int], list[int]]] = {}
        for (layer, e), n in sorted(now.items()):
            delta = n - self._exported_load.get((layer, e), 0)
            if delta > 0:
                experts, counts = by_layer.setdefault(layer, ([], []))
                experts.append(e)
                counts.append(delta)
        for layer, (experts, counts) in by_layer.items():
            self.metrics.tokens(layer, experts, counts)
        self._exported_load = TokenCounter(now)

    def _maintain(self) -> None:
        last_report = 0.0
        while not self._stop.is_set():
            asked = self._report_now.wait(1.0)
            self._report_now.clear()  # cleared first: a failing round must not turn this into a busy loop
            try:
                self.store.demote_idle()
                self._export_load()
                self.metrics.export(self.store)
                self.metrics.latency(self.health.fresh_p95_seconds())
                if self.board is not None and (asked or time.monotonic() - last_report >= 2.0):
                    token = self.board.report.remote(self.status()).result(timeout_s=10)
                    if token not in self._tokens:
                        self._tokens = [token, *self._tokens[:1]]  # the previous one stays valid for a while
                    last_report = time.monotonic()
            except Exception:  # keep maintaining; the next round retries
                pass

    def status(self) -> dict:
        """What the StatusBoard relays into /moe/v1/status "replicas": experts (versions, tiers,
        tokens), per expert health (`ExpertHealth.report`: sampled p95, hot misses, errors),
        the store's figures (promotion waits included), compute and channel totals."""
        versions = self.store.experts()
        with self._load_lock:
            load = dict(self.load)
        for eid, v in versions.items():
            v["tokens"] = load.get(expert_key(eid), 0)
        residency = self.store.residency()
        return {
            "group": self.group,
            "replica": self.replica,
            "pid": os.getpid(),
            "cpu_affinity": self.cpu_claim.status(),
            "node_id": self.node_id,
            "runtime_env": self.runtime_env,
            "endpoint": self.channel.endpoint,
            "local_endpoint": self.channel.local_endpoint,
            "experts": sorted(versions, key=expert_key),
            "versions": versions,
            "load": {f"{l}.{e}": n for (l, e), n in sorted(load.items())},
            "bytes": residency["hot"]["bytes"] + residency["warm"]["bytes"],
            "tiers": residency,
            "budgets": self.store.budgets(),
            "cold_error": self.store.cold_error,
            "store": self.store.stats.as_dict(),
            "policy": self.store.policy_report(),
            "swaps": dict(self.swaps),
            "health": self.health.report([expert_key(eid) for eid in versions], self.store.misses_by_key()),
            "compute_s": self.compute_s,
            "compute_cpu_s": self.compute_cpu_s,
            "calls": self.calls,
            "channel": {"requests": self.channel.requests, "errors": self.channel.errors,
                        "handle_s": self.channel.handle_s, "wake_latency": self.channel.wake.status(),
                        "realtime": self.channel.realtime.status(),
                        "connections": self.channel.connections(), "last_error": self.channel.last_error,
                        "shm_connections": self.channel.shm_connections, "shm_refused": self.channel.shm_refused},
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_bytes": current_rss_bytes(),
            "baseline_rss_bytes": self.baseline_rss_bytes,
        }
