"""Overload a served app without a race: while its shard replicas are stopped (SIGSTOP) no
request can finish, so whatever the app cannot hold must be refused, however fast or slow the
machine serves or sends (with 48 requests of 40 tokens, a fast machine finished the first batch
before the last requests arrived, and none was refused)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from contextlib import contextmanager

import requests

from moe_workers.serve.proxy.gate import ADMISSION_WAIT_S
from waiting import wait_for

# Shards stay stopped for at most this long: under the ingress' exchange timeout (30 s) and
# Serve's health check timeout (30 s), so nothing is failed or restarted for the stall itself
MAX_STALL_S = 20.0
SETTLE_S = 2.0


@contextmanager
def shards_stopped(url: str):
    """Every shard replica on the app's status board stopped for the block, resumed after it."""
    board = requests.get(url + "/moe/v1/status", timeout=30).json()["replicas"]
    pids = sorted({r["pid"] for r in board})
    assert pids, f"no shard replica on the status board of {url}"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def flood(url: str, send, n: int) -> list:
    """send(i) for i in range(n) while the shards are stopped, in two waves SETTLE_S apart; the
    shards resume once some were refused and no more were for SETTLE_S, and no sooner than every
    request of the second wave could have been refused (its wait in the gate, ADMISSION_WAIT_S,
    and SETTLE_S more), or after MAX_STALL_S. The results, in order, once every call is done.
    send returns (status code, anything) and raises nothing. How many the app holds is not exact:
    Serve's proxy counts a request as queued only while it picks a replica, not while it asks one,
    so requests that all arrive at once can all slip in while the count is low (seen once in a
    full test run: 48 held, none refused). The first wave fills the replica and lets the proxy
    learn it is full; the second finds its queue counted."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        with shards_stopped(url):
            deadline = time.monotonic() + MAX_STALL_S
            calls = [pool.submit(send, i) for i in range(n // 2)]
            time.sleep(SETTLE_S)
            calls += [pool.submit(send, i) for i in range(n // 2, n)]
            last_sent = time.monotonic()

            def refused():
                return sum(1 for c in calls if c.done() and c.exception() is None and c.result()[0] == 503)
            wait_for(refused, timeout_s=deadline - time.monotonic(), interval_s=0.1,
                     what=f"a refusal of {n} requests while none can finish")
            # resumed while a request of the second wave still waits in the gate (the first wave's
            # refusals come SETTLE_S before the second's, so their settling can end just before
            # those), that request takes the place a finished one frees and is answered, not
            # refused: a full run answered 40 where the gate admits 16
            all_waited = last_sent + ADMISSION_WAIT_S + SETTLE_S
            seen, since = refused(), time.monotonic()
            while time.monotonic() < min(deadline, max(since + SETTLE_S, all_waited)):
                time.sleep(0.1)
                if refused() != seen:
                    seen, since = refused(), time.monotonic()
        return [c.result(timeout=300) for c in calls]
