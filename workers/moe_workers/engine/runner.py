"""A step plan run on the model: the one place in the engine that touches the device. Embedding
to logits (the dense part here, each MoE layer's experts through the dispatcher), then a token
sampled for each row the plan asks one of.

The dispatcher is any `(layer, x, indices, weights) -> moe_out`: experts in process (tests,
benches) or the Ingress' expert exchange (`serve.dispatch.ExpertDispatcher`). A large step may
be split into micro-batches run in threads of their own: their dense compute takes turns (one
lock) while one waits on its exchange and another computes.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moe_workers.step_profile import PHASES
from moe_workers.engine.scheduler import Sampled, StepPlan
from moe_workers.model.dense import Chunk, DenseModel, StepBatch
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.model.sampling import sample_batch
from moe_workers.transport.realtime import Realtime

Dispatcher = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # runs in a step thread


@dataclass
class StepTimings:
    """Where a step's time goes, summed over steps and micro-batches (seconds): dense compute in
    the ingress, and waiting on expert calls. Cumulative counters only, a few `perf_counter`
    reads a layer (no metric is recorded on the step's path): readers diff two reads. On a GPU
    the dense phases are the host's time to issue the kernels; the device's time shows where the
    host next waits for it (the exchange's plan reads the routing to the host).

    Phases (`step_profile.PHASES`): embed; attention; router (the gate and top-k); local (a
    dense layer's MLP, shared experts); exchange (the routed experts: the dispatcher's call,
    `experts` too); logits (final norm, lm_head and the copy to the host); sampling (tokens and
    logprobs)."""

    dense: float = 0.0
    dense_cpu: float = 0.0  # CPU of the calling thread only: with several torch threads, a share
    experts: float = 0.0
    forward: float = 0.0  # the forward passes, in their threads
    step: float = 0.0  # whole steps in the engine thread (admission, forward, sampling, the hand-off of tokens)
    steps: int = 0
    tokens: int = 0  # sequences stepped, summed over steps
    computed_tokens: int = 0  # tokens run through the model (prefill chunks and decode tokens)
    embed: float = 0.0
    attention: float = 0.0
    router: float = 0.0
    local: float = 0.0
    logits: float = 0.0
    sampling: float = 0.0

    def profile(self) -> dict:
        """The phases as `Engine.stats()` reports them: {"steps", "tokens", "forward_s", "step_s",
        "phases": {name: seconds}} (cumulative)."""
        phases = {p: getattr(self, p) for p in PHASES if p != "exchange"}
        phases["exchange"] = self.experts
        return {"steps": self.steps, "tokens": self.tokens, "forward_s": self.forward, "step_s": self.step,
                "phases": {p: phases[p] for p in PHASES}}


class ModelRunner:
    def __init__(self, dense: DenseModel, cache: PagedKVCache, dispatch: Dispatcher, timings: StepTimings,
                 micro_batches: int = 1, micro_batch_min_tokens: int = 256, routing_stats=None,
                 realtime: Realtime | None = None, threads: int | None = None):
        """`realtime`: the real-time class a step's thread takes for a small step (its rows: the
        step's tokens x top_k, what its exchanges carry at most), or None: never.
        `micro_batches` > 1: a step of at least `micro_batch_min_tokens` tokens is split so one
        part's dense compute overlaps another's expert calls (one more expert call per group and
        layer: decode steps are dispatch-bound and would only pay for it).
        `routing_stats`: RoutingStats over the sequence slots, or None."""
        self.dense = dense
        self.cache = cache
        self.dispatch = dispatch
        self.timings = timings
        self.micro_batches = micro_batches
        self.micro_batch_min_tokens = micro_batch_min_tokens
        self.routing_stats = routing_stats
        self.realtime = realtime
        # torch's intra-op thread count is per thread under OpenMP: each micro-batch thread takes
        # the one of the thread that built the engine
        threads = threads or torch.get_num_threads()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="step",
                                                           initializer=torch.set_num_threads, initargs=(threads,))
        self._dense = threading.Lock()  # micro-batches' dense compute takes turns

    def run(self, plan: StepPlan) -> list[Sampled]:
        """The plan's tokens through the model; a token for each of `plan.sampled_rows()`."""
        logits = self.logits(plan.chunks())
        t0 = time.perf_counter()
        rows = plan.sampled_rows()
        reqs = [plan.scheduled[row].request for row in rows]
        toks = self._sample(logits, rows, reqs)
        out = [Sampled(tok, token_logprobs(logits[row], tok, req.logprobs)
                       if req.logprobs is not None and not isinstance(tok, Exception) else None)
               for row, req, tok in zip(rows, reqs, toks)]
        self.timings.sampling += time.perf_counter() - t0
        return out

    def logits(self, chunks: list[Chunk]) -> torch.Tensor:
        """Each chunk's last row's logits, on the host; micro-batches when the step is large."""
        tokens = sum(len(c.tokens) for c in chunks)
        parts = split_chunks(chunks, self.micro_batches if tokens >= self.micro_batch_min_tokens else 1)
        if len(parts) == 1:
            return self._forward(StepBatch(chunks))
        rest = [self._pool.submit(self._forward, StepBatch(p)) for p in parts[1:]]
        try:
            first = self._forward(StepBatch(parts[0]))
        finally:  # the others write the KV cache too: never leave one running
            concurrent.futures.wait(rest)
        return torch.cat([first, *(f.result() for f in rest)])

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list) -> list[int | Exception]:
        """A token for each row, all rows in one batched pass; if that fails, row by row, so that
        only the row that fails ends (with its error in place of a token)."""
        if not rows:
            return []

        def args(part):
            return (logits[[rows[i] for i in part]], [reqs[i].sampling for i in part],
                    [reqs[i].generator for i in part], [reqs[i].history for i in part],
                    [reqs[i].barred() for i in part],
                    [reqs[i].constraint.allowed() if reqs[i].constraint is not None else None for i in part])

        try:
            return sample_batch(*args(range(len(rows))))
        except Exception as err:
            if len(rows) == 1:
                return [err]
        toks: list[int | Exception] = []
        for i in range(len(rows)):
            try:
                toks.extend(sample_batch(*args([i])))
            except Exception as err:
                toks.append(err)
        return toks

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
                return self.forward(batch)
        finally:
            self.timings.forward += time.perf_counter() - t0

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The layers of one (micro-)batch; the caller holds inference mode."""
        dense, timings = self.dense, self.timings

        def timed(phase, fn, *args):
            with self._dense:
                t0, c0 = time.perf_counter(), time.thread_time()
                result = fn(*args)
                spent = time.perf_counter() - t0
                timings.dense += spent
                timings.dense_cpu += time.thread_time() - c0
                setattr(timings, phase, getattr(timings, phase) + spent)
                return result

        def attend_and_route(layer, h):
            """(h after attention, the MLP input, top-k indices, weights, what the ingress
            computes itself): one layer up to the experts, each part timed. A dense layer has no
            indices; its MLP is `local`; shared experts are `local` beside the routed ones."""
            with self._dense:
                t0, c0 = time.perf_counter(), time.thread_time()
                h = dense.attention(layer, h, batch, self.cache)
                t1 = time.perf_counter()
                x, indices, weights = dense.route(layer, h)
                t2 = time.perf_counter()
                local = dense.local(layer, x)
                t3 = time.perf_counter()
                timings.attention += t1 - t0
                timings.router += t2 - t1
                timings.local += t3 - t2
                timings.dense += t3 - t0
                timings.dense_cpu += time.thread_time() - c0
                return h, x, indices, weights, local

        h = timed("embed", dense.embed, batch)
        picks = []
        sparse = []
        for layer in range(dense.cfg.num_layers):
            h, x, indices, weights, local = attend_and_route(layer, h)
            moe = None
            if indices is not None:
                picks.append(indices)
                sparse.append(layer)
                t1 = time.perf_counter()
                moe = self.dispatch(layer, x, indices, weights)
                timings.experts += time.perf_counter() - t1
            h = dense.residual(h, moe, local)
        logits = timed("logits", dense.logits, h, batch.last_rows)
        if self.routing_stats is not None and picks:  # once per step, all layers at once
            self.routing_stats.observe_step(sparse, torch.stack(picks).cpu(),
                                            [c.slot for c in batch.chunks], [c.start for c in batch.chunks],
                                            [len(c.tokens) for c in batch.chunks], [c.key for c in batch.chunks])
        t0 = time.perf_counter()
        logits = logits.cpu()  # sampling runs on the host, with each request's own generator
        timings.logits += time.perf_counter() - t0  # (on a GPU: the wait for the step's last kernels)
        return logits


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
