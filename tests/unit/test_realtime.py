"""Real-time scheduling of the threads on a small step's path (moe_workers.transport.realtime):
a thread takes SCHED_RR for a small step and goes back to the fair class for a large one; the
process' other threads are untouched; without the privilege nothing changes and the status says
why. Real syscalls (the suite runs as root, which may take SCHED_RR); the channel and the engine
with real sockets and a real checkpoint."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
import torch

from checkpoints import make_mixtral
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import DenseModel, KVCache
from moe_workers.model.experts import LocalExperts
from moe_workers.serve.engine import Engine, GenerationRequest
from moe_workers.transport import ExchangeServer, ExpertChannel, Member, Part
from moe_workers.transport.realtime import Realtime

TOKEN = "t"


def _in_thread(fn):
    """fn() in a fresh thread (so this one's class never changes); its result."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised below
            out["error"] = err

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_wanted_priority_by_step_size_and_state():
    rt = Realtime(3, max_rows=32)
    assert rt.wanted(1) == 3 and rt.wanted(32) == 3
    assert rt.wanted(33) == 0  # a large step runs in the fair class
    assert Realtime(0).wanted(1) == 0  # off
    rt.error = "refused"
    assert rt.wanted(1) == 0  # refused once: not asked again
    rt.set_priority(2)
    assert rt.error == "" and rt.wanted(1) == 2  # a new priority is asked for again
    with pytest.raises(ValueError, match="0-99"):
        Realtime(100)
    with pytest.raises(ValueError, match="0-99"):
        rt.set_priority(-1)


def test_a_small_step_takes_sched_rr_for_its_thread_only_and_a_large_one_gives_it_back():
    rt = Realtime(1, max_rows=32)
    main_before = os.sched_getscheduler(0)

    def steps():
        seen = []
        rt.enter(2)
        seen.append((os.sched_getscheduler(0), os.sched_getparam(0).sched_priority, rt.status()["threads"]))
        seen.append(_in_thread(lambda: os.sched_getscheduler(0)))
        rt.enter(64)
        seen.append((os.sched_getscheduler(0), rt.status()["threads"]))
        rt.enter(1)
        rt.set_priority(0)
        rt.enter(1)  # priority 0 from now on: back to the fair class at the next step
        seen.append((os.sched_getscheduler(0), rt.status()["threads"]))
        return seen

    seen = _in_thread(steps)
    assert seen[0] == (os.SCHED_RR, 1, 1), rt.status()
    assert seen[1] == os.SCHED_RR  # a thread it starts inherits the class (next test)
    assert seen[2] == (os.SCHED_OTHER, 0)
    assert seen[3] == (os.SCHED_OTHER, 0)
    assert os.sched_getscheduler(0) == main_before == os.SCHED_OTHER  # the calling test thread was never touched
    assert rt.error == ""


def test_a_thread_born_real_time_runs_a_large_step_in_the_fair_class():
    """A thread inherits its creator's class: the engine's micro-batch pool is started from the
    step thread, which may be real-time then, and runs only large steps. A thread's first enter()
    reads the class it has, so a large step puts it back in the fair class."""
    rt = Realtime(1)

    def born_under_rr():
        rt.enter(1)
        return _in_thread(lambda: (os.sched_getscheduler(0), rt.enter(1000), os.sched_getscheduler(0)))

    before, _, after = _in_thread(born_under_rr)
    assert before == os.SCHED_RR  # inherited
    assert after == os.SCHED_OTHER


REFUSED = """
import os, sys
sys.path[:0] = {paths!r}
from moe_workers.transport.realtime import Realtime
os.setgid(65534); os.setuid(65534)  # nobody: no CAP_SYS_NICE, RLIMIT_RTPRIO 0
rt = Realtime(1)
rt.enter(1)
print(os.sched_getscheduler(0) == os.SCHED_OTHER, rt.wanted(1), rt.status()["threads"], rt.error, sep="|")
"""


def test_without_the_privilege_nothing_changes_and_the_status_says_why():
    out = subprocess.run([sys.executable, "-c", REFUSED.format(paths=sys.path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    fair, wanted, threads, error = out.stdout.strip().split("|")
    assert (fair, wanted, threads) == ("True", "0", "0")
    assert "SCHED_RR priority 1" in error and "CAP_SYS_NICE" in error, error


def test_the_channel_server_computes_small_requests_real_time_and_large_ones_fair():
    classes = []

    def compute(layer, x, experts, counts, prefetch, out):
        classes.append((x.shape[0], os.sched_getscheduler(0)))
        out.copy_(x * 2)

    server = ExchangeServer(compute, lambda: [TOKEN], realtime_priority=1)
    ch = ExpertChannel(timeout_s=5)
    ch.update([Member("g0", "r0", server.endpoint)], TOKEN)
    try:
        for rows in (1, 32, 33, 2):
            x = torch.randn(rows, 8)
            assert torch.equal(ch.exchange(0, {"g0": Part([0], [rows], x)})["g0"], x * 2)
        assert classes == [(1, os.SCHED_RR), (32, os.SCHED_RR), (33, os.SCHED_OTHER), (2, os.SCHED_RR)]
        assert server.realtime.status()["threads"] == 1  # the one connection's thread
    finally:
        ch.close()
        server.close()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    # off: every request in the fair class
    classes.clear()
    server = ExchangeServer(compute, lambda: [TOKEN], realtime_priority=0)
    ch = ExpertChannel(timeout_s=5)
    ch.update([Member("g0", "r0", server.endpoint)], TOKEN)
    try:
        ch.exchange(0, {"g0": Part([0], [1], torch.randn(1, 8))})
        assert classes == [(1, os.SCHED_OTHER)] and server.realtime.status()["threads"] == 0
    finally:
        ch.close()
        server.close()


def test_the_engine_runs_decode_steps_real_time_and_a_long_prefill_fair(tmp_path):
    make_mixtral(tmp_path, num_local_experts=4, num_hidden_layers=2)
    ckpt = Checkpoint(tmp_path)
    dense = DenseModel(ckpt.config, ckpt.dense_state())
    experts = LocalExperts(ckpt, ckpt.config.dtype)
    seen = []  # (rows the layer's exchange carries, the step thread's class)

    def dispatch(layer, x, indices, weights):
        seen.append((indices.numel(), os.sched_getscheduler(0)))
        return experts.moe(layer, x, indices, weights)

    cache = KVCache(ckpt.config, 2, ckpt.config.max_position_embeddings, ckpt.config.dtype)
    engine = Engine(dense, cache, dispatch, 4, 8, realtime=Realtime(1))
    top_k = ckpt.config.top_k

    async def main():
        req = engine.submit(GenerationRequest(prompt=list(range(3, 3 + 40)), max_tokens=3, stop_at_eos=False))
        while await req.out.get() is not None:
            pass
        assert req.error is None, req.error

    asyncio.run(main())
    prefill = [cls for rows, cls in seen if rows == 40 * top_k]
    decode = [cls for rows, cls in seen if rows == top_k]
    assert prefill and set(prefill), seen
    assert set(prefill) == {os.SCHED_OTHER}  # 80 rows: the fair class
    assert decode and set(decode) == {os.SCHED_RR}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
