"""What one turn of an object's loop does (moe_operator.object_loop.needs_pass, pure): the
whole pass whenever status has not observed the current generation (so a reverted edit is applied
like any other: no record of kopf's to read), while the object is not Ready, in ray.mode KubeRay, or
while a rebalance runs; otherwise only the live report is read."""

from __future__ import annotations

import asyncio
import time

from moe_operator.api import conditions as cond
from moe_operator.object_loop import needs_pass

REST = {"experts": {"groups": 2}}
KUBERAY = {"ray": {"mode": "KubeRay"}, "experts": {"groups": 2}}


def _status(generation: int, ready: bool, **extra) -> dict:
    return {"observedGeneration": generation,
            "conditions": cond.set_condition([], cond.READY, ready, cond.SERVING if ready else cond.UNSCHEDULABLE,
                                             "m", generation), **extra}


def test_a_serving_object_at_its_generation_only_reads_its_live_report():
    assert not needs_pass(REST, {"generation": 5}, _status(5, True), first=False)


def test_every_other_turn_runs_the_whole_pass():
    assert needs_pass(REST, {"generation": 5}, _status(5, True), first=True)  # the loop's first turn
    assert needs_pass(REST, {"generation": 6}, _status(5, True), first=False)  # an edit, or a revert of one
    assert needs_pass(REST, {"generation": 5}, _status(5, False), first=False)  # not Ready: its retry
    assert needs_pass(REST, {"generation": 5}, {}, first=False)  # never reconciled
    assert needs_pass(KUBERAY, {"generation": 5}, _status(5, True), first=False)  # KubeRay moves on its own
    rebalancing = _status(5, True, autoscaling={"target": {"ExpertShard-0": ["0.0"]}})
    assert needs_pass(REST, {"generation": 5}, rebalancing, first=False)


def test_the_sleep_between_turns_ends_on_a_wake_up_on_kopf_stopping_it_or_at_its_delay():
    """`handlers.operator._sleep` over kopf's own stop flag (the `stopped` a daemon is given)."""
    from kopf._cogs.aiokits.aioenums import FlagSetter

    from moe_operator.handlers.operator import _sleep

    async def slept(trigger) -> float:
        wake, stopper = asyncio.Event(), FlagSetter()
        loop = asyncio.get_running_loop()
        if trigger == "wake":
            loop.call_later(0.05, wake.set)
        elif trigger == "stop":
            loop.call_later(0.05, stopper.set)
        t0 = time.monotonic()
        await _sleep(wake, stopper.async_waiter, 30.0 if trigger else 0.1)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not left, left  # nothing of the sleep is left running
        return time.monotonic() - t0

    assert asyncio.run(slept("wake")) < 5  # a 30 s sleep ended by the wake-up
    assert asyncio.run(slept("stop")) < 5  # ... by kopf stopping the daemon
    assert 0.09 < asyncio.run(slept(None)) < 5  # a 0.1 s sleep, nothing else happening


def test_a_turn_starts_from_the_previous_turns_status_until_the_watch_brings_it():
    """object_loop.turn_body (pure): woken before the watch delivered its own write, a turn starts
    from the status the previous turn left (a rebalance's switchedAt, say), not from the older one."""
    from moe_operator.object_loop import turn_body

    body = {"metadata": {"resourceVersion": "7"}, "status": {"autoscaling": {"phase": "Loading"}}}
    left = ("7", {"autoscaling": {"phase": "Switching", "switchedAt": "2026-12-07T17:00:00Z"}})
    raw, read = turn_body(body, left)
    assert read == "7" and raw["status"] == left[1] and raw["status"] is not left[1]
    assert body["status"] == {"autoscaling": {"phase": "Loading"}}  # kopf's body untouched
    newer = {"metadata": {"resourceVersion": "8"}, "status": {"autoscaling": {"phase": "Draining"}}}
    assert turn_body(newer, left)[0]["status"] == {"autoscaling": {"phase": "Draining"}}  # the watch's is newer
    assert turn_body(body, None)[0]["status"] == body["status"]  # a first turn, or after a failed one


def test_the_finalizer_waits_for_a_pass_under_way():
    """Wakers.locked / lock: the finalizer's handler takes the object's lock, so it runs only once
    a pass that started before it has ended (that pass might apply the application again)."""
    import threading

    from moe_operator.object_loop import Wakers

    wakers, order = Wakers(), []
    started, release = threading.Event(), threading.Event()

    def slow_pass():
        started.set()
        release.wait(5)
        order.append("pass")

    t = threading.Thread(target=wakers.locked, args=("ns/m", slow_pass))
    t.start()
    started.wait(5)

    def finalizer():
        with wakers.lock("ns/m"):
            order.append("delete")

    f = threading.Thread(target=finalizer)
    f.start()
    time.sleep(0.1)
    assert order == []  # the finalizer waits
    release.set()
    t.join(5)
    f.join(5)
    assert order == ["pass", "delete"]
    with wakers.lock("ns/other"):  # another object's lock is its own
        assert not wakers.lock("ns/m").locked()
