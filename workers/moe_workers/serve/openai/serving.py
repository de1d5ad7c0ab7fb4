"""The OpenAI request path: a completion or chat completion from the request to its answer
(no Ray here; the engine is handed in). vLLM's `OpenAIServingChat` / `OpenAIServingCompletion`
are the model; Ray Serve LLM's `core/ingress` -> `core/server` split is ours: the Ingress wires
and routes, `OpenAIServing` serves.

A request: the body decoded and validated (`protocol`), the model checked, the prompt tokenized
(a chat rendered by its template first, `chat`); its n choices submitted to the engine, with a
grammar each where the answer is constrained (`structured`); their tokens turned into text as
they come (`text`: stop sequences; `reasoning`: thinking apart; `tools`: calls), answered whole
or streamed one event per token, spelt by `render` as the models of `responses`. A stream
migrated from a failed replica (`proxy.migration`) goes on after the tokens its client has.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from moe_workers.engine import Engine, FinishReason, GenerationRequest, Overloaded, ending_ids
from moe_workers.serve.auth import ANONYMOUS, key_id
from moe_workers.serve.config import AppArgs
from moe_workers.serve.http_gate import read_body
from moe_workers.serve.openai.chat import ChatTemplate
from moe_workers.serve.openai.protocol import (NamedToolChoice, RequestError, check_context, decode_body,
                                               parse_chat, parse_completion)
from moe_workers.serve.openai.reasoning import Splitter, reasoning_format, split
from moe_workers.serve.openai.render import (DONE, Renderer, Reply, chat_choice, completion_choice, finish_text,
                                             raise_failed, usage)
from moe_workers.serve.openai.responses import ModelCard, ModelList
from moe_workers.serve.openai.structured import Grammars
from moe_workers.serve.openai.text import ChoiceText
from moe_workers.serve.openai.tools import cut_calls, parse, start_marker, tool_format
from moe_workers.serve.proxy.migration import RESUME_HEADER, Resume, parse_resume

JSON = "application/json"


class OpenAIServing:
    """/v1/models, /v1/completions and /v1/chat/completions over one engine. `cfg` is the
    model's config (vocabulary, end-of-sequence ids, family); `tokenizer` None: token ids only,
    no chat; `chat_template` None: no chat; `metrics` counts refusals (`reject(status)`)."""

    def __init__(self, engine: Engine, args: AppArgs, cfg, max_len: int, tokenizer, chat_template: ChatTemplate | None,
                 grammars: Grammars, metrics):
        self.engine, self.args, self.cfg, self.max_len = engine, args, cfg, max_len
        self.tokenizer, self.chat_template, self.grammars, self.metrics = tokenizer, chat_template, grammars, metrics
        self.render = Renderer(tokenizer)
        self.reasoning_format = (reasoning_format(tokenizer.get_vocab(with_added_tokens=True), cfg.family)
                                 if tokenizer is not None else None)
        self.tool_format = tool_format(cfg.family)
        # a text of more than max_len x the longest token's characters cannot fit: refused untokenized
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer else 1

    def models(self) -> Response:
        card = ModelCard(id=self.args.served_model_name, object="model", owned_by="moe-operator",
                         max_model_len=self.max_len, vocab_size=self.cfg.vocab_size)
        return Response(ModelList(object="list", data=[card]).wire(), media_type=JSON)

    async def completions(self, request: Request) -> Response:
        req = parse_completion(decode_body(await self._body(request)))
        self._check_model(req.model)
        ids = self._prompt_ids(req.prompt)
        return await self._respond(req, ids, req.new_tokens, req.logprobs, chat=False,
                                   resume=self._resume(request, req, req.new_tokens),
                                   key=key_id(request.headers.get("authorization")))

    async def chat_completions(self, request: Request) -> Response:
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
                                   resume=self._resume(request, req, new_tokens),
                                   key=key_id(request.headers.get("authorization")))

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
        return parse_resume(value, self.cfg.vocab_size, new_tokens)

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
        if tokens and tokens[-1] in ending_ids(self.cfg, not req.ignore_eos, req.stop_token_ids):
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
                       resume: Resume | None = None, key: str = ANONYMOUS) -> Response:
        """Submit the request's n choices and answer them (whole, or as server-sent events); a
        resumed stream goes on after the tokens its client has, under its first response's id.
        `key`: the API key id its expert-tokens are counted under (routing statistics)."""
        param = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        check_context(len(ids), new_tokens, self.max_len, self.engine.max_sequence_tokens(),
                      "messages" if chat else "prompt", param)
        sampling = req.sampling(self.cfg.vocab_size)
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
                                  constraint=constraints[i], key=key,
                                  seed=None if req.seed is None else req.seed + i, logprobs=logprobs,
                                  stop_at_eos=not req.ignore_eos, stop_token_ids=frozenset(req.stop_token_ids or ()),
                                  resumed=len(prefix),  # final_only: _collect reads `produced` at the end
                                  final_only=not req.stream and not req.stops and not calls)
                for i in range(req.n if finish is None else 0)]
        try:
            for gen in gens:
                self.engine.submit(gen)
        except Overloaded as err:
            for gen in gens:
                self.engine.cancel(gen)
            self.metrics.reject(503)
            raise RequestError(503, f"server overloaded: {err}; retry later", err_type="overloaded")
        name, created = ((resume.id, resume.created) if resume is not None
                         else (f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())))
        reply = Reply(name, created, self.args.served_model_name, chat, req.include_usage)
        if req.stream:
            events = self._events(gens, streams, req, reply, len(ids), resume, finish)
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
            lp = self.render.logprobs(gen.produced, gen.token_logprobs, chat) if logprobs is not None else None
            if chat:
                choices.append(chat_choice(i, text, gen.produced, finish, lp,
                                           thinking if self._reports_reasoning(req, streams[i]) else None,
                                           self._tool_calls(streams[i], req, finish) if calls else ()))
            else:
                choices.append(completion_choice(i, text, gen.produced, finish, lp))
        completion = sum(len(g.produced) for g in gens)
        return Response(reply.answer(choices, self._usage(len(ids), completion, gens)).wire(), media_type=JSON)

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

    async def _events(self, gens: list[GenerationRequest], streams: list[ChoiceText], req, reply: Reply,
                      prompt: int, resume: Resume | None = None, finish: str | None = None):
        """The stream's events: each chat choice's role first, then one event per token (its text,
        its id, its logprobs), each choice's end (tool calls whole, in one event, then the finish),
        usage if asked for, [DONE]."""
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(i: int, gen: GenerationRequest):
            while (tok := await gen.out.get()) is not None:
                await merged.put((i, tok))
            await merged.put((i, None))

        tasks = [asyncio.create_task(forward(i, g)) for i, g in enumerate(gens)]
        prefix = resume.token_ids if resume is not None else []
        chat = reply.chat
        reasoning = [self._reports_reasoning(req, s) for s in streams]
        calls = chat and req.calls_tools

        def event(i: int, text: str | tuple[str, str], token_ids: list[int], finish: str | None, lp=None,
                  first=False, tool_calls=()) -> bytes:
            text, thinking = (text, "") if isinstance(text, str) else text
            return reply.event(i, text, token_ids, finish, lp, thinking if reasoning[i] else "", first, tool_calls)

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
                lp = (self.render.logprobs(gen.produced, gen.token_logprobs, chat, since=k, upto=k + 1, prefix=prefix)
                      if gen.logprobs is not None else None)
                if stream.stopped:
                    self._stopped(gen)
                yield event(i, text, [tok], None, lp)
            if req.include_usage:
                completion = len(prefix) + sum(len(g.produced) for g in gens)
                yield reply.usage_event(self._usage(prompt, completion, gens))
            yield DONE
        finally:
            for t in tasks:
                t.cancel()

    @staticmethod
    def _usage(prompt: int, completion: int, gens: list[GenerationRequest]):
        """cached_tokens: the first choice's, at its admission."""
        return usage(prompt, completion, gens[0].cached_tokens if gens else 0)

    def _prompt_ids(self, prompt: str | list[int], param: str = "prompt", special_tokens: bool = True) -> list[int]:
        vocab = self.cfg.vocab_size
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
