"""The Ray Serve application: one Ingress (dense part + HTTP API) and ExpertShard deployments.

    serve run moe_workers.serve.app:build_app model_path=/models/m ...   (or a Serve config file
    with import_path moe_workers.serve.app:build_app and typed args; that is what the operator
    renders)
"""


import asyncio
import json
import os
import resource
import threading
import time
import uuid
import warnings
from collections import Counter as TokenCounter
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import DenseModel, KVCache
from moe_workers.model.layers import combine, expert_mlp, group_by_expert
from moe_workers.model.layers import route
from moe_workers.serve.config import INGRESS, AppArgs
from moe_workers.serve.engine import Engine, GenerationRequest, Overloaded
from moe_workers.serve.metrics import IngressMetrics, ShardMetrics
from moe_workers.serve.protocol import RequestError, parse_completion
from moe_workers.serve.routing import ExpertRouter
from moe_workers.serve.routing_stats import RoutingStats
from moe_workers.store.store import StoreFull, TierConfig, TieredExpertStore
from moe_workers.store.versions import CHECKPOINT, SwapError, load_expert_file


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def to_wire(t: torch.Tensor):
    """Tensors cross Ray as numpy arrays: Ray hands those over without copying them out of the
    object store (a pickled torch tensor is copied on both sides). bf16 has no numpy dtype, so
    it travels as its raw 16 bits."""
    if t.dtype == torch.bfloat16:
        return ("bf16", t.contiguous().view(torch.int16).numpy())
    return t.contiguous().numpy()


def from_wire(a) -> torch.Tensor:
    if isinstance(a, tuple):
        return _from_numpy(a[1]).view(torch.bfloat16)
    return _from_numpy(a)


def _from_numpy(a) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only buffer from the object store: we only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _expert_key(eid: str) -> tuple[int, int]:
    layer, expert = (int(p) for p in eid.split("."))
    return layer, expert


def _now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@serve.deployment(ray_actor_options={"num_cpus": 0.01})
class StatusBoard:
    """The latest status of every shard replica. A DeploymentHandle call reaches one replica of a
    deployment, not each, so every replica reports itself here (every 2 s and after each
    reconfigure) and the ingress serves the collection at GET /moe/v1/status."""

    def __init__(self):
        self.reports: dict[str, tuple[float, dict]] = {}

    def report(self, status: dict) -> None:
        self.reports[status["replica"]] = (time.monotonic(), status)

    def snapshot(self, max_age_s: float = 10.0) -> list[dict]:
        now = time.monotonic()
        self.reports = {r: v for r, v in self.reports.items() if now - v[0] <= max_age_s}  # gone replicas age out
        return [{**st, "age_s": round(now - t, 2)} for t, st in sorted(self.reports.values(),
                                                                       key=lambda v: (v[1]["group"], v[1]["replica"]))]


