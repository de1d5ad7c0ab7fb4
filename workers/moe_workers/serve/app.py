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
from moe_workers.serve.config import INGRESS, AppArgs
from moe_workers.serve.engine import Engine, GenerationRequest, Overloaded
from moe_workers.serve.protocol import RequestError, parse_completion
from moe_workers.serve.routing import ExpertRouter


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@serve.deployment
class ExpertShard:
    """Hosts the experts named in its user_config; computes them for the ingress."""

    def __init__(self, model_path: str, dtype: str, torch_threads: int):
        torch.set_num_threads(torch_threads)
        self.ckpt = Checkpoint(model_path)
        self.cfg = self.ckpt.config.with_dtype(dtype)
        self.group = serve.get_replica_context().deployment
        self.experts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.load: TokenCounter = TokenCounter()
        self.compute_s = 0.0
        self.calls = 0
        self._lock = threading.Lock()
        try:
            from ray.util.metrics import Counter
            self._metric = Counter("moe_expert_tokens", description="Tokens routed to each expert.",
                                   tag_keys=("layer", "expert", "group"))
        except Exception:  # metrics are best effort; serving must not depend on them
            self._metric = None

    def reconfigure(self, config: dict) -> None:
        """New expert set: load the new ones first, then switch; calls in flight keep the old dict."""
        wanted = []
        for eid in config.get("experts", []):
            layer, expert = (int(p) for p in eid.split("."))
            wanted.append((layer, expert))
        with self._lock:
            current = self.experts
            fresh = {k: current[k] for k in wanted if k in current}
            for k in wanted:
                if k not in fresh:
                    fresh[k] = {n: t.contiguous() for n, t in self.ckpt.expert(*k, dtype=self.cfg.dtype).items()}
            self.experts = fresh  # one reference swap: a call sees either the old or the new set
            self.ckpt.close()  # unmap the files: mapped pages we read would otherwise stay in RSS

    def forward(self, layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        experts = self.experts
        out = {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            for e, x in inputs.items():
                w = experts.get((layer, e))
                if w is None:
                    raise KeyError(f"{self.group} does not host expert {layer}.{e}")
                out[e] = expert_mlp(x, w["w1"], w["w2"], w["w3"])
                self.load[(layer, e)] += x.shape[0]
                if self._metric is not None:
                    self._metric.inc(x.shape[0], tags={"layer": str(layer), "expert": str(e), "group": self.group})
        self.compute_s += time.perf_counter() - t0
        self.calls += 1
        return out

    def status(self) -> dict:
        return {
            "group": self.group,
            "replica": serve.get_replica_context().replica_id.unique_id,
            "pid": os.getpid(),
            "experts": sorted(f"{l}.{e}" for l, e in self.experts),
            "load": {f"{l}.{e}": n for (l, e), n in sorted(self.load.items())},
            "bytes": sum(t.numel() * t.element_size() for w in self.experts.values() for t in w.values()),
            "compute_s": self.compute_s,
            "calls": self.calls,
            "peak_rss_bytes": peak_rss_bytes(),
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

    def __init__(self, args: dict, shards: dict[str, DeploymentHandle]):
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
        self.router: ExpertRouter | None = None  # set by reconfigure(), which Serve calls right after __init__
        self.engine = Engine(self.dense, self.cache, self._dispatch, self.args.max_batch_size,
                             self.args.max_queued_requests, self.args.micro_batches,
                             self.args.micro_batch_min_tokens)
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

    async def _dispatch(self, layer: int, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        groups = group_by_expert(indices)
        router = self.router
        if router is None:
            raise RuntimeError("no expert placement configured (user_config.placement)")
        assignment = router.assign(layer, {e: int(rows.numel()) for e, (rows, _) in groups.items()})
        calls = []
        for group, experts in assignment.items():
            payload = {e: x[groups[e][0]] for e in experts}  # row gathers: fresh contiguous tensors
            tokens = sum(int(groups[e][0].numel()) for e in experts)
            router.begin(group, tokens)
            calls.append((group, tokens, self.shards[group].forward.remote(layer, payload)))
        try:
            results = await asyncio.gather(*(call for _, _, call in calls))
        finally:
            for group, tokens, _ in calls:
                router.end(group, tokens)
        outputs: dict[int, torch.Tensor] = {}
        for r in results:
            outputs.update(r)
        return combine(x.shape[0], x.shape[1], x.dtype, groups, outputs, weights)

    # -- HTTP -----------------------------------------------------------------------------------

    @fastapi_app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{
            "id": self.args.served_model_name, "object": "model", "owned_by": "moe-operator",
            "max_model_len": self.max_len}]}

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

    def engine_stats(self) -> dict:
        t = self.engine.timings
        return {"steps": t.steps, "tokens": t.tokens, "dense_s": t.dense, "experts_s": t.experts,
                "running": len(self.engine.running), "waiting": len(self.engine.waiting),
                "kv_slots": self.cache.num_slots, "kv_free": self.cache.free_slots, "pid": os.getpid(),
                "peak_rss_bytes": peak_rss_bytes(), "dense_bytes": self.dense.nbytes(),
                "kv_cache_bytes": self.cache.k.numel() * self.cache.k.element_size() * 2}


def build_app(args: AppArgs) -> serve.Application:
    """The Serve application for these typed args (placement from args.placement, if given;
    Serve configs override it per deployment through user_config)."""
    placement = args.placement or {}
    shards = {}
    for name in args.group_names():
        options = {"name": name, "ray_actor_options": {"num_cpus": args.shard_num_cpus, "num_gpus": args.shard_num_gpus}}
        if args.placement is not None:
            options["user_config"] = {"experts": list(placement.get(name, []))}
        shards[name] = ExpertShard.options(**options).bind(args.model_path, args.dtype, args.torch_threads)
    options = {"name": INGRESS, "num_replicas": args.ingress_replicas,
               "ray_actor_options": {"num_cpus": args.ingress_num_cpus},
               "max_ongoing_requests": max(1000, args.max_batch_size + args.max_queued_requests + 16)}
    if args.placement is not None:
        options["user_config"] = {"placement": placement}
    return Ingress.options(**options).bind(args.model_copy(update={"placement": None}).model_dump(), shards)
