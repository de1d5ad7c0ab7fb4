"""Ingress: the HTTP API, continuous batching and the dense part of the model.

What every request passes first (API key, body size) is `http_gate`; how answers are spelt
(usage, logprobs, finish reasons) `openai.render`; the request schema `openai.protocol`; the
engine's scheduling and KV cache `engine` and `model.kv_cache`.

Per layer the engine hands the step's routed rows to `dispatch.ExpertDispatcher`, which picks a
copy of each expert by the placement in the user_config (ExpertRouter) and exchanges the rows
with every shard group at once on the expert channel (`moe_workers.transport`); membership of
the channel comes from the StatusBoard, so Serve's replica changes reach it without a restart.
"""


import asyncio
import json
import os
import resource
import threading
import time
import uuid
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from moe_workers.device import replica_device
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import DenseModel
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.serve.dispatch import ExpertDispatcher
from moe_workers.serve.config import AUTO, AppArgs, admission_capacity, engine_queue_limit
from moe_workers.serve.ingress_scaling import KV_METRIC
from moe_workers.engine import Engine, FinishReason, GenerationRequest, Overloaded, ending_ids
from moe_workers.serve.memory import peak_rss_bytes
from moe_workers.serve.metrics import IngressMetrics
from moe_workers.serve.proxy.migration import RESUME_HEADER, Resume, parse_resume
from moe_workers.serve.board import weights_digest
from moe_workers.serve.openai.chat import ChatTemplate
from moe_workers.serve.http_gate import install, read_body
from moe_workers.serve.openai.render import Renderer, finish_text, raise_failed, usage_object
from moe_workers.serve.openai.protocol import (NamedToolChoice, RequestError, check_context, decode_body,
                                               parse_chat, parse_completion)
