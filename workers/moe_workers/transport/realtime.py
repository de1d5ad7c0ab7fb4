"""Real-time scheduling for the threads on a small step's path: the ingress' step thread and the
shard replicas' channel threads.

A batch-1 decode step of a deep model is a chain of short bursts handed between processes: the
ingress computes a layer's dense part, the shards compute its experts, the ingress goes on. Each
hand-off wakes a thread, and under Linux's fair scheduler (EEVDF) a woken thread does not always
preempt what runs on its CPU: Ray's daemons, Serve's controller, metrics threads (an idle served
app takes about a quarter of one CPU here). On 2 CPUs such a wait lands on most layers. A thread
under SCHED_RR preempts every fair-class task at once, and the fair class still runs whenever the
step's threads wait (the ingress for replies, the shards between requests), so the background
loses latency, not throughput. Measured with the depth sweep, interleaved in one window
(docs/benchmarks.md): 0.40 / 0.37 / 0.38 ms of dispatch a layer at 4 / 16 / 32 layers, against
0.54 / 0.57 / 0.52 with the same threads in the fair class.

Only steps of at most `max_rows` rows run so: a prefill or a large batch computes for long
stretches, and the ingress' event loop, which feeds its streams, is a fair-class thread of the
same process. A thread switches class on its first step of the other kind (one syscall; none
while the kind stays). The kernel keeps a share of each CPU for the fair class whatever
real-time threads do (the fair server on Linux 6.12 and later, RT throttling before).

Threads a real-time one starts are born in the fair class (SCHED_RESET_ON_FORK): the wake-up
latency holder, a store's loaders, a straggler's reaper, OpenMP's team. Before that flag, a team
born real-time (a thread's intra-op workers start on its first parallel region, in the class it
has then) spun real-time after every region, through large steps too: in the default bench shape,
with the ingress on 2 torch threads, prefill fell from 0.78 to 0.67 of in-process. Only threads
that compute on one torch thread take the class at all: a real-time thread leading a fair team
would wait for it at every region's end, as exposed to the background as before (not measured).

It needs CAP_SYS_NICE (root has it) or an RLIMIT_RTPRIO of at least the priority; without it
nothing changes and `status()["error"]` says why. Priority 0 never asks.
"""

from __future__ import annotations

import os
import threading

from .wire import SMALL_ROWS

POLICY = getattr(os, "SCHED_RR", None)
RESET_ON_FORK = getattr(os, "SCHED_RESET_ON_FORK", 0)  # the threads it starts are born fair


def policy_of(tid: int = 0) -> int:
    """A thread's scheduling policy (0: the calling one), without the reset-on-fork flag."""
    return os.sched_getscheduler(tid) & ~RESET_ON_FORK


class Realtime:
    """SCHED_RR at `priority` for threads that call `enter(rows)` with a small step."""

    def __init__(self, priority: int, max_rows: int = SMALL_ROWS, torch_threads: int = 1):
        """`priority`: 1-99 (the lowest, 1, is enough to preempt the fair class), or 0: never ask.
        `torch_threads`: the intra-op threads the entering threads compute with; more than one
        never takes the class (see the module's docstring)."""
        self.max_rows = max_rows
        self.torch_threads = torch_threads
        self.set_priority(priority)  # also sets `error`: why the class is not taken (a refusal is not retried)
        self._local = threading.local()  # .priority: what this thread runs at (0: the fair class)
        self._lock = threading.Lock()
        self._threads = 0  # threads running real-time now

    def wanted(self, rows: int) -> int:
        """The priority a step of `rows` rows runs at (0: the fair class)."""
        return self.priority if rows <= self.max_rows and not self.error else 0

    def enter(self, rows: int) -> None:
        """This thread is about to run a step of `rows` rows (the hot path: an attribute read and
        a compare while the kind of step stays)."""
        want = self.wanted(rows)
        if want != getattr(self._local, "priority", None):
            self._switch(want)

    def leave(self) -> None:
        """This thread is done with steps (it is about to end): back to the fair class, so
        `status()["threads"]` counts only live threads."""
        if getattr(self._local, "priority", 0):
            self._switch(0)

    def set_priority(self, priority: int) -> None:
        """Another priority from now on; each thread takes it at its next step (0: back to the
        fair class). A new priority is asked for again even after a refusal."""
        if not 0 <= priority <= 99:
            raise ValueError(f"real-time priority must be 0-99, got {priority}")
        self.priority = priority
        self.error = self._unsuitable()

    def _unsuitable(self) -> str:
        if self.torch_threads > 1:
            return (f"not taken with {self.torch_threads} torch threads: a real-time thread would wait for its "
                    "fair-class workers at every parallel region")
        return ""

    def status(self) -> dict:
        return {"priority": self.priority, "max_rows": self.max_rows, "threads": self._threads, "error": self.error}

    def _switch(self, want: int) -> None:
        was = getattr(self._local, "priority", None)
        if was is None:  # this thread's first step: it runs in the class it was born with (its creator's)
            was = os.sched_getparam(0).sched_priority if POLICY is not None and policy_of() == POLICY else 0
            self._local.priority = was
            with self._lock:
                self._threads += was > 0
            if was == want:
                return
        try:
            if POLICY is None:
                raise OSError("no SCHED_RR on this platform")
            if want:
                os.sched_setscheduler(0, POLICY | RESET_ON_FORK, os.sched_param(want))  # 0: this thread (Linux)
            else:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError as err:
            if want:
                self.error = (f"SCHED_RR priority {want}: {err.strerror or err} (needs CAP_SYS_NICE or an "
                              "RLIMIT_RTPRIO this high)")
            return
        self._local.priority = want
        with self._lock:
            self._threads += (want > 0) - (was > 0)
