"""The scheduler alone: plans and updates over real block bookkeeping (`model.kv_blocks`), with no
model and no thread. Tokens are "sampled" by the test, as the runner would return them."""

from __future__ import annotations

import pytest

from moe_workers.engine import FinishReason, GenerationRequest, Output, RequestStatus, Scheduler
from moe_workers.engine.scheduler import Overloaded, Sampled
from moe_workers.model.kv_blocks import KVCacheManager

EOS = 2


def _scheduler(blocks=64, block_size=4, budget=16, max_batch=4, max_queued=4, prefill_only_factor=1, max_len=256):
    manager = KVCacheManager(blocks, block_size, [None], prefix_caching=True)
    return Scheduler(manager, max_batch, max_queued, max_len, budget, prefill_only_factor)


def _req(prompt, max_tokens=4, **kw):
    req = GenerationRequest(prompt=list(prompt), max_tokens=max_tokens, **kw)
    req.ending_ids = (EOS,)
    return req


def _step(s: Scheduler, token=7):
    """schedule -> (a token for each sampled row) -> update, as the engine does."""
    plan = s.schedule()
    outputs = s.update(plan, [Sampled(token) for _ in plan.sampled_rows()])
    return plan, outputs


def test_a_step_runs_decode_tokens_then_prefill_chunks_then_admissions_within_the_budget():
    s = _scheduler(budget=16)
    a, b = _req(range(10, 14), max_tokens=10), _req(range(20, 24), max_tokens=10)
    s.add(a)
    s.add(b)
    plan, outputs = _step(s)
    assert [(x.request, x.start, x.num_tokens) for x in plan.scheduled] == [(a, 0, 4), (b, 0, 4)]
    assert outputs == [Output(a, 7), Output(b, 7)]
    assert a.status is RequestStatus.RUNNING and a.decoding and a.num_computed_tokens == 4
    long = _req(range(100, 140), max_tokens=2)
    s.add(long)
    plan, _ = _step(s)
    # the two decode tokens first; the new prompt takes what is left of the 16-token budget
    assert [(x.request, x.num_tokens) for x in plan.scheduled] == [(a, 1), (b, 1), (long, 14)]
    assert plan.sampled_rows() == [0, 1]  # the prompt's chunk samples nothing yet
    plan, _ = _step(s)
    assert [(x.request, x.start, x.num_tokens) for x in plan.scheduled] == [(a, 5, 1), (b, 5, 1), (long, 14, 14)]
    assert s.kv.chunked_prefills == 1


def test_a_request_ends_with_its_status_and_gives_its_blocks_back():
    s = _scheduler()
    r = _req([5, 6, 7], max_tokens=2)
    s.add(r)
    assert r.status is RequestStatus.WAITING and r.finish_reason is None
    _step(s)
    _, outputs = _step(s)
    assert outputs == [Output(r, 7), Output(r, None)]
    assert r.status is RequestStatus.FINISHED_LENGTH and r.finish_reason == "length" and r.status.finished
    assert r.produced == [7, 7] and s.running == [] and s.manager.num_used == 0
    eos = _req([5, 6, 7], max_tokens=9)
    s.add(eos)
    _, outputs = _step(s, token=EOS)
    assert eos.finish_reason is FinishReason.STOP and outputs[-1] == Output(eos, None)


def test_a_failed_sample_ends_only_its_request():
    s = _scheduler()
    ok, bad = _req([5, 6]), _req([8, 9])
    s.add(ok)
    s.add(bad)
    plan = s.schedule()
    outputs = s.update(plan, [Sampled(7), Sampled(ValueError("nan in logits"))])
    assert outputs == [Output(ok, 7), Output(bad, None)]
    assert bad.status is RequestStatus.FINISHED_ERROR and str(bad.error) == "nan in logits"
    assert s.running == [ok]


def test_aborts_end_a_queued_request_at_once_and_a_running_one_at_the_next_step():
    s = _scheduler(max_batch=1)
    running, queued = _req([5, 6]), _req([8, 9])
    s.add(running)
    s.add(queued)
    _step(s)
    assert s.abort(queued, FinishReason.CANCELLED)  # still queued: ended now, the caller hands out its end
    assert queued.status is RequestStatus.FINISHED_ABORTED and not s.waiting
    assert not s.abort(running, FinishReason.STOP)  # running: at the next step
    assert running.status is RequestStatus.RUNNING
    plan = s.schedule()
    assert plan.scheduled == [] and plan.finished == [Output(running, None)]
    assert running.finish_reason is FinishReason.STOP and s.manager.num_used == 0
    assert not s.abort(running, FinishReason.CANCELLED) and running.finish_reason is FinishReason.STOP


def test_an_abort_reaches_a_request_preempted_back_into_the_queue():
    """Aborted while running, preempted before the next step: it must not be admitted again
    and run for a client that is gone."""
    s = _scheduler(blocks=5, block_size=4, max_batch=2, budget=16)  # 4 usable: block 0 is the null block
    first, second = _req(range(10, 17), max_tokens=8), _req(range(20, 27), max_tokens=8)
    s.add(first)
    s.add(second)
    _step(s)
    assert s.running == [first, second] and s.manager.num_free == 0
    s._aborts[second] = FinishReason.CANCELLED  # as abort() leaves it, then the step preempts it:
    s._preempt(second)
    assert second.status is RequestStatus.WAITING and list(s.waiting) == [second]
    plan = s.schedule()
    assert plan.finished == [Output(second, None)] and second.finish_reason is FinishReason.CANCELLED
    assert [x.request for x in plan.scheduled] == [first] and not s.waiting


def test_the_wait_queue_is_bounded_past_what_can_start():
    s = _scheduler(max_batch=2, max_queued=1)
    for _ in range(3):  # two can start at the next step, one waits
        s.add(_req([5]))
    with pytest.raises(Overloaded, match="3 requests already waiting"):
        s.add(_req([5]))


def test_a_preempted_request_is_computed_again_from_its_prompt_and_output():
    s = _scheduler(blocks=4, block_size=4, max_batch=2, budget=16)  # 3 usable
    first, second = _req(range(10, 14), max_tokens=8), _req(range(20, 24), max_tokens=8)
    s.add(first)
    s.add(second)
    _step(s)  # 4 tokens each: a block each, one left
    _step(s)  # 5 tokens each: first takes the last block, second is preempted
    assert s.kv.preemptions == 1 and second.status is RequestStatus.WAITING and second.num_computed_tokens == 0
    assert second.produced == [7] and second.preemptions == 1
