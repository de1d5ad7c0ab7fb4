"""The engine: a thread that steps while there is work. A step is schedule -> run -> update:
the scheduler plans which tokens run (`scheduler`), the runner runs them on the model and samples
(`runner`), the scheduler takes the tokens back and returns the step's outputs, which go to the
event loops that read them in one hand-off per loop. Nothing here knows about Ray: the same
engine runs in process (tests, benches) and in the Ingress deployment (the expert channel as its
dispatcher).

Steps run back to back in the engine thread, from admission through the forward pass (layers
and expert exchanges included) to sampling: the event loop only submits, cancels and reads
outputs, and a step's outputs reach it in one hand-off that the next step does not wait for (a
round trip between the loop and a thread cost a step 0.3-0.4 ms).
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from moe_workers.engine.request import FinishReason, GenerationRequest, Output, ending_ids
from moe_workers.engine.runner import Dispatcher, ModelRunner, StepTimings
from moe_workers.engine.scheduler import PREFILL_ONLY_FACTOR, Observer, Scheduler
from moe_workers.model.dense import DenseModel
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.model.sampling import History
from moe_workers.transport.realtime import Realtime


class Engine:
    def __init__(self, dense: DenseModel, cache: PagedKVCache, dispatch: Dispatcher, max_batch_size: int,
                 max_queued: int, micro_batches: int = 1, micro_batch_min_tokens: int = 256,
                 routing_stats=None, observer: Observer | None = None, realtime: Realtime | None = None,
                 max_num_batched_tokens: int = 2048, max_len: int | None = None,
                 prefill_only_factor: int = PREFILL_ONLY_FACTOR):
        """`max_num_batched_tokens`: a step's token budget (decode tokens always run; prefill
        chunks fill what is left), `prefill_only_factor` times that for a step with nothing
        decoding. `max_len`: the context (default: the model's). The rest: `ModelRunner`."""
        self.cfg = dense.cfg
        self.cache = cache
        self.max_len = max_len or dense.cfg.max_position_embeddings
        self.timings = StepTimings()
        self.scheduler = Scheduler(cache.manager, max_batch_size, max_queued, self.max_len,
                                   max_num_batched_tokens, prefill_only_factor, observer)
        # torch's intra-op thread count is per thread under OpenMP: the engine thread and the
        # micro-batch threads take the one of the thread that built the engine
        self._threads = torch.get_num_threads()
        self.runner = ModelRunner(dense, cache, dispatch, self.timings, micro_batches, micro_batch_min_tokens,
                                  routing_stats, realtime, self._threads)
        self._thread: threading.Thread | None = None

    @property
    def realtime(self) -> Realtime | None:
        return self.runner.realtime

    def max_sequence_tokens(self) -> int:
        """The longest sequence (prompt + completion) this engine can ever hold: the context,
        or fewer where the whole cache holds fewer."""
        held = self.cache.manager.max_tokens()
        return self.max_len if held is None else min(self.max_len, held)

    def stats(self) -> dict:
        """What the engine reports (the Ingress' status and metrics read it, nothing inside):
        step timings (and their phases: `StepTimings.profile`), the queue, and its paged KV cache: blocks (used / total, bytes), prefix cache
        hits, preemptions, chunked prefills (counts since start) and the path decode attention runs."""
        t, s, cache = self.timings, self.scheduler, self.cache
        m, kv = cache.manager, s.kv
        return {"steps": t.steps, "tokens": t.tokens, "dense_s": t.dense, "dense_cpu_s": t.dense_cpu,
                "experts_s": t.experts, "forward_s": t.forward, "step_s": t.step, "profile": t.profile(),
                "running": len(s.running), "waiting": len(s.waiting),
                "kv": {"block_size": m.block_size, "blocks_total": m.pool.usable, "blocks_used": m.num_used,
                       "bytes": cache.nbytes, "block_bytes": cache.nbytes // max(cache.num_blocks, 1),
                       "max_sequence_tokens": self.max_sequence_tokens(),
                       "prefix_caching": m.prefix_caching, "prefix_queried_tokens": kv.prefix_queried_tokens,
                       "prefix_hit_tokens": kv.prefix_hit_tokens, "prefix_cached_blocks": len(m.pool.cached),
                       "preemptions": kv.preemptions, "chunked_prefills": kv.chunked_prefills,
                       "max_num_batched_tokens": s.max_num_batched_tokens,
                       "attention": cache.attention_path(), "attention_fallbacks": cache.attention_fallbacks}}

    def kv_usage(self) -> float:
        """The share of the KV cache's blocks sequences hold now (the Ingress' autoscaling metric)."""
        m = self.cache.manager
        return m.num_used / max(m.pool.usable, 1)

    def submit(self, req: GenerationRequest) -> GenerationRequest:
        """Queue `req` (on the event loop that reads its `out`); Overloaded when the queue is full."""
        if req.seed is not None:
            req.generator = torch.Generator().manual_seed(req.seed)
        if req.sampling.penalized and req.history is None:
            cut = len(req.prompt) - req.resumed
            req.history = History(self.cfg.vocab_size, req.prompt[:cut], req.prompt[cut:])
        req.ending_ids = ending_ids(self.cfg, req.stop_at_eos, req.stop_token_ids)
        req.t_submit = time.perf_counter()
        req.loop = asyncio.get_running_loop()
        with self.scheduler.lock:
            self.scheduler.add(req)
            self.scheduler.lock.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="moe-engine", daemon=True)
                self._thread.start()
        return req

    def cancel(self, req: GenerationRequest, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """The client is gone (or a stop sequence ended the text): the request leaves the queue
        now, or its KV blocks at the next step, finishing with `reason`. On the event loop."""
        if self.scheduler.abort(req, reason):
            req.out.put_nowait(None)

    def reset_prefix_cache(self) -> None:
        """Cached prefixes were computed by other weights (a committed hot-swap): none is
        reused from the next step on (sequences running keep their own blocks)."""
        self.scheduler.reset_prefix_cache()

    def step(self) -> list[Output]:
        """One step in the engine thread: schedule -> run -> update. Returns the tokens it produced
        and the ends of the requests that ended (for the event loops)."""
        t_step = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return plan.finished
        try:
            sampled = self.runner.run(plan)
        except Exception as err:  # a failed step fails its requests, not the server
            return plan.finished + self.scheduler.fail(err)
        outputs = self.scheduler.update(plan, sampled)
        t = self.timings
        t.step += time.perf_counter() - t_step
        t.steps += 1
        t.tokens += len(plan.scheduled)
        t.computed_tokens += plan.num_tokens
        return outputs

    def _run(self) -> None:
        """The engine thread: steps while there is work, waits for a submit when there is none."""
        torch.set_num_threads(self._threads)
        while True:
            with self.scheduler.lock:
                while not self.scheduler.has_work():
                    self.scheduler.lock.wait()
            try:
                outputs = self.step()
            except Exception as err:  # the scheduler itself failed: the running requests end
                outputs = self.scheduler.fail(err)
            _deliver(outputs)


def _deliver(outputs: list[Output]) -> None:
    """Hand a step's outputs to the event loops that read them: one call per loop, not waited for."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, int | None]]] = {}
    for req, tok in outputs:
        by_loop.setdefault(req.loop, []).append((req.out, tok))
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:  # that loop is closed: nobody reads these any more
            pass


def _put_all(puts: list[tuple[asyncio.Queue, int | None]]) -> None:
    for queue, tok in puts:
        queue.put_nowait(tok)