@serve.deployment
class ExpertShard:
    """Hosts the experts named in its user_config in a TieredExpertStore; computes them for the
    ingress. user_config: {"experts": [L.E, ...], "tiers": {...TierConfig}, "overrides":
    {L.E: {"path": ..., "sha256": ...}}}; changes apply in place (reconfigure)."""

    def __init__(self, model_path: str, dtype: str, torch_threads: int, allowed_weight_roots: list[str] | None = None,
                 board: DeploymentHandle | None = None):
        torch.set_num_threads(torch_threads)
        self.ckpt = Checkpoint(model_path)
        self.cfg = self.ckpt.config.with_dtype(dtype)
        self.allowed_roots = list(allowed_weight_roots or [])
        self.group = serve.get_replica_context().deployment
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.app = serve.get_replica_context().replica_id.deployment_id.app_name
        self.metrics = ShardMetrics(self.group, self.replica, self.app)
        self.store = TieredExpertStore(self.ckpt, self.cfg.dtype, TierConfig(), on_move=self.metrics.on_move)
        self.overrides: dict[str, dict] = {}  # applied: expert -> {"path", "sha256"}
        self.swaps: dict[str, dict] = {}  # last swap per expert, as status reports it
        self._swap_seq = 0
        self.load: TokenCounter = TokenCounter()
        self.compute_s = 0.0
        self.compute_cpu_s = 0.0  # CPU time of the calls themselves (compute_s is wall, time-sliced)
        self.calls = 0
        self._config_lock = threading.Lock()
        self._stop = threading.Event()
        self.board = board
        self._report_now = threading.Event()
        self.baseline_rss_bytes = current_rss_bytes()  # torch + Ray + this code, before any expert
        threading.Thread(target=self._maintain, name="store-maintenance", daemon=True).start()

    def reconfigure(self, config: dict) -> None:
        """Expert set and budgets first (new experts loaded before routing reaches them), then
        swaps and rollbacks. A refused swap is recorded, never raised: the old version serves."""
        with self._config_lock:
            keys = [_expert_key(eid) for eid in config.get("experts", [])]
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

    def _swap(self, eid: str, override: dict | None) -> None:
        key = _expert_key(eid)
        record = {"expert": eid, "started_at": _now_rfc3339(), "path": (override or {}).get("path", "checkpoint")}
        t0 = time.perf_counter()
        try:
            if override is None:
                version = self.store.swap(key, lambda: self.ckpt.expert(*key), CHECKPOINT)
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

    def forward(self, layer: int, x, experts: list[int], counts: list[int],
                prefetch: list[tuple[int, int]] | None = None):
        """Rows of x grouped by expert (`counts[i]` rows for `experts[i]`) -> their outputs."""
        t0, c0 = time.perf_counter(), time.thread_time()
        x = from_wire(x)
        keys = [(layer, e) for e in experts]
        out = torch.empty_like(x)
        with self.store.use(keys) as weights, torch.inference_mode():
            if prefetch:
                self.store.prefetch(prefetch)  # loads overlap this call's compute
            start = 0
            for key, n in zip(keys, counts):
                w = weights[key]
                expert_mlp(x[start:start + n], w["w1"], w["w2"], w["w3"], out=out[start:start + n])
                start += n
                self.load[key] += n
        self.metrics.tokens(layer, experts, counts)
        self.compute_s += time.perf_counter() - t0
        self.compute_cpu_s += time.thread_time() - c0
        self.calls += 1
        return to_wire(out)

    def _maintain(self) -> None:
        last_report = 0.0
        while not self._stop.is_set():
            asked = self._report_now.wait(1.0)
            self._report_now.clear()  # cleared first: a failing round must not turn this into a busy loop
            try:
                self.store.demote_idle()
                self.metrics.export(self.store)
                if self.board is not None and (asked or time.monotonic() - last_report >= 2.0):
                    self.board.report.remote(self.status())  # fire and forget: the next report supersedes it
                    last_report = time.monotonic()
            except Exception:  # keep maintaining; the next round retries
                pass

    def status(self) -> dict:
        versions = self.store.experts()
        for eid, v in versions.items():
            v["tokens"] = self.load.get(_expert_key(eid), 0)
        residency = self.store.residency()
        return {
            "group": self.group,
            "replica": self.replica,
            "pid": os.getpid(),
            "experts": sorted(versions, key=lambda eid: _expert_key(eid)),
            "versions": versions,
            "load": {f"{l}.{e}": n for (l, e), n in sorted(self.load.items())},
            "bytes": residency["hot"]["bytes"] + residency["warm"]["bytes"],
            "tiers": residency,
            "budgets": self.store.budgets(),
            "cold_error": self.store.cold_error,
            "store": self.store.stats.as_dict(),
            "swaps": dict(self.swaps),
            "compute_s": self.compute_s,
            "compute_cpu_s": self.compute_cpu_s,
            "calls": self.calls,
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_bytes": current_rss_bytes(),
            "baseline_rss_bytes": self.baseline_rss_bytes,
        }


fastapi_app = FastAPI(title="moe-operator", docs_url=None, redoc_url=None)


@fastapi_app.exception_handler(RequestError)
async def _request_error(_: Request, err: RequestError):
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


