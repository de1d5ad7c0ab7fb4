"""Ingress: the Serve deployment that wires the HTTP API, continuous batching and the dense part
of the model, and routes requests.

Here: the wiring (`__init__`: checkpoint, KV cache, expert channel, engine, tokenizer), the
user_config (`reconfigure`: placement, Ingress replicas, API keys), the channel's membership and
the admission capacity, the metrics thread, status, and the FastAPI routes. What every request
passes first (API key, body size) is `http_gate`; the OpenAI request path the routes delegate to
is `openai.serving.OpenAIServing` (answers spelt by `openai.render` as `openai.responses`); the
engine's scheduling and KV cache `moe_workers.engine` and `model.kv_cache`.

Per layer the engine hands the step's routed rows to `dispatch.ExpertDispatcher`, which picks a
copy of each expert by the placement in the user_config (ExpertRouter) and exchanges the rows
with every shard group at once on the expert channel (`moe_workers.transport`); membership of
the channel comes from the StatusBoard, so Serve's replica changes reach it without a restart.
"""


import os
import resource
import threading
import time
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle

from moe_workers.device import replica_device
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import DenseModel
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.serve.dispatch import BoardMembership, ExpertDispatcher
from moe_workers.serve.config import AUTO, AppArgs, admission_capacity, engine_queue_limit
from moe_workers.serve.ingress_scaling import KV_METRIC
from moe_workers.engine import Engine
from moe_workers.serve.memory import peak_rss_bytes
from moe_workers.serve.metrics import IngressMetrics
from moe_workers.serve.board import weights_digest
from moe_workers.serve.openai.chat import ChatTemplate
from moe_workers.serve.http_gate import install
from moe_workers.serve.openai.serving import OpenAIServing
from moe_workers.serve.openai.structured import Grammars
from moe_workers.serve.routing import ExpertRouter
from moe_workers.serve.routing_stats import RoutingStats
from moe_workers.serve.anomaly import Detector, Thresholds
from moe_workers.rfc3339 import format_rfc3339
from moe_workers.serve.node import ray_placement
from moe_workers.transport import ExpertChannel
from moe_workers.transport.realtime import Realtime

fastapi_app = FastAPI(title="moe-operator", docs_url=None, redoc_url=None)
install(fastapi_app)  # refusals in OpenAI's error object; the API key and body size checked first


