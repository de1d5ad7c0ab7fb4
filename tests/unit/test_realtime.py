"""Real-time scheduling of the threads on a small step's path (moe_workers.transport.realtime):
a thread takes SCHED_RR for a small step and goes back to the fair class for a large one; the
process' other threads are untouched; without the privilege nothing changes and the status says
why. Real syscalls: where this process may take SCHED_RR (root, as the suite runs on CI) the
tests check it is taken, elsewhere that it is refused and reported; the channel and the engine
with real sockets and a real checkpoint."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from checkpoints import make_mixtral
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import DenseModel
from moe_workers.model.kv_cache import PagedKVCache
from moe_workers.model.experts import LocalExperts
from moe_workers.engine import Engine, GenerationRequest
from moe_workers.transport import ExchangeServer, ExpertChannel, Member, Part
from moe_workers.transport.realtime import Realtime, policy_of
from sched_class import in_thread as _in_thread, rr_allowed
from waiting import wait_for

TOKEN = "t"


RR = os.SCHED_RR if rr_allowed() else os.SCHED_OTHER  # the class a small step runs in here


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
    main_before = policy_of()

    def steps():
        seen = []
        rt.enter(2)
        seen.append((policy_of(), os.sched_getparam(0).sched_priority, rt.status()["threads"]))
        seen.append(_in_thread(policy_of))  # a thread it starts is born fair (reset on fork)
        rt.enter(64)
        seen.append((policy_of(), rt.status()["threads"]))
        rt.enter(1)
        rt.set_priority(0)
        rt.enter(1)  # priority 0 from now on: back to the fair class at the next step
        seen.append((policy_of(), rt.status()["threads"]))
        return seen

    seen = _in_thread(steps)
    assert seen[1] == os.SCHED_OTHER
    assert seen[2] == (os.SCHED_OTHER, 0)
    assert seen[3] == (os.SCHED_OTHER, 0)
    assert policy_of() == main_before == os.SCHED_OTHER  # the calling test thread was never touched
    if RR == os.SCHED_RR:
        assert seen[0] == (os.SCHED_RR, 1, 1), rt.status()
        assert rt.error == ""
    else:  # refused here: nothing changed, and the status says why
        assert seen[0] == (os.SCHED_OTHER, 0, 0) and "CAP_SYS_NICE" in rt.error


def test_a_thread_born_real_time_runs_a_large_step_in_the_fair_class():
    """A thread started by one that took SCHED_RR without the reset-on-fork flag (a process
    started under chrt, say) is born real-time; its first enter() reads the class it has, so a
    large step puts it back in the fair class."""
    rt = Realtime(1)

    def born_under_rr():
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))  # no reset-on-fork
        except OSError:
            pass  # not allowed here: the child is born fair, and stays so
        try:
            return _in_thread(lambda: (policy_of(), rt.enter(1000), policy_of(), rt.status()["threads"]))
        finally:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))

    before, _, after, threads = _in_thread(born_under_rr)
    assert before == RR  # inherited
    assert after == os.SCHED_OTHER and threads == 0


def test_a_team_of_torch_threads_is_born_fair_and_its_leader_never_takes_it():
    """A thread's OpenMP workers start on its first parallel region in the class it has then:
    under our SCHED_RR they are born fair (reset on fork), where a plain SCHED_RR would leave
    them real-time for good (checked from /proc). A thread on more than one torch thread never
    takes the class."""
    def team_born(flags):
        torch.set_num_threads(2)
        before = set(os.listdir("/proc/self/task"))
        try:
            os.sched_setscheduler(0, os.SCHED_RR | flags, os.sched_param(1))
        except OSError:
            pass
        a = torch.randn(512, 512)
        (a @ a).sum()  # the team is born
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        return {policy_of(int(t)) for t in set(os.listdir("/proc/self/task")) - before}

    assert _in_thread(lambda: team_born(0)) == {RR}  # a worker born real-time stays so
    rt = Realtime(1)

    def ours():
        torch.set_num_threads(2)
        before = set(os.listdir("/proc/self/task"))
        rt.enter(1)  # told one torch thread, wrongly: takes it
        a = torch.randn(512, 512)
        (a @ a).sum()
        rt.enter(1000)
        return {policy_of(int(t)) for t in set(os.listdir("/proc/self/task")) - before}

    assert _in_thread(ours) == {os.SCHED_OTHER}
    rt = Realtime(1, torch_threads=2)
    assert rt.wanted(1) == 0 and "2 torch threads" in rt.error
    assert _in_thread(lambda: (rt.enter(1), policy_of())[1]) == os.SCHED_OTHER
    rt.set_priority(3)  # a new priority does not lift it
    assert rt.wanted(1) == 0 and "torch threads" in rt.error
    server = ExchangeServer(lambda *a: None, lambda: [TOKEN], realtime_priority=1, torch_threads=2)
    try:
        assert server.realtime.wanted(1) == 0
    finally:
        server.close()


REFUSED = """
import os, sys
sys.path[:0] = {paths!r}
import resource
from moe_workers.transport.realtime import Realtime
resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
if os.geteuid() == 0:
    os.setgid(65534); os.setuid(65534)  # nobody: no CAP_SYS_NICE
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

    def compute(layer, x, experts, counts, prefetch, out, top1=None):
        classes.append((x.shape[0], policy_of()))
        out.copy_(x * 2)

    server = ExchangeServer(compute, lambda: [TOKEN], realtime_priority=1, torch_threads=1)
    ch = ExpertChannel(timeout_s=5)
    ch.update([Member("g0", "r0", server.endpoint)], TOKEN)
    try:
        for rows in (1, 32, 33, 2):
            x = torch.randn(rows, 8)
            assert torch.equal(ch.exchange(0, {"g0": Part([0], [rows], x)})["g0"], x * 2)
        assert classes == [(1, RR), (32, RR), (33, os.SCHED_OTHER), (2, RR)]
        assert server.realtime.status()["threads"] == (RR == os.SCHED_RR)  # the one connection's thread
    finally:
        ch.close()
        server.close()
    # the connection's thread left the class as it ended: the count is of live threads
    wait_for(lambda: server.realtime.status()["threads"] == 0, timeout_s=5, what="the ended thread uncounted",
             interval_s=0.01)
    assert policy_of() == os.SCHED_OTHER
    # off: every request in the fair class
    classes.clear()
    server = ExchangeServer(compute, lambda: [TOKEN], realtime_priority=0, torch_threads=1)
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
        seen.append((indices.numel(), policy_of()))
        return experts.moe(layer, x, indices, weights)

    cache = PagedKVCache(ckpt.config, 2 * -(-ckpt.config.max_position_embeddings // 16) + 1)
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
    assert decode and set(decode) == {RR}
    assert policy_of() == os.SCHED_OTHER
