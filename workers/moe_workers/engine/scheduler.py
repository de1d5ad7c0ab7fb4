"""Which tokens run in a step, and what the step's sampled tokens do to each request. It never runs
the model: `schedule()` returns a `StepPlan`, the runner runs it, `update(plan, sampled)` takes
the tokens back and returns the step's outputs (vLLM v1's `Scheduler` draws the same line).

A step schedules, within a token budget (`max_num_batched_tokens`): a decode token of every
running sequence first, then chunks of prompts being prefilled (a long prompt is split over
steps, so running streams keep their pace), then newly admitted prompts, each starting after the
prefix the cache already holds computed (prefix caching). Memory is blocks (`model.kv_blocks`): a
request is admitted when blocks for its first chunk are free; when a running sequence needs a
block and none is, the most recently admitted sequence is preempted (its blocks freed, its
tokens recomputed once there is room: vLLM's policy), so no request fails or is cut short for
memory. A step with no sequence decoding keeps no stream waiting: it may take
`prefill_only_factor` budgets.

Threads: the event loop adds requests and aborts them (under `lock`); everything else runs in
the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from moe_workers.engine.request import FinishReason, GenerationRequest, Output, RequestStatus
from moe_workers.model.dense import Chunk
from moe_workers.model.kv_blocks import NoFreeBlocks

# A step with no sequence decoding (prompts only: no stream to keep waiting) may compute this many
# token budgets: at the bench's default shape 32 prompts x 256 tokens arriving together prefilled
# at 0.77 of in-process in one step, 0.69 in 2048-token steps and 0.52 in 512-token ones
PREFILL_ONLY_FACTOR = 16


class Overloaded(Exception):
    """The wait queue is full; the caller should answer 503 with Retry-After."""


class Observer:
    """What the engine reports per request (the Ingress exports it as metrics); no-ops here."""

    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def finished(self, req: GenerationRequest, seconds: float) -> None: ...


@dataclass
class KVStats:
    """The paged cache and the scheduler, since start (what status and metrics show)."""

    preemptions: int = 0  # sequences preempted for blocks (their tokens recomputed later)
    chunked_prefills: int = 0  # prompts prefilled over more than one step
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0  # of those, found computed


@dataclass
class Scheduled:
    """One request's part of a step: `num_tokens` of its known tokens from `start` on."""

    request: GenerationRequest
    start: int
    num_tokens: int
    samples: bool = field(init=False)  # the chunk reaches the newest known token: the step samples the next

    def __post_init__(self):
        self.samples = self.start + self.num_tokens == self.request.num_tokens


@dataclass
class StepPlan:
    scheduled: list[Scheduled] = field(default_factory=list)  # the logits' rows, in this order
    finished: list[Output] = field(default_factory=list)  # ended before the step (aborted)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def chunks(self) -> list[Chunk]:
        """The step as the model sees it: each sequence's slot, first position and tokens."""
        return [Chunk(s.request.slot, s.start, s.request.tokens(s.start, s.start + s.num_tokens), s.request.key)
                for s in self.scheduled]

    def sampled_rows(self) -> list[int]:
        """The logits rows (of `scheduled`) that get a token this step."""
        return [row for row, s in enumerate(self.scheduled) if s.samples]


@dataclass
class Sampled:
    """A sampled row's token (or why its sampling failed) and, with logprobs, its entry."""

    token: int | Exception
    logprobs: tuple[float, list[tuple[int, float]]] | None = None