from moe_workers.serve.openai.structured import Grammars
from moe_workers.serve.openai.reasoning import Splitter, reasoning_format, split
from moe_workers.serve.openai.text import ChoiceText
from moe_workers.serve.openai.tools import cut_calls, parse, start_marker, tool_format
from moe_workers.serve.routing import ExpertRouter
from moe_workers.serve.routing_stats import RoutingStats
from moe_workers.serve.node import ray_placement
from moe_workers.transport import ExpertChannel, Member
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
        self.channel = ExpertChannel(self._members if board is not None else None,
                                     timeout_s=self.args.exchange_timeout_s,
                                     on_refused=self._forget if board is not None else None,
                                     node=ray_placement()[0] or "", local_sockets=self.args.local_channel,
                                     spin_s=self.args.exchange_spin_us / 1e6,
                                     wake_latency_us=self.args.wake_latency_us())
        self._group_tokens_exported: dict[str, int] = {}
        # the expert exchange; its placement is set by reconfigure(), which Serve calls right after __init__
        self.dispatcher = ExpertDispatcher(self.channel, self.dense.pick, cfg.sparse_layers, cfg.num_experts)
        self.routing_stats = RoutingStats(cfg.num_layers, cfg.num_experts, self.args.max_batch_size)
        self.routing_window: dict = {}
        self.metrics = IngressMetrics(ctx.replica_id.deployment_id.app_name, self.replica)
        self.engine = Engine(self.dense, self.cache, self.dispatcher, self.args.max_batch_size,
                             engine_queue_limit(self.args), self.args.micro_batches,
                             self.args.micro_batch_min_tokens, routing_stats=self.routing_stats,
                             observer=self.metrics, realtime=Realtime(self.args.realtime_priority,
                                                               torch_threads=self.args.ingress_torch_threads),
                             max_num_batched_tokens=self.args.max_num_batched_tokens, max_len=self.max_len)
        threading.Thread(target=self._export_metrics, name="ingress-metrics", daemon=True).start()
        tok_file = Path(self.args.model_path) / "tokenizer.json"
        self.tokenizer = None
        if tok_file.is_file():
            from tokenizers import Tokenizer
            self.tokenizer = Tokenizer.from_file(str(tok_file))
        self.render = Renderer(self.tokenizer)
        self.reasoning_format = (reasoning_format(self.tokenizer.get_vocab(with_added_tokens=True), self.dense.cfg.family)
                                 if self.tokenizer is not None else None)
        self.tool_format = tool_format(self.dense.cfg.family)
        self.grammars = Grammars(tok_file if tok_file.is_file() else None, self.dense.cfg.vocab_size,
                                 self.dense.cfg.eos_token_id, self.dense.cfg.bos_token_id)
        # a text of more than max_len x the longest token's characters cannot fit: refused untokenized
        self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1) if self.tokenizer else 1
        self.chat_template = ChatTemplate.from_checkpoint(self.args.model_path)
        fastapi_app.state.max_request_bytes = self.args.max_request_bytes
        fastapi_app.state.metrics = self.metrics
        # generation requests all Ingress replicas hold (running + waiting): past it the proxy refuses
        self._size_admission()

    def reconfigure(self, config: dict) -> None:
        """user_config {"placement": {group: [L.E, ...]}} re-points routing without a restart;
        "ingress_replicas" (how many Ingress replicas the app runs now) resizes the capacity this
        replica announces to the proxy's admission gate, so scaling the Ingress restarts nothing."""
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

    def _members(self) -> tuple[list[Member], str]:
        """The channel's membership, from the StatusBoard (called by the channel's poller thread,
        every second); the poll counts this replica among the Ingress replicas live."""
        got = self.board.members.remote(ingress=self.replica).result(timeout_s=10)
        self._see_weights(got.get("weights"))
        live = max(1, int(got.get("ingress_replicas") or 1))
        if live != self.live_ingress_replicas:
            self.live_ingress_replicas = live
            self._size_admission()
        return [Member.from_report(m) for m in got["members"]], got["token"]

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

    def _forget(self, member: Member) -> None:
        """A shard replica whose channel port refused us is dead: off the board now (the
        channel's membership thread calls this)."""
        self.board.forget.remote(member.replica, member.endpoint).result(timeout_s=10)

    def _export_metrics(self, every_s: float = 5.0, latencies_every_s: float = 1.0) -> None:
        """The engine's queued latencies every second; load and routing figures every `every_s`."""
        last = time.monotonic()
        while True:
            time.sleep(latencies_every_s)
            try:
                self.metrics.flush()
            except Exception:  # metrics never break serving
                pass
            if time.monotonic() - last < every_s:
                continue
            last = time.monotonic()
            try:
                self.metrics.load(self.engine_stats())
                window = self.routing_stats.take()
                if any(t for t in window["tokens"]):
                    self.routing_window = window  # status shows the last window that saw traffic
                self.metrics.export(window)
                router = self.dispatcher.router
                if router is not None:
                    for group, sent in list(router.sent.items()):
                        self.metrics.dispatched(group, sent - self._group_tokens_exported.get(group, 0))
                        self._group_tokens_exported[group] = sent
            except Exception:  # metrics never break serving; the next round retries
                pass

    # -- HTTP -----------------------------------------------------------------------------------

    @fastapi_app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(self):
        return {"object": "list", "data": [{
            "id": self.args.served_model_name, "object": "model", "owned_by": "moe-operator",
            "max_model_len": self.max_len, "vocab_size": self.dense.cfg.vocab_size}]}

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        req = parse_completion(decode_body(await self._body(request)))
        self._check_model(req.model)
        ids = self._prompt_ids(req.prompt)
        return await self._respond(req, ids, req.new_tokens, req.logprobs, chat=False,
                                   resume=self._resume(request, req, req.new_tokens))

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        req = parse_chat(decode_body(await self._body(request)))
        self._check_model(req.model)
        if self.tokenizer is None:
            raise RequestError(400, "messages: this checkpoint has no tokenizer.json, so chat is not available; "
                               "use /v1/completions with token ids", param="messages")
        if self.chat_template is None:
            raise RequestError(400, "messages: this checkpoint has no chat template (tokenizer_config.json "
                               "chat_template or chat_template.jinja); use /v1/completions", param="messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        text = self.chat_template.render(req.messages, add_generation_prompt=True, tools=tools)
        ids = self._prompt_ids(text, param="messages", special_tokens=False)
        new_tokens = req.new_tokens if req.new_tokens is not None else self.max_len - len(ids)
        return await self._respond(req, ids, new_tokens, req.top_k_logprobs, chat=True,
                                   resume=self._resume(request, req, new_tokens))

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.args.max_request_bytes, self.args.request_body_timeout_s)

    def _resume(self, request: Request, req, new_tokens: int) -> Resume | None:
        """Where a stream migrated from a failed replica goes on (moe_workers.serve.proxy.migration)."""
        value = request.headers.get(RESUME_HEADER.decode())
        if value is None:
            return None
        if not req.stream or req.n != 1:
            raise RequestError(400, f"{RESUME_HEADER.decode()}: only a streamed request with n 1 resumes",
                               param=RESUME_HEADER.decode())
        return parse_resume(value, self.dense.cfg.vocab_size, new_tokens)

    def _resumed_finish(self, resume: Resume, ids: list[int], new_tokens: int, stream: ChoiceText,
                        req) -> str | None:
        """How a resumed choice ends without another token, if it does: its finish was sent, or
        the tokens the client has already ended it (length, end of sequence, a stop sequence in
        `stream`, the choice's text stream with those tokens pushed)."""
        tokens = resume.token_ids
        if resume.finished:
            return "sent"
        if len(tokens) >= new_tokens or len(ids) + len(tokens) >= self.max_len:
            return "length"
        if tokens and tokens[-1] in ending_ids(self.dense.cfg, not req.ignore_eos, req.stop_token_ids):
            return "stop"
        return "stop" if stream.stopped else None

    def _constraints(self, req, forced, prefix: list[int]) -> list:
        """A grammar matcher for each of the request's choices (compiled once, cached): its
        response_format, or the tool call it must make; past a resumed stream's tokens. A
        RequestError if the format cannot be served or the tokens do not fit."""
        out = []
        for _ in range(req.n):
            if forced:
                c = self.grammars.tool_constraint(self.tool_format, [f.model_dump(exclude_none=True) for f in forced],
                                                  req.parallel_tool_calls)
            else:
                c = self.grammars.constraint(req.response_format)
            for tok in prefix:
                try:
                    c.advance(tok)
                except ValueError as err:
                    raise RequestError(400, f"{RESUME_HEADER.decode()}: {err}", param=RESUME_HEADER.decode()) from None
            out.append(c)
        return out

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.args.served_model_name:
            raise RequestError(404, f"model {model!r} is not served here (serving {self.args.served_model_name!r})",
                               param="model", err_type="model_not_found")

    async def _respond(self, req, ids: list[int], new_tokens: int, logprobs: int | None, chat: bool,
                       resume: Resume | None = None):
        """Submit the request's n choices and answer them (whole, or as server-sent events); a
        resumed stream goes on after the tokens its client has, under its first response's id."""
        param = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        check_context(len(ids), new_tokens, self.max_len, self.engine.max_sequence_tokens(),
                      "messages" if chat else "prompt", param)
        sampling = req.sampling(self.dense.cfg.vocab_size)
        prefix = resume.token_ids if resume is not None else []
        # the choices' text streams; a resumed one holds the text its client has, and what is held back
        calls = chat and req.calls_tools
        marker = start_marker(self.tool_format) if calls else None
        streams = [ChoiceText(self.render.decode, req.stops, self._splitter(ids, chat), marker,
                              self._single_token(marker)) for _ in range(req.n)]
        for tok in prefix:
            streams[0].push(tok)
        finish = self._resumed_finish(resume, ids, new_tokens, streams[0], req) if resume is not None else None
        constraints = [None] * req.n
        forced = req.forced_functions() if chat else None
        if finish is None and (forced or (req.response_format is not None and req.response_format.type != "text")):
            constraints = await asyncio.to_thread(self._constraints, req, forced, prefix)
        gens = [GenerationRequest(prompt=ids + prefix, max_tokens=new_tokens - len(prefix), sampling=sampling,
                                  constraint=constraints[i],
                                  seed=None if req.seed is None else req.seed + i, logprobs=logprobs,
                                  stop_at_eos=not req.ignore_eos, stop_token_ids=frozenset(req.stop_token_ids or ()),
                                  resumed=len(prefix),
                                  final_only=not req.stream and not req.stops and not calls)  # _collect reads `produced` at the end
                for i in range(req.n if finish is None else 0)]
        try:
            for gen in gens:
                self.engine.submit(gen)
        except Overloaded as err:
            for gen in gens:
                self.engine.cancel(gen)
            self.metrics.reject(503)
            raise RequestError(503, f"server overloaded: {err}; retry later", err_type="overloaded")
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": self.args.served_model_name}
        if resume is not None:
            head.update(id=resume.id, created=resume.created)
        if req.stream:
            events = self._events(gens, streams, req, head, kind + ".chunk" if chat else kind, chat, len(ids),
                                  resume, finish)
            return StreamingResponse(self._stream(gens, events), media_type="text/event-stream")
        try:
            done = await asyncio.gather(*(self._collect(gen, stream) for gen, stream in zip(gens, streams)))
        except asyncio.CancelledError:  # the client went away (Serve cancels the request)
            for gen in gens:
                self.engine.cancel(gen)
            raise
        for gen in gens:
            raise_failed(gen)
        choices = []
        for i, (gen, (text, thinking, finish)) in enumerate(zip(gens, done)):
            lp = self.render.logprobs(gen, chat) if logprobs is not None else None
            if chat:
                message = {"role": "assistant", "content": text}
                if self._reports_reasoning(req, streams[i]):
                    message["reasoning_content"] = thinking
                tool_calls = self._tool_calls(streams[i], req, finish) if calls else []
                if tool_calls:
                    message.update(content=text or None, tool_calls=[c.openai() for c in tool_calls])
                    finish = "tool_calls" if finish == "stop" else finish
                choices.append({"index": i, "message": message,
                                "token_ids": gen.produced, "finish_reason": finish, "logprobs": lp})
            else:
                choices.append({"index": i, "text": text, "token_ids": gen.produced,
                                "finish_reason": finish, "logprobs": lp})
        completion = sum(len(g.produced) for g in gens)
        return {**head, "object": kind, "choices": choices,
                "usage": usage_object(len(ids), completion, gens)}

    async def _collect(self, gen: GenerationRequest, stream: ChoiceText) -> tuple[str, str, str | None]:
        """One choice's whole answer, its reasoning ("" for a model that does not think) and its
        finish reason; a stop sequence in the answer ends it ("stop", the stop not included)."""
        if gen.final_only:  # nothing to watch for: the engine hands over the end only
            while await gen.out.get() is not None:
                pass
            if stream.splitter is None:
                return self.render.decode(gen.produced), "", finish_text(gen)
            thinking, answer = split(stream.splitter.fmt, gen.prompt, gen.produced, self.render.decode)
            return self.render.decode(answer), self.render.decode(thinking), finish_text(gen)
        while (tok := await gen.out.get()) is not None:
            stream.push(tok)
            if stream.stopped:
                self._stopped(gen)
                break
        stream.finish()
        thinking = stream.reasoning.text if stream.reasoning is not None else ""
        return stream.content.text, thinking, "stop" if stream.stopped else finish_text(gen)

    def _single_token(self, text: str | None) -> int | None:
        """The id of `text` if the vocabulary has it as one token (a tool-call marker), else None."""
        return self.tokenizer.token_to_id(text) if text and self.tokenizer is not None else None

    def _tool_calls(self, stream: ChoiceText, req, finish: str | None) -> list:
        """The tool calls a choice made, read from its raw text (special tokens spelled out). A
        forced call that max_tokens cut (finish "length") is returned with the arguments written
        so far, as vLLM returns it (`tools.cut_calls`)."""
        cut = finish == "length" and req.forced_functions() is not None
        if not stream.calling and self.tool_format != "harmony" and not cut:
            return []
        raw = self.render.decode_raw(stream.tokens)
        if cut:
            named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
            return cut_calls(self.tool_format, raw, named)
        return parse(self.tool_format, raw)[1]

    def _splitter(self, prompt: list[int], chat: bool) -> Splitter | None:
        """A chat choice's reasoning splitter, for a model whose vocabulary marks its thinking."""
        if not chat or self.reasoning_format is None:
            return None
        return Splitter(self.reasoning_format, prompt, self.render.decode)

    def _reports_reasoning(self, req, stream: ChoiceText) -> bool:
        """Whether the answer carries reasoning_content: the model thinks, and neither the request
        (include_reasoning) nor the app's default (spec.ingress.includeReasoning) says no."""
        if stream.reasoning is None:  # not a chat choice of a thinking model
            return False
        return req.include_reasoning if req.include_reasoning is not None else self.args.include_reasoning

    def _stopped(self, gen: GenerationRequest) -> None:
        self.engine.cancel(gen, FinishReason.STOP)

    async def _stream(self, gens: list[GenerationRequest], events):
        try:
            async for event in events:
                yield event
        finally:  # the client went away mid-stream (or it ended): nothing keeps generating for it
            for gen in gens:
                self.engine.cancel(gen)

    async def _events(self, gens: list[GenerationRequest], streams: list[ChoiceText], req, head: dict, kind: str,
                      chat: bool, prompt: int, resume: Resume | None = None, finish: str | None = None):
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(i: int, gen: GenerationRequest):
            while (tok := await gen.out.get()) is not None:
                await merged.put((i, tok))
            await merged.put((i, None))

        tasks = [asyncio.create_task(forward(i, g)) for i, g in enumerate(gens)]
        prefix = resume.token_ids if resume is not None else []
        usage = {"usage": None} if req.include_usage else {}

        reasoning = [self._reports_reasoning(req, s) for s in streams]

        calls = chat and req.calls_tools

        def event(i: int, text: str | tuple[str, str], token_ids: list[int], finish: str | None, lp=None,
                  first=False, tool_calls=None) -> str:
            text, thinking = (text, "") if isinstance(text, str) else text
            thinking = thinking if reasoning[i] else ""
            if chat:
                delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
                if thinking:
                    delta = {**delta, "reasoning_content": thinking}
                if tool_calls:
                    delta = {**delta, "tool_calls": [c.openai(index=k) for k, c in enumerate(tool_calls)]}
                choice = {"index": i, "delta": delta, "token_ids": token_ids, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": i, "text": text, "token_ids": token_ids, "finish_reason": finish, "logprobs": lp}
            return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice], **usage})}\n\n"

        try:
            if chat and resume is None:
                for i in range(len(gens)):
                    yield event(i, "", [], None, first=True)
            if finish not in (None, "sent"):  # the resumed choice had ended; its client lacks the finish
                yield event(0, streams[0].finish(), [], finish)
            open_choices = len(gens)
            while open_choices:
                i, tok = await merged.get()
                gen, stream = gens[i], streams[i]
                if tok is None:
                    open_choices -= 1  # (a failed choice ends with finish_reason "error: ...")
                    end = "stop" if stream.stopped else finish_text(gen)
                    tool_calls = self._tool_calls(stream, req, end) if calls else []
                    if tool_calls:  # the calls whole, in one chunk, then the finish
                        yield event(i, stream.finish(), [], None, tool_calls=tool_calls)
                        yield event(i, "", [], "tool_calls" if end == "stop" else end)
                    else:
                        yield event(i, stream.finish(), [], end)
                    continue
                if stream.stopped:
                    continue
                text = stream.push(tok)
                k = len(stream.tokens) - 1 - len(prefix)  # this token's index in this replica's part
                lp = (self.render.logprobs(gen, chat, since=k, upto=k + 1, prefix=prefix)
                      if gen.logprobs is not None else None)
                if stream.stopped:
                    self._stopped(gen)
                yield event(i, text, [tok], None, lp)
            if req.include_usage:
                completion = len(prefix) + sum(len(g.produced) for g in gens)
                yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': usage_object(prompt, completion, gens)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()

    def _prompt_ids(self, prompt: str | list[int], param: str = "prompt", special_tokens: bool = True) -> list[int]:
        vocab = self.dense.cfg.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(400, "prompt: this checkpoint has no tokenizer.json; send the prompt as a "
                                   "list of token ids", param="prompt")
            if len(prompt) > self.max_len * self.max_token_chars:
                raise RequestError(400, f"{param}: {len(prompt)} characters are more than the context of "
                                   f"{self.max_len} tokens can hold", param=param)
            # a rendered chat template carries its own special tokens (as transformers tokenizes it)
            return self.tokenizer.encode(prompt, add_special_tokens=special_tokens).ids
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        return list(prompt)

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
                            "wake_latency": self.channel.wake.status(),
                            "realtime": self.engine.realtime.status()},
                "routing": {**self.routing_window, "co_selected": self.routing_stats.co_selected_pairs()}}

    def tune_channel(self, local: bool | None = None, spin_us: int | None = None,
                     wake_latency_us: int | None | str = "keep", realtime_priority: int | None = None) -> None:
        """Reach shard replicas on this node on their Unix sockets (local=True) or over TCP, from
        the next connection on; poll for small exchanges' replies for spin_us (0: sleep at once);
        ask for this CPU wake-up latency while exchanges run (None: never); run small steps at
        this real-time priority (0: the fair class). bench/serving.py compares the ways in one
        window."""
        if local is not None:
            self.channel.use_local_sockets(local)
        if spin_us is not None:
            self.channel.spin_s = max(0, spin_us) / 1e6
        if wake_latency_us != "keep":
            self.channel.wake.set_limit(wake_latency_us)
        if realtime_priority is not None:
            self.engine.realtime.set_priority(realtime_priority)

    def engine_stats(self) -> dict:
        """The engine's figures (`Engine.stats()`) and this replica's process: CPU time, peak RSS,
        the dense part's bytes, the grammar cache, and the expert versions the prefix cache holds."""
        stats = self.engine.stats()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        stats["kv"]["weights"] = self._weights
        return {**stats, "cpu_s": usage.ru_utime + usage.ru_stime, "pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes(),
                "dense_bytes": self.dense.nbytes(), "grammars": self.grammars.stats()}