@serve.deployment
@serve.ingress(fastapi_app)
class Ingress:
    """HTTP API, continuous batching, dense compute; experts through the expert channel."""

    def __init__(self, args: dict, shards: dict[str, DeploymentHandle], board: DeploymentHandle | None = None):
        self.args = AppArgs.model_validate(args)
        torch.set_num_threads(self.args.ingress_torch_threads)
        ckpt = Checkpoint(self.args.model_path, self.args.family)
        cfg = ckpt.config.with_dtype(self.args.dtype)
        self.device = replica_device()  # the GPU Ray assigned (spec.ingress.numGpus), else the CPU
        self.dense = DenseModel(cfg, ckpt.dense_state(), self.device)
        ckpt.close()
        self.max_len = min(self.args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.cache = PagedKVCache.for_budget(cfg, self.args.kv_cache_budget_bytes, self.max_len,
                                             self.args.kv_block_size, cfg.dtype, self.device,
                                             prefix_caching=self.args.prefix_caching)
        self.shards = shards  # bound so Serve deploys them; their traffic goes through the channel
        self.board = board
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id  # set before the channel's membership poll asks for it
        # the Ingress replicas running now: a fixed count from user_config, else (AUTO) the board's
        self.ingress_replicas: int | str = self.args.ingress_replicas
        self.live_ingress_replicas = 1
        self._weights: str | None = None  # the experts' versions the prefix cache was computed with
        self.quarantined: list[str] = []  # experts out of their routers' candidates (user_config "quarantine")
        membership = BoardMembership(board, self.replica, self._on_poll) if board is not None else None
        self.channel = ExpertChannel(membership, timeout_s=self.args.exchange_timeout_s,
                                     on_refused=membership.forget if membership is not None else None,
                                     node=ray_placement()[0] or "", local_sockets=self.args.local_channel,
                                     spin_s=self.args.exchange_spin_us / 1e6,
                                     wake_latency_us=self.args.wake_latency_us(),
                                     shared_memory=self.args.shared_memory_channel)
        self._group_tokens_exported: dict[str, int] = {}
        self._rerouted_exported: dict[int, int] = {}  # per layer, capacity reroutes already counted
        # the expert exchange; its placement is set by reconfigure(), which Serve calls right after __init__
        self.dispatcher = ExpertDispatcher(self.channel, self.dense.pick, cfg.sparse_layers, cfg.num_experts)
        self.routing_stats = RoutingStats(cfg.num_layers, cfg.num_experts, self.args.max_batch_size)
        self.routing_window: dict = {}
        self.detector = Detector()  # its thresholds from user_config "anomaly" (reconfigure)
        self.anomalies: list[dict] = []  # the detector's alerts after the last window
        self.detector_state: dict = {"ok": True, "reason": self.detector.status()}
        self.metrics = IngressMetrics(ctx.replica_id.deployment_id.app_name, self.replica)
        self.engine = Engine(self.dense, self.cache, self.dispatcher, self.args.max_batch_size,
                             engine_queue_limit(self.args), self.args.micro_batches,
                             self.args.micro_batch_min_tokens, routing_stats=self.routing_stats,
                             observer=self.metrics, realtime=Realtime(self.args.realtime_priority,
                                                               torch_threads=self.args.ingress_torch_threads),
                             max_num_batched_tokens=self.args.max_num_batched_tokens, max_len=self.max_len)
        threading.Thread(target=self._export_metrics, name="ingress-metrics", daemon=True).start()
        tok_file = Path(self.args.model_path) / "tokenizer.json"
        tokenizer = None
        if tok_file.is_file():
            from tokenizers import Tokenizer
            tokenizer = Tokenizer.from_file(str(tok_file))
        self.grammars = Grammars(tok_file if tok_file.is_file() else None, self.dense.cfg.vocab_size,
                                 self.dense.cfg.eos_token_id, self.dense.cfg.bos_token_id)
        # the OpenAI request path (the routes below delegate to it)
        self.serving = OpenAIServing(self.engine, self.args, self.dense.cfg, self.max_len, tokenizer,
                                     ChatTemplate.from_checkpoint(self.args.model_path), self.grammars, self.metrics)
        fastapi_app.state.max_request_bytes = self.args.max_request_bytes
        fastapi_app.state.metrics = self.metrics
        # generation requests all Ingress replicas hold (running + waiting): past it the proxy refuses
        self._size_admission()

    def reconfigure(self, config: dict) -> None:
        """user_config {"placement": {group: [L.E, ...]}} re-points routing without a restart;
        "quarantine" ([L.E, ...]) takes experts out of their routers' candidates and
        "capacity_factor" caps the choices an expert takes a call (each layer's router reads them
        from its next call on; the prefix cache is dropped);
        "ingress_replicas" (how many Ingress replicas the app runs now) resizes the capacity this
        replica announces to the proxy's admission gate, so scaling the Ingress restarts nothing;
        "anomaly" sets the routing anomaly detector's thresholds (`serve.anomaly.Thresholds`)."""
        placement = config.get("placement") or {}
        unknown = sorted(set(placement) - set(self.shards))
        if unknown:
            raise ValueError(f"placement names shard groups this app does not have: {', '.join(unknown)}")
        router = ExpertRouter(placement)
        missing = router.missing(self.dense.cfg.sparse_layers, self.dense.cfg.num_experts)
        if missing:
            raise ValueError(f"placement hosts no copy of experts {', '.join(missing[:10])}"
                             + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
        self.dispatcher.configure(router, int(config.get("prefetch_lookahead", 0)))
        self.detector.configure(Thresholds.from_dict(config.get("anomaly")))  # ValueError naming a setting
        quarantine = list(config.get("quarantine") or [])
        capacity = config.get("capacity_factor")
        if quarantine != self.quarantined or capacity != self.dense.capacity_factor:
            self.dense.quarantine(quarantine)  # ValueError naming an expert this model does not route
            self.quarantined = quarantine
            self.dense.capacity_factor = None if capacity is None else float(capacity)
            if getattr(self, "engine", None) is not None:
                self.engine.reset_prefix_cache()  # what it holds was computed by the routers as they were
        count = config.get("ingress_replicas", self.args.ingress_replicas)
        self.ingress_replicas = AUTO if count == AUTO else int(count)
        self._size_admission()
        fastapi_app.state.api_keys_sha256 = list(config.get("api_keys_sha256") or [])

    def _size_admission(self) -> None:
        """The capacity this replica announces to the proxy's admission gate: every Ingress
        replica's batch and wait queue, for the replicas there are (an autoscaled Ingress: those
        live now, so the gate follows Serve's autoscaler both ways)."""
        replicas = self.live_ingress_replicas if self.ingress_replicas == AUTO else self.ingress_replicas
        fastapi_app.state.admission_capacity = admission_capacity(self.args, replicas)

    def _on_poll(self, weights: str | None, live_ingress_replicas: int) -> None:
        """What the channel's membership poll brought besides the members (`BoardMembership`):
        the expert versions served now, and the Ingress replicas live (the admission gate's size)."""
        self._see_weights(weights)
        if live_ingress_replicas != self.live_ingress_replicas:
            self.live_ingress_replicas = live_ingress_replicas
            self._size_admission()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric: the share of this replica's KV cache blocks in use
        (moe_workers.serve.ingress_scaling)."""
        return {KV_METRIC: self.engine.kv_usage()}

    def __del__(self):
        """Serve is stopping this replica (scale-down, redeploy): it stops counting at once."""
        try:
            if self.board is not None:
                self.board.leave_ingress.remote(self.replica)
        except Exception:  # noqa: BLE001 - shutting down anyway; the board ages it out
            pass

    def _see_weights(self, digest: str | None) -> None:
        """The expert versions the shard replicas serve now (the StatusBoard's digest, from the
        channel's membership poll and from each status read): when they change (a hot-swap
        committed or rolled back), what the prefix cache holds was computed by other weights."""
        if digest is None or digest == self._weights:
            return
        engine = getattr(self, "engine", None)
        if self._weights is not None and engine is not None:
            engine.reset_prefix_cache()
        self._weights = digest

    def _export_metrics(self, every_s: float = 5.0, latencies_every_s: float = 1.0) -> None:
        """The engine's queued latencies every second; load and routing figures every `every_s`."""
        last = time.monotonic()
        while True:
            time.sleep(latencies_every_s)
            try:
                self.metrics.flush()
                self.metrics.phases(self.profile())
            except Exception:  # metrics never break serving
                pass
            if time.monotonic() - last < every_s:
                continue
            last = time.monotonic()
            try:
                self.metrics.load(self.engine_stats())
                self.metrics.channel(self.channel.stats)
                window = self._routing_window()
                if window.get("tokens") and any(window["tokens"]):
                    self.routing_window = window  # status shows the last window that saw traffic
                self.metrics.export(window)  # {} when it could not be read: nothing set
                router = self.dispatcher.router
                if router is not None:
                    for group, sent in list(router.sent.items()):
                        self.metrics.dispatched(group, sent - self._group_tokens_exported.get(group, 0))
                        self._group_tokens_exported[group] = sent
                for layer, n in list(self.dense.rerouted.items()):
                    self.metrics.rerouted(layer, n - self._rerouted_exported.get(layer, 0))
                    self._rerouted_exported[layer] = n
            except Exception:  # metrics never break serving; the next round retries
                pass

    def _routing_window(self) -> dict:
        """The routing window just ended (its per-expert and per-key counts left out), after the
        anomaly detector looked at it (on the metrics thread, never the step's path). What the
        detector cannot do is said in status ("detector": ok false and why), not skipped: the
        alerts it had stay until a window can be read again."""
        try:
            window = self.routing_stats.take()
            keys = window.pop("keys")
            found = self.detector.observe(window.pop("selected"), keys, format_rfc3339())
        except Exception as err:  # noqa: BLE001 - reported; the next window tries again
            self.detector_state = {"ok": False, "reason": f"cannot read the routing window: {type(err).__name__}: {err}"}
            return {}
        self.anomalies = [a.as_dict() for a in found]
        self.detector_state = {"ok": True, "reason": self.detector.status()}
        self.metrics.anomalies(self.anomalies)
        self.metrics.keys({key: sum(map(sum, layers.values())) for key, layers in keys.items()})
        return window

    # -- HTTP -----------------------------------------------------------------------------------

    @fastapi_app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(self):
        return self.serving.models()

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.serving.completions(request)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.serving.chat_completions(request)

    @fastapi_app.api_route("/moe/v1/status", methods=["GET", "HEAD"])
    async def moe_status(self):
        """Every shard replica's experts (version digest, tier, tokens), tiers, swaps; this
        ingress replica's engine. What the operator and moectl read."""
        replicas = await self.board.snapshot.remote() if self.board is not None else []
        if self.board is not None:
            self._see_weights(weights_digest([r for r in replicas if r.get("endpoint")]))
        spares = await self.board.spares.remote() if self.board is not None else {}
        router = self.dispatcher.router
        return {"model": self.args.served_model_name, "placement": router.placement if router else {},
                "prefetch_lookahead": self.dispatcher.prefetch_lookahead, "ingress": self.engine_stats(),
                "replicas": replicas,
                "admission_capacity": fastapi_app.state.admission_capacity,
                "ingress_replicas": {"configured": self.ingress_replicas, "live": self.live_ingress_replicas},
                "spares": spares,
                "channel": {"members": self.channel.members(), **self.channel.stats,
                            "last_membership_error": self.channel.last_membership_error,
                            "shared_memory": self.channel.shared_memory, "shm_error": self.channel.shm_error,
                            "wake_latency": self.channel.wake.status(),
                            "realtime": self.engine.realtime.status()},
                "routing": {**self.routing_window, "co_selected": self.routing_stats.co_selected_pairs(),
                            "quarantined": list(self.quarantined), "capacity_factor": self.dense.capacity_factor,
                            "capacity_rerouted": sum(self.dense.rerouted.values()), "anomalies": list(self.anomalies),
                            "detector": dict(self.detector_state),
                            "load": self.detector.load_report()}}

    def tune_channel(self, local: bool | None = None, spin_us: int | None = None,
                     wake_latency_us: int | None | str = "keep", realtime_priority: int | None = None,
                     shared_memory: bool | None = None) -> None:
        """Reach shard replicas on this node on their Unix sockets (local=True) or over TCP, and
        through shared memory over those sockets or not (shared_memory), from the next connection
        on; poll for small exchanges' replies for spin_us (0: sleep at once);
        ask for this CPU wake-up latency while exchanges run (None: never); run small steps at
        this real-time priority (0: the fair class). bench/serving.py compares the ways in one
        window."""
        if local is not None or shared_memory is not None:
            self.channel.use_local_sockets(self.channel.local_sockets if local is None else local, shared_memory)
        if spin_us is not None:
            self.channel.spin_s = max(0, spin_us) / 1e6
        if wake_latency_us != "keep":
            self.channel.wake.set_limit(wake_latency_us)
        if realtime_priority is not None:
            self.engine.realtime.set_priority(realtime_priority)

    def tune_steps(self, micro_batch_min_tokens: int) -> None:
        """Split steps of at least this many tokens into micro-batches from the next step on
        (AppArgs.micro_batch_min_tokens); bench/serving.py compares ping-pong on and off in one
        window."""
        self.engine.runner.micro_batch_min_tokens = max(1, micro_batch_min_tokens)

    def profile(self) -> dict:
        """The step's phases since start (`StepTimings.profile`), with the exchange's parts as
        "exchange.<part>" (`dispatch.ExchangeTimes`)."""
        profile = self.engine.timings.profile()
        profile["phases"].update({f"exchange.{p}": s for p, s in self.dispatcher.times.as_dict().items()})
        return profile

    def engine_stats(self) -> dict:
        """The engine's figures (`Engine.stats()`) and this replica's process: CPU time, peak RSS,
        the dense part's bytes, the grammar cache, and the expert versions the prefix cache holds.
        "profile": the step's phases (`profile()`): what `moectl profile` diffs."""
        stats = self.engine.stats()
        stats["profile"] = self.profile()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        stats["kv"]["weights"] = self._weights
        return {**stats, "cpu_s": usage.ru_utime + usage.ru_stime, "pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes(),
                "dense_bytes": self.dense.nbytes(), "grammars": self.grammars.stats()}


