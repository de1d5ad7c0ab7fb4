"""Test helpers for scheduling classes: run code in a fresh thread (so the caller's class never
changes), and whether this process may take SCHED_RR at all."""

from __future__ import annotations

import os
import threading


def in_thread(fn):
    """fn() in a fresh thread; its result (or its exception, raised here)."""
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


def rr_allowed() -> bool:
    """Whether a thread of this process may take SCHED_RR at priority 1 (CAP_SYS_NICE or an
    RLIMIT_RTPRIO, and a cgroup that lets real-time tasks run); the replicas of a local Ray
    head run as this user on this host, so it answers for them too."""
    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        except OSError:
            return False
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        return True

    return in_thread(probe)