class Scheduler:
    def __init__(self, manager, max_batch_size: int, max_queued: int, max_len: int,
                 max_num_batched_tokens: int = 2048, prefill_only_factor: int = PREFILL_ONLY_FACTOR,
                 observer: Observer | None = None):
        """`manager`: the KV cache's blocks (`model.kv_blocks.BlockManager`). `max_len`: the
        context. `max_queued`: the wait queue's bound past what can start at the next step."""
        self.manager = manager
        self.max_batch_size = max_batch_size
        self.max_queued = max_queued
        self.max_len = max_len
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        self.prefill_only_factor = max(1, prefill_only_factor)
        self.observer = observer or Observer()
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[GenerationRequest] = []  # in admission order
        self.kv = KVStats()
        self.lock = threading.Condition()  # guards `waiting` and `_aborts`: the event loop writes them too
        self._aborts: dict[GenerationRequest, FinishReason] = {}  # running ones, ended at the next step
        self._slots = list(range(max_batch_size - 1, -1, -1))  # sequence ids (RoutingStats' rows)
        self._reset_prefix = False

    # -- from the event loop -------------------------------------------------------------------

    def add(self, req: GenerationRequest) -> None:
        """Queue `req` (under `lock`); Overloaded when the wait queue is full."""
        can_start = max(0, self.max_batch_size - len(self.running))  # these do not count against it
        if len(self.waiting) >= self.max_queued + can_start:
            raise Overloaded(f"{len(self.waiting)} requests already waiting for KV cache space")
        self.waiting.append(req)

    def abort(self, req: GenerationRequest, reason: FinishReason) -> bool:
        """End `req` with `reason`: now if it is still queued (True: the caller hands out its
        end), else at the next step, which frees its blocks."""
        with self.lock:
            if req.status.finished or req in self._aborts:
                return False
            if req.status is RequestStatus.WAITING:
                if req not in self.waiting:  # never queued (the queue was full)
                    return False
                self.waiting.remove(req)
                self._end(req, reason)
                return True
            self._aborts[req] = reason
            return False

    def reset_prefix_cache(self) -> None:
        """Cached prefixes were computed by other weights (a committed hot-swap): none is reused
        from the next step on (sequences running keep their own blocks)."""
        self._reset_prefix = True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """This step's work: decode tokens first, then prefill chunks of admitted prompts, then
        new admissions, within the token budget; and the requests aborted since the last step."""
        plan = StepPlan()
        if self._reset_prefix:
            self._reset_prefix = False
            self.manager.reset_prefix_cache()
        with self.lock:
            aborts, self._aborts = self._aborts, {}
        for req, reason in aborts.items():
            if req in self.running:
                self.running.remove(req)
            else:  # preempted since: back in the queue
                with self.lock:
                    if req not in self.waiting:
                        continue
                    self.waiting.remove(req)
            self._end(req, reason)
            plan.finished.append(Output(req, None))
        streams = any(r.decoding for r in self.running)
        budget = self.max_num_batched_tokens * (1 if streams else self.prefill_only_factor)
        scheduled: set[int] = set()
        preempted = self.kv.preemptions
        for decoding in (True, False):
            i = 0
            while i < len(self.running):
                req = self.running[i]
                if req.decoding != decoding or id(req) in scheduled:
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
                plan.scheduled.append(Scheduled(req, req.num_computed_tokens, n))
                scheduled.add(id(req))
                budget -= n
                i += 1
        if self.kv.preemptions != preempted:  # no room for the running ones: admit nothing new
            return plan
        while self.waiting and budget > 0 and self._slots:
            n = self._admit_next(budget)
            if n is None:
                break
            if n:
                plan.scheduled.append(Scheduled(self.running[-1], self.running[-1].num_computed_tokens, n))
                budget -= n
        return plan

    def update(self, plan: StepPlan, sampled: list[Sampled]) -> list[Output]:
        """The step ran: its tokens computed, one sampled for each of `plan.sampled_rows()` (in that
        order). Returns the step's outputs: new tokens, and Nones for the requests that ended."""
        outputs = list(plan.finished)
        bs = self.manager.block_size
        ready: list[GenerationRequest] = []
        for s in plan.scheduled:
            req = s.request
            req.num_computed_tokens = s.start + s.num_tokens
            if req.num_computed_tokens // bs > s.start // bs:  # a block filled: others may share it
                self.manager.commit(req.slot, req.tokens(0, req.num_computed_tokens), req.num_computed_tokens)
            if s.samples:
                ready.append(req)
            elif s.start == req.cached_tokens:  # the first chunk of a prompt that needs more
                self.kv.chunked_prefills += 1
        done: set[int] = set()
        for req, got in zip(ready, sampled):
            tok = got.token
            if req.constraint is not None and not isinstance(tok, Exception):
                try:
                    req.constraint.advance(tok)
                except ValueError as err:
                    tok = err
            if isinstance(tok, Exception):  # this sequence's sampling failed: it ends, the batch goes on
                req.error = tok
                self._end(req, FinishReason.ERROR)
                outputs.append(Output(req, None))
                done.add(id(req))
                continue
            if got.logprobs is not None:
                req.token_logprobs.append(got.logprobs)
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
                outputs.append(Output(req, tok))
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._end(req, reason)
                outputs.append(Output(req, None))
                done.add(id(req))
        if done:
            self.running = [r for r in self.running if id(r) not in done]
        return outputs

    def fail(self, err: Exception) -> list[Output]:
        """The step failed: every running request ends with `err` (the server goes on)."""
        outputs = []
        for req in self.running:
            req.error = err
            self._end(req, FinishReason.ERROR)
            outputs.append(Output(req, None))
        self.running = []
        return outputs

    # -- inside ---------------------------------------------------------------------------------

    def _stop_reason(self, req: GenerationRequest, tok: int) -> FinishReason | None:
        if len(req.produced) >= req.max_tokens:
            return FinishReason.LENGTH
        if tok in req.ending_ids:
            return FinishReason.STOP
        if req.constraint is not None and req.constraint.done:  # the response format is complete
            return FinishReason.STOP
        if req.num_tokens >= self.max_len:
            return FinishReason.LENGTH
        return None

    def _end(self, req: GenerationRequest, reason: FinishReason) -> None:
        req.status = RequestStatus.finished_by(reason)
        self.observer.finished(req, time.perf_counter() - req.t_submit)
        self._release(req)

    def _admit_next(self, budget: int) -> int | None:
        """Admit the first waiting request with a first chunk of at most `budget` tokens: the
        chunk's size, 0 (it was aborted meanwhile: try the next) or None (no room: stop)."""
        with self.lock:
            if not self.waiting:
                return None
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
                    self._slots.append(slot)
                    return None
                chunk = max(1, chunk // 2)  # alone and still too large: a smaller first chunk
        with self.lock:
            still_queued = bool(self.waiting) and self.waiting[0] is req
            if still_queued:
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
        if not still_queued:  # aborted meanwhile (on the event loop): it has ended already
            self.manager.free(slot)
            self._slots.append(slot)
            return 0
        req.slot, req.num_computed_tokens = slot, computed
        req.cached_tokens = computed
        self.kv.prefix_queried_tokens += len(tokens)
        self.kv.prefix_hit_tokens += computed
        self.running.append(req)
        return min(len(tokens) - computed, chunk)

    def _preempt(self, req: GenerationRequest) -> None:
        """Out of blocks: `req` gives its blocks back and waits at the front of the queue; its
        tokens (prompt and produced) are computed again when it is admitted (much of them from
        the prefix cache, if its blocks were not handed out meanwhile)."""
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.preemptions += 1
        self.kv.preemptions += 1
        with self.lock:
            req.status = RequestStatus.WAITING
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
