"""Continuous batching over the dense model; experts are reached through a dispatcher.

The engine owns the paged KV cache and a bounded wait queue. Each step schedules, within a
token budget (`max_num_batched_tokens`): a decode token of every running sequence first, then
chunks of prompts being prefilled (a long prompt is split over steps, so running streams keep
their pace), then newly admitted prompts, each starting after the prefix the cache already
holds computed (prefix caching). It runs them through the model together, samples, and
streams tokens out. Memory is blocks (`model.kv_blocks`): a request is admitted when blocks for
its first chunk are free; when a running sequence needs a block and none is, the most recently
admitted sequence is preempted (its blocks freed, its tokens recomputed once there is room:
vLLM's policy), so no request fails or is cut short for memory. Nothing here knows about Ray:
the dispatcher is any `(layer, x, indices, weights) -> moe_out`, which is how the same engine
runs in-process (tests) and in the Ingress deployment (the expert channel).

Steps run back to back in one engine thread, from admission through the forward pass (layers
and expert exchanges included) to sampling: the event loop only submits, cancels and streams,
and a step's tokens reach it in one hand-off that the next step does not wait for (a round trip
between the loop and a thread cost a step 0.3-0.4 ms). Micro-batches run in threads of their
own; their dense compute takes turns (one lock) while one waits on its exchange and another
computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from moe_workers.model.dense import Chunk, DenseModel, StepBatch
from moe_workers.model.kv_blocks import NoFreeBlocks
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.model.sampling import GREEDY, History, SamplingParams, sample_batch
from moe_workers.transport.realtime import Realtime

if TYPE_CHECKING:
    from moe_workers.serve.openai.structured import Constraint

Dispatcher = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # runs in a step thread

# A step with no sequence decoding (prompts only: no stream to keep waiting) may compute this many
# token budgets: at the bench's default shape 32 prompts x 256 tokens arriving together prefilled
# at 0.77 of in-process in one step, 0.69 in 2048-token steps and 0.52 in 512-token ones
PREFILL_ONLY_FACTOR = 16


class Overloaded(Exception):
    """The wait queue is full; the caller should answer 503 with Retry-After."""


class Phase(enum.Enum):
    WAITING = "waiting"  # queued (or preempted: its tokens are recomputed when it is admitted again)
    PREFILL = "prefill"  # admitted, some of its known tokens not computed yet (a chunked prompt)
    DECODE = "decode"  # every known token computed: one new token a step
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request ended (OpenAI's finish_reason, plus cancelled and error)."""

    STOP = "stop"  # end of sequence, or a stop sequence
    LENGTH = "length"  # max_tokens, or the context
    CANCELLED = "cancelled"  # the client went away
    ERROR = "error"  # the step failed: `error` says why


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    seed: int | None = None
    stop_at_eos: bool = True  # False: ignore_eos
    stop_token_ids: frozenset[int] = frozenset()  # each ends the sequence like the end of sequence
    resumed: int = 0  # the last `resumed` tokens of `prompt` were produced before (a resumed stream)
    logprobs: int | None = None  # also record each token's logprob and this many alternatives
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then None
    # the reader needs the end only (a whole completion, no stop strings to watch): `out` gets the
    # None and the tokens stay in `produced`, so the event loop is not woken for every token
    final_only: bool = False
    loop: asyncio.AbstractEventLoop | None = None  # the one that reads `out` (set on submit)
    generator: torch.Generator | None = None
    history: History | None = None  # what penalties look at (penalized sampling only)
    constraint: "Constraint | None" = None  # the response format's grammar state (structured output)
    finish_reason: FinishReason | None = None
    error: Exception | None = None  # what failed the step that ended this request
    cancelled: FinishReason | None = None  # why it ends early (CANCELLED, or STOP: a stop sequence): freed at the next step
    # engine state
    phase: Phase = Phase.WAITING
    slot: int | None = None  # its sequence id in the KV cache while admitted
    produced: list[int] = field(default_factory=list)
    # with logprobs: per produced token (its logprob, [(token id, logprob) of the top alternatives])
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    num_computed_tokens: int = 0  # of prompt + produced, in the KV cache
    cached_tokens: int = 0  # of the prompt, found in the prefix cache at its (last) admission
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.produced)

    @property
    def num_output(self) -> int:
        """Tokens of the completion so far, a resumed stream's earlier ones included."""
        return self.resumed + len(self.produced)

    def tokens(self, start: int, end: int) -> list[int]:
        """Known tokens start..end-1 (the prompt, then what was produced)."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        return (self.prompt[start:] if start < p else []) + self.produced[max(0, start - p):end - p]
    # latency (time.perf_counter): submitted, the latest token
    t_submit: float = 0.0
    t_last: float = 0.0


class Observer:
    """What the engine reports per request (the Ingress exports it as metrics); no-ops here."""

    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def finished(self, req: "GenerationRequest", seconds: float) -> None: ...


@dataclass
class StepTimings:
    """Where a step's time goes, summed over steps and micro-batches (seconds): dense compute in
    the ingress, and waiting on expert calls."""

    dense: float = 0.0
    dense_cpu: float = 0.0  # CPU of the calling thread only: with several torch threads, a share
    experts: float = 0.0
    forward: float = 0.0  # the forward passes, in their threads
    step: float = 0.0  # whole steps in the engine thread (admission, forward, sampling, the hand-off of tokens)
    steps: int = 0
    tokens: int = 0  # sequences stepped, summed over steps
    computed_tokens: int = 0  # tokens run through the model (prefill chunks and decode tokens)


@dataclass
class KVStats:
    """The paged cache and the scheduler, since start (what status and metrics show)."""

    preemptions: int = 0  # sequences preempted for blocks (their tokens recomputed later)
    chunked_prefills: int = 0  # prompts prefilled over more than one step
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0  # of those, found computed


def ending_ids(cfg, stop_at_eos: bool, stop_token_ids) -> tuple[int, ...]:
    """The ids that end a sequence (finish_reason stop): the model's end-of-sequence ids (config.json
    and generation_config.json) unless ignored, and the request's stop token ids."""
    eos = cfg.eos_token_ids if stop_at_eos else ()
    return eos + tuple(sorted(set(stop_token_ids or ()) - set(eos)))