@serve.deployment
@serve.ingress(fastapi_app)
class Ingress:
    """HTTP API, continuous batching, dense compute; experts through the shard handles."""

    def __init__(self, args: dict, shards: dict[str, DeploymentHandle], board: DeploymentHandle | None = None):
        self.args = AppArgs.model_validate(args)
        torch.set_num_threads(self.args.ingress_torch_threads)
        ckpt = Checkpoint(self.args.model_path)
        cfg = ckpt.config.with_dtype(self.args.dtype)
        self.dense = DenseModel(cfg, ckpt.dense_state())
        ckpt.close()
        self.max_len = min(self.args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.cache = KVCache.for_budget(cfg, self.args.kv_cache_budget_bytes, self.max_len, cfg.dtype,
                                        max_slots=max(self.args.max_batch_size, 1) * 2)
        self.shards = shards
        self.board = board
        self.router: ExpertRouter | None = None  # set by reconfigure(), which Serve calls right after __init__
        self.prefetch_lookahead = 0
        self.routing_stats = RoutingStats(cfg.num_layers, cfg.num_experts, self.cache.num_slots)
        self.routing_window: dict = {}
        ctx = serve.get_replica_context()
        self.metrics = IngressMetrics(ctx.replica_id.deployment_id.app_name, ctx.replica_id.unique_id)
        self.engine = Engine(self.dense, self.cache, self._dispatch, self.args.max_batch_size,
                             self.args.max_queued_requests, self.args.micro_batches,
                             self.args.micro_batch_min_tokens, routing_stats=self.routing_stats)
        threading.Thread(target=self._export_routing, name="routing-metrics", daemon=True).start()
        tok_file = Path(self.args.model_path) / "tokenizer.json"
        self.tokenizer = None
        if tok_file.is_file():
            from tokenizers import Tokenizer
            self.tokenizer = Tokenizer.from_file(str(tok_file))

    def reconfigure(self, config: dict) -> None:
        """user_config {"placement": {group: [L.E, ...]}} re-points routing without a restart."""
        placement = config.get("placement") or {}
        unknown = sorted(set(placement) - set(self.shards))
        if unknown:
            raise ValueError(f"placement names shard groups this app does not have: {', '.join(unknown)}")
        router = ExpertRouter(placement)
        missing = router.missing(self.dense.cfg.num_layers, self.dense.cfg.num_experts)
        if missing:
            raise ValueError(f"placement hosts no copy of experts {', '.join(missing[:10])}"
                             + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
        self.router = router
        self.prefetch_lookahead = int(config.get("prefetch_lookahead", 0))

    def _export_routing(self, every_s: float = 5.0) -> None:
        while True:
            time.sleep(every_s)
            try:
                window = self.routing_stats.take()
                if any(t for t in window["tokens"]):
                    self.routing_window = window  # status shows the last window that saw traffic
                self.metrics.export(window)
            except Exception:  # metrics never break serving; the next round retries
                pass

    async def _dispatch(self, layer: int, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        groups = group_by_expert(indices)
        router = self.router
        if router is None:
            raise RuntimeError("no expert placement configured (user_config.placement)")
        assignment = router.assign(layer, {e: int(rows.numel()) for e, (rows, _) in groups.items()})
        hints = self._predict_next(layer, x) if self.prefetch_lookahead else {}
        calls = []
        for group, experts in assignment.items():
            rows = [groups[e][0] for e in experts]
            counts = [int(r.numel()) for r in rows]
            payload = to_wire(x[torch.cat(rows)] if len(rows) > 1 else x[rows[0]])  # one array per call
            tokens = sum(counts)
            router.begin(group, tokens)
            self.metrics.dispatched(group, tokens)
            calls.append((group, tokens, experts, counts,
                          self.shards[group].forward.remote(layer, payload, experts, counts, hints.get(group))))
        try:
            results = await asyncio.gather(*(c[-1] for c in calls))
        finally:
            for group, tokens, *_ in calls:
                router.end(group, tokens)
        outputs: dict[int, torch.Tensor] = {}
        for (_, _, experts, counts, _), out in zip(calls, results):
            for e, part in zip(experts, torch.split(from_wire(out), counts)):
                outputs[e] = part
        return combine(x.shape[0], x.shape[1], x.dtype, groups, outputs, weights)

    def _predict_next(self, layer: int, x: torch.Tensor) -> dict[str, list[tuple[int, int]]]:
        """Prefetch hints per group: the experts the next layers' routers would pick for this
        layer's normed hidden states (cheap: one small matmul per layer ahead)."""
        hints: dict[str, list[tuple[int, int]]] = {}
        cfg = self.dense.cfg
        for ahead in range(layer + 1, min(layer + 1 + self.prefetch_lookahead, cfg.num_layers)):
            predicted, _ = route(x, self.dense.layers[ahead]["gate"], cfg.top_k)
            for e in torch.unique(predicted).tolist():
                for group in self.router.hosts.get((ahead, e), []):
                    hints.setdefault(group, []).append((ahead, e))
        return hints

    # -- HTTP -----------------------------------------------------------------------------------

    @fastapi_app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{
            "id": self.args.served_model_name, "object": "model", "owned_by": "moe-operator",
            "max_model_len": self.max_len, "vocab_size": self.dense.cfg.vocab_size}]}

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(400, f"request body is not valid JSON: {err}")
        req = parse_completion(body)
        if req.model is not None and req.model != self.args.served_model_name:
            raise RequestError(404, f"model {req.model!r} is not served here (serving {self.args.served_model_name!r})",
                               param="model", err_type="model_not_found")
        ids = self._prompt_ids(req.prompt)
        if len(ids) + req.max_tokens > self.max_len:
            raise RequestError(400, f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) "
                               f"exceeds the context of {self.max_len} tokens", param="max_tokens")
        gen = GenerationRequest(prompt=ids, max_tokens=req.max_tokens, temperature=req.temperature,
                                top_p=req.top_p, seed=req.seed)
        try:
            self.engine.submit(gen)
        except Overloaded as err:
            raise RequestError(503, f"server overloaded: {err}; retry later", err_type="overloaded")
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if req.stream:
            return StreamingResponse(self._stream(gen, rid, created), media_type="text/event-stream")
        tokens = []
        while (tok := await gen.out.get()) is not None:
            tokens.append(tok)
        if gen.finish_reason and gen.finish_reason.startswith("error"):
            raise RequestError(500, gen.finish_reason, err_type="server_error")
        return {
            "id": rid, "object": "text_completion", "created": created, "model": self.args.served_model_name,
            "choices": [{"index": 0, "text": self._decode(tokens), "token_ids": tokens,
                         "finish_reason": gen.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                      "total_tokens": len(ids) + len(tokens)},
        }

    async def _stream(self, gen: GenerationRequest, rid: str, created: int):
        tokens: list[int] = []
        text_so_far = ""
        while (tok := await gen.out.get()) is not None:
            tokens.append(tok)
            text = self._decode(tokens)
            delta, text_so_far = text[len(text_so_far):], text
            chunk = {"id": rid, "object": "text_completion", "created": created, "model": self.args.served_model_name,
                     "choices": [{"index": 0, "text": delta, "token_ids": [tok], "finish_reason": None, "logprobs": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        final = {"id": rid, "object": "text_completion", "created": created, "model": self.args.served_model_name,
                 "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": gen.finish_reason, "logprobs": None}]}
        yield f"data: {json.dumps(final)}\n\n"
        yield "data: [DONE]\n\n"

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        vocab = self.dense.cfg.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(400, "prompt: this checkpoint has no tokenizer.json; send the prompt as a "
                                   "list of token ids", param="prompt")
            return self.tokenizer.encode(prompt).ids
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        return list(prompt)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

    @fastapi_app.get("/moe/v1/status")
    async def moe_status(self):
        """Every shard replica's experts (version digest, tier, tokens), tiers, swaps; this
        ingress replica's engine. What the operator and moectl read."""
        replicas = await self.board.snapshot.remote() if self.board is not None else []
        return {"model": self.args.served_model_name, "placement": self.router.placement if self.router else {},
                "prefetch_lookahead": self.prefetch_lookahead, "ingress": self.engine_stats(), "replicas": replicas,
                "routing": {**self.routing_window, "co_selected": self.routing_stats.co_selected_pairs()}}

    def engine_stats(self) -> dict:
        t = self.engine.timings
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"steps": t.steps, "tokens": t.tokens, "dense_s": t.dense, "dense_cpu_s": t.dense_cpu,
                "experts_s": t.experts, "cpu_s": usage.ru_utime + usage.ru_stime,
                "running": len(self.engine.running), "waiting": len(self.engine.waiting),
                "kv_slots": self.cache.num_slots, "kv_free": self.cache.free_slots, "pid": os.getpid(),
                "peak_rss_bytes": peak_rss_bytes(), "dense_bytes": self.dense.nbytes(),
                "kv_cache_bytes": self.cache.k.numel() * self.cache.k.element_size() * 2}


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
                                                           args.allowed_weight_roots, board)
    options = {"name": INGRESS, "num_replicas": args.ingress_replicas,
               "ray_actor_options": {"num_cpus": args.ingress_num_cpus},
               "max_ongoing_requests": max(1000, args.max_batch_size + args.max_queued_requests + 16)}
    if args.placement is not None:
        options["user_config"] = {"placement": placement}
    return Ingress.options(**options).bind(args.model_copy(update={"placement": None}).model_dump(), shards, board)