class Engine:
    def __init__(self, dense: DenseModel, cache: PagedKVCache, dispatch: Dispatcher, max_batch_size: int,
                 max_queued: int, micro_batches: int = 1, micro_batch_min_tokens: int = 256,
                 routing_stats=None, observer: Observer | None = None, realtime: Realtime | None = None,
                 max_num_batched_tokens: int = 2048, max_len: int | None = None,
                 prefill_only_factor: int = PREFILL_ONLY_FACTOR):
        """`realtime`: the real-time class a step's thread takes for a small step (its rows: the
        step's tokens x top_k, what its exchanges carry at most), or None: never.
        `max_num_batched_tokens`: a step's token budget (decode tokens always run; prefill
        chunks fill what is left), `prefill_only_factor` times that for a step with nothing
        decoding. `max_len`: the context (default: the model's)."""
        self.dense = dense
        self.realtime = realtime
        self.routing_stats = routing_stats  # RoutingStats over max_batch_size sequence slots, or None
        self.observer = observer or Observer()
        self.cache = cache
        self.manager = cache.manager
        self.dispatch = dispatch
        self.max_batch_size = max_batch_size
        self.max_queued = max_queued
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        self.prefill_only_factor = max(1, prefill_only_factor)
        self.max_len = max_len or dense.cfg.max_position_embeddings
        # >1: split each step into micro-batches run concurrently, so one's dense compute overlaps
        # another's expert calls (costs one more expert call per group and layer)
        self.micro_batches = micro_batches
        # only steps this large are split: prefill-heavy steps are compute-bound and gain from the
        # overlap; decode steps are dispatch-bound and would only pay for the extra calls
        self.micro_batch_min_tokens = micro_batch_min_tokens
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[GenerationRequest] = []  # in admission order
        self.timings = StepTimings()
        self.kv = KVStats()
        self._slots = list(range(max_batch_size - 1, -1, -1))  # sequence ids (RoutingStats' rows)
        self._reset_prefix = False
        # the engine thread runs steps off the event loop, so HTTP stays responsive; micro-batches
        # past the first run in the pool (made on demand). torch's intra-op thread count is per
        # thread under OpenMP: each takes the one of the thread that built the engine
        self._threads = torch.get_num_threads()
        self._work = threading.Condition()  # guards `waiting`; the engine thread waits on it when idle
        self._thread: threading.Thread | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="step",
                                                           initializer=torch.set_num_threads,
                                                           initargs=(self._threads,))
        self._dense = threading.Lock()  # micro-batches' dense compute takes turns

    def max_sequence_tokens(self) -> int:
        """The longest sequence (prompt + completion) this engine can ever hold: the context,
        or fewer where the whole cache holds fewer."""
        held = self.manager.max_tokens()
        return self.max_len if held is None else min(self.max_len, held)

    def stats(self) -> dict:
        """What the engine reports (the Ingress' status and metrics read it, nothing inside):
        step timings, the queue, and its paged KV cache: blocks (used / total, bytes), prefix cache
        hits, preemptions, chunked prefills (counts since start) and the path decode attention runs."""
        t, m, kv, cache = self.timings, self.manager, self.kv, self.cache
        return {"steps": t.steps, "tokens": t.tokens, "dense_s": t.dense, "dense_cpu_s": t.dense_cpu,
                "experts_s": t.experts, "forward_s": t.forward, "step_s": t.step,
                "running": len(self.running), "waiting": len(self.waiting),
                "kv": {"block_size": m.block_size, "blocks_total": m.pool.usable, "blocks_used": m.num_used,
                       "bytes": cache.nbytes, "block_bytes": cache.nbytes // max(cache.num_blocks, 1),
                       "max_sequence_tokens": self.max_sequence_tokens(),
                       "prefix_caching": m.prefix_caching, "prefix_queried_tokens": kv.prefix_queried_tokens,
                       "prefix_hit_tokens": kv.prefix_hit_tokens, "prefix_cached_blocks": len(m.pool.cached),
                       "preemptions": kv.preemptions, "chunked_prefills": kv.chunked_prefills,
                       "max_num_batched_tokens": self.max_num_batched_tokens,
                       "attention": cache.attention_path(), "attention_fallbacks": cache.attention_fallbacks}}

    def kv_usage(self) -> float:
        """The share of the KV cache's blocks sequences hold now (the Ingress' autoscaling metric)."""
        return self.manager.num_used / max(self.manager.pool.usable, 1)

    def submit(self, req: GenerationRequest) -> GenerationRequest:
        # requests that can start at the next step do not count against the wait queue
        can_start = max(0, self.max_batch_size - len(self.running))
        if len(self.waiting) >= self.max_queued + can_start:
            raise Overloaded(f"{len(self.waiting)} requests already waiting for KV cache space")
        if req.seed is not None:
            req.generator = torch.Generator().manual_seed(req.seed)
        if req.sampling.penalized and req.history is None:
            cut = len(req.prompt) - req.resumed
            req.history = History(self.dense.cfg.vocab_size, req.prompt[:cut], req.prompt[cut:])
        req.t_submit = time.perf_counter()
        req.loop = asyncio.get_running_loop()
        with self._work:
            self.waiting.append(req)
            self._work.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="moe-engine", daemon=True)
                self._thread.start()
        return req

    def cancel(self, req: GenerationRequest, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """The client is gone (or a stop sequence ended the text): the request leaves the queue
        now, or its KV blocks at the next step, finishing with `reason`. On the event loop."""
        if req.finish_reason is not None or req.cancelled:
            return
        req.cancelled = reason
        with self._work:
            queued = req in self.waiting
            if queued:
                self.waiting.remove(req)
        if queued:
            self._finish(req, reason)

    def reset_prefix_cache(self) -> None:
        """Cached prefixes were computed by other weights (a committed hot-swap): none is
        reused from the next step on (sequences running keep their own blocks)."""
        self._reset_prefix = True

    def _run(self) -> None:
        """The engine thread: steps while there is work, waits for a submit when there is none."""
        torch.set_num_threads(self._threads)
        while True:
            with self._work:
                while not self.running and not self.waiting:
                    self._work.wait()
            out: list[tuple[GenerationRequest, int | None]] = []
            try:
                self.step(out)
            except Exception as err:  # a failed step fails its requests, not the server
                for req in self.running:
                    req.error = err
                    self._finish(req, FinishReason.ERROR, out)
                self.running = []
            _deliver(out)

    # -- scheduling ------------------------------------------------------------------------

    def _preempt(self, req: GenerationRequest) -> None:
        """Out of blocks: `req` gives its blocks back and waits at the front of the queue; its
        tokens (prompt and produced) are computed again when it is admitted (much of them from
        the prefix cache, if its blocks were not handed out meanwhile)."""
        self.running.remove(req)
        self._release(req)
        req.phase, req.num_computed_tokens = Phase.WAITING, 0
        req.preemptions += 1
        self.kv.preemptions += 1
        with self._work:
            self.waiting.appendleft(req)

    def _release(self, req: GenerationRequest) -> None:
        if req.slot is not None:
            self.manager.free(req.slot)
            self._slots.append(req.slot)
            req.slot = None

    def _grow(self, req: GenerationRequest, total: int, scheduled: set[int], preempt_self: bool = True) -> bool:
        """Blocks for `req`'s first `total` tokens, preempting the most recently admitted
        sequence not yet scheduled this step while there are none. False: `req` itself was
        preempted (or would be, without `preempt_self`), or only scheduled ones are left."""
        while True:
            try:
                self.manager.allocate(req.slot, total, req.num_computed_tokens)
                return True
            except NoFreeBlocks:
                victim = self.running[-1]
                if id(victim) in scheduled or (victim is req and not preempt_self):
                    return False
                self._preempt(victim)
                if victim is req:
                    return False

    def _schedule(self) -> list[tuple[GenerationRequest, int]]:
        """This step's work: (request, tokens to compute), decode tokens first, then prefill
        chunks of admitted prompts, then new admissions, within the token budget. A step with
        no sequence decoding keeps no stream waiting: it may take PREFILL_ONLY_FACTOR budgets."""
        streams = any(r.phase is Phase.DECODE for r in self.running)
        budget = self.max_num_batched_tokens * (1 if streams else self.prefill_only_factor)
        plan: list[tuple[GenerationRequest, int]] = []
        scheduled: set[int] = set()
        preempted = self.kv.preemptions
        for decoding in (True, False):
            i = 0
            while i < len(self.running):
                req = self.running[i]
                if (req.phase is Phase.DECODE) != decoding or id(req) in scheduled:
                    i += 1
                    continue
                n = 1 if decoding else min(req.num_tokens - req.num_computed_tokens, budget)
                if n < 1:
                    break
                # a prompt chunk too large for the cache is made smaller before it preempts itself
                # (a sliding window's blocks hold a chunk's tokens until the step is done)
                while not (ok := self._grow(req, req.num_computed_tokens + n, scheduled, preempt_self=n == 1)) \
                        and n > 1 and req in self.running and self.running[-1] is req:
                    n = max(1, n // 2)
                if not ok:
                    if req not in self.running:  # preempted itself: the rest of the list shifted
                        continue
                    break
                plan.append((req, n))
                scheduled.add(id(req))
                budget -= n
                i += 1
        if self.kv.preemptions != preempted:  # no room for the running ones: admit nothing new
            return plan
        while self.waiting and budget > 0 and self._slots:
            with self._work:
                if not self.waiting:
                    break
                req = self.waiting[0]
            slot = self._slots.pop()
            tokens = req.prompt + req.produced
            chunk = budget
            while True:
                try:
                    computed = self.manager.admit(slot, tokens, chunk)
                    break
                except NoFreeBlocks:
                    if self.running or chunk == 1:  # wait for blocks to come back
                        computed = None
                        break
                    chunk = max(1, chunk // 2)  # alone and still too large: a smaller first chunk
            if computed is None:
                self._slots.append(slot)
                break
            with self._work:
                still_queued = bool(self.waiting) and self.waiting[0] is req
                if still_queued:
                    self.waiting.popleft()
            if not still_queued:  # cancelled meanwhile (on the event loop): it has ended already
                self.manager.free(slot)
                self._slots.append(slot)
                continue
            req.slot, req.phase, req.num_computed_tokens = slot, Phase.PREFILL, computed
            req.cached_tokens = computed
            self.kv.prefix_queried_tokens += len(tokens)
            self.kv.prefix_hit_tokens += computed
            n = min(len(tokens) - computed, chunk)
            self.running.append(req)
            plan.append((req, n))
            scheduled.add(id(req))
            budget -= n
        return plan

    def _finish(self, req: GenerationRequest, reason: FinishReason,
                out: list[tuple[GenerationRequest, int | None]] | None = None) -> None:
        """`out`: the engine thread's tokens of this step, handed to the loop together; None on
        the event loop (a queued request cancelled)."""
        req.finish_reason = reason
        req.phase = Phase.FINISHED
        self.observer.finished(req, time.perf_counter() - req.t_submit)
        self._release(req)
        if out is None:
            req.out.put_nowait(None)
        else:
            out.append((req, None))

    def step(self, out: list[tuple[GenerationRequest, int | None]]) -> None:
        """One step in the engine thread; the tokens it produced (and the Nones ending requests)
        are appended to `out` for the event loop."""
        t_step = time.perf_counter()
        if self._reset_prefix:
            self._reset_prefix = False
            self.manager.reset_prefix_cache()
        for req in [r for r in self.running if r.cancelled]:
            self.running.remove(req)
            self._finish(req, req.cancelled, out)
        plan = self._schedule()
        if not plan:
            return
        chunks = [Chunk(req.slot, req.num_computed_tokens,
                        req.tokens(req.num_computed_tokens, req.num_computed_tokens + n)) for req, n in plan]
        tokens = sum(n for _, n in plan)
        parts = split_chunks(chunks, self.micro_batches if tokens >= self.micro_batch_min_tokens else 1)
        if len(parts) == 1:
            logits = self._forward(StepBatch(chunks))
        else:
            rest = [self._pool.submit(self._forward, StepBatch(p)) for p in parts[1:]]
            try:
                first = self._forward(StepBatch(parts[0]))
            finally:  # the others write the KV cache too: never leave one running
                concurrent.futures.wait(rest)
            logits = torch.cat([first, *(f.result() for f in rest)])
        bs = self.manager.block_size
        done: set[int] = set()
        ready: list[tuple[int, GenerationRequest]] = []  # (logits row, request): a token for each this step
        for row, (req, n) in enumerate(plan):
            before = req.num_computed_tokens
            req.num_computed_tokens += n
            if req.num_computed_tokens // bs > before // bs:  # a block filled: others may share it
                self.manager.commit(req.slot, req.tokens(0, req.num_computed_tokens), req.num_computed_tokens)
            if req.num_computed_tokens < req.num_tokens:  # a prompt chunk: more of it next step
                if before == req.cached_tokens and req.phase is Phase.PREFILL:
                    self.kv.chunked_prefills += 1
                continue
            req.phase = Phase.DECODE
            ready.append((row, req))
        for (row, req), tok in zip(ready, self._sample(logits, ready)):
            if req.constraint is not None and not isinstance(tok, Exception):
                try:
                    req.constraint.advance(tok)
                except ValueError as err:
                    tok = err
            if isinstance(tok, Exception):  # this sequence's sampling failed: it ends, the batch goes on
                req.error = tok
                self._finish(req, FinishReason.ERROR, out)
                done.add(id(req))
                continue
            if req.logprobs is not None:
                req.token_logprobs.append(token_logprobs(logits[row], tok, req.logprobs))
            req.produced.append(tok)
            if req.history is not None:
                req.history.add(tok)
            now = time.perf_counter()
            if len(req.produced) == 1:
                self.observer.first_token(now - req.t_submit)
            else:
                self.observer.inter_token(now - req.t_last)
            req.t_last = now
            if not req.final_only:
                out.append((req, tok))
            reason = None
            if len(req.produced) >= req.max_tokens:
                reason = FinishReason.LENGTH
            elif tok in self._ending_ids(req):
                reason = FinishReason.STOP
            elif req.constraint is not None and req.constraint.done:  # the response format is complete
                reason = FinishReason.STOP
            elif req.num_tokens >= self.max_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                self._finish(req, reason, out)
                done.add(id(req))
        self.running = [r for r in self.running if id(r) not in done]
        self.timings.step += time.perf_counter() - t_step
        self.timings.steps += 1
        self.timings.tokens += len(chunks)
        self.timings.computed_tokens += tokens

    def _sample(self, logits: torch.Tensor, ready: list[tuple[int, GenerationRequest]]) -> list[int | Exception]:
        """A token for each (row, request), all rows in one batched pass; if that fails, row by
        row, so that only the row that fails ends (with its error in place of a token)."""
        if not ready:
            return []

        def args(part):
            reqs = [req for _, req in part]
            return (logits[[row for row, _ in part]], [r.sampling for r in reqs], [r.generator for r in reqs],
                    [r.history for r in reqs], [self._barred(r) for r in reqs],
                    [r.constraint.allowed() if r.constraint is not None else None for r in reqs])

        try:
            return sample_batch(*args(ready))
        except Exception as err:
            if len(ready) == 1:
                return [err]
        toks: list[int | Exception] = []
        for one in ready:
            try:
                toks.extend(sample_batch(*args([one])))
            except Exception as err:
                toks.append(err)
        return toks

    def _barred(self, req: GenerationRequest) -> tuple[int, ...]:
        """The ids that may not come yet: those that end the sequence, before min_tokens."""
        return self._ending_ids(req) if req.num_output < req.sampling.min_tokens else ()

    def _ending_ids(self, req: GenerationRequest) -> tuple[int, ...]:
        return ending_ids(self.dense.cfg, req.stop_at_eos, req.stop_token_ids)

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        """Embedding to logits in this thread: dense parts under the dense lock, each layer's
        expert exchange outside it (another micro-batch computes meanwhile). The whole step is
        one inference-mode region (entering one costs a few microseconds; a step entered four a
        layer)."""
        t0 = time.perf_counter()
        if self.realtime is not None:
            self.realtime.enter(batch.num_tokens * self.dense.cfg.top_k)
        try:
            with torch.inference_mode():
                return self._forward_steps(batch)
        finally:
            self.timings.forward += time.perf_counter() - t0

    def _forward_steps(self, batch: StepBatch) -> torch.Tensor:
        dense, timings = self.dense, self.timings

        def timed(fn, *args):
            with self._dense:
                t0, c0 = time.perf_counter(), time.thread_time()
                result = fn(*args)
                timings.dense += time.perf_counter() - t0
                timings.dense_cpu += time.thread_time() - c0
                return result

        h = timed(dense.embed, batch)
        picks = []
        sparse = []
        for layer in range(dense.cfg.num_layers):
            h, x, indices, weights, local = timed(_attend_and_route, dense, layer, h, batch, self.cache)
            moe = None
            if indices is not None:
                picks.append(indices)
                sparse.append(layer)
                t1 = time.perf_counter()
                moe = self.dispatch(layer, x, indices, weights)
                timings.experts += time.perf_counter() - t1
            h = dense.residual(h, moe, local)
        logits = timed(dense.logits, h, batch.last_rows)
        if self.routing_stats is not None and picks:  # once per step, all layers at once
            self.routing_stats.observe_step(sparse, torch.stack(picks).cpu(),
                                            [c.slot for c in batch.chunks], [c.start for c in batch.chunks],
                                            [len(c.tokens) for c in batch.chunks])
        return logits.cpu()  # sampling runs on the host, with each request's own generator


def _deliver(out: list[tuple[GenerationRequest, int | None]]) -> None:
    """Hand a step's tokens to the event loops that read them: one call per loop, not waited for."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, int | None]]] = {}
    for req, tok in out:
        by_loop.setdefault(req.loop, []).append((req.out, tok))
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:  # that loop is closed: nobody reads these any more
            pass


def _put_all(puts: list[tuple[asyncio.Queue, int | None]]) -> None:
    for queue, tok in puts:
        queue.put_nowait(tok)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and of its `top` most likely tokens (from the
    logits as the model gives them: temperature and top_p shape sampling, not these)."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    alts = []
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        alts = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
    return float(lp[token]), alts


def split_chunks(chunks: list[Chunk], parts: int) -> list[list[Chunk]]:
    """Contiguous groups of chunks with about equal token counts (order kept, none empty)."""
    parts = max(1, min(parts, len(chunks)))
    if parts == 1:
        return [chunks]
    total = sum(len(c.tokens) for c in chunks)
    out: list[list[Chunk]] = [[]]
    seen = 0
    for i, c in enumerate(chunks):
        remaining_chunks = len(chunks) - i
        if out[-1] and (seen >= total * len(out) / parts or remaining_chunks <= parts - len(out)) and len(out) < parts:
            out.append([])
        out[-1].append(c)
        seen += len(c.tokens)
    return out


def _attend_and_route(dense: DenseModel, layer: int, h: torch.Tensor, batch: StepBatch, cache: PagedKVCache):
    """(h after attention, the MLP input, top-k indices, weights, what the ingress computes
    itself): one layer up to the experts (in the step's inference mode). A dense layer has no
    indices; its MLP is `local`; shared experts are `local` beside the routed ones."""
    h = dense.attention(layer, h, batch, cache)
    x, indices, weights = dense.route(layer, h)
    return h, x, indices, weights, dense.local(layer, x)
