"""A shard replica killed, then one stalled, in the middle of sustained decode, on a real local Ray.

Group 0 has two replicas, group 1 one. SIGKILL one replica of each while clients decode: every
request ends answered (200, the reference's tokens) or refused with 503 within the exchange
timeout, none hangs; Serve restarts the replicas, they rejoin the channel, and requests after
that are all answered; one of the replacements starts in the warm spare worker the app kept on
the node (the other in a new process). Then one replica of group 0 is stopped (SIGSTOP) for longer than the
exchange timeout: its parts are hedged to the group's other replica, so every request is
answered and none waits for the timeout.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import pytest
import requests

from moe_workers.model.inprocess import InProcessModel
from moe_workers.serve.config import serve_application
from serve_rest import delete_all, deploy, two_group_app
from waiting import wait_for

pytestmark = pytest.mark.ray

LAYERS, EXPERTS, TIMEOUT_S = 4, 4, 5.0


def _status(url):
    return requests.get(url + "/moe/v1/status", timeout=30).json()


def _spares(url) -> set[int]:
    return {p for n in _status(url)["spares"]["nodes"].values() for p in n["spares"]}


def test_killed_shard_replicas_fail_requests_at_most_with_503_and_rejoin(ray_head, tmp_path):
    ray = ray_head.connect_driver(namespace="channel-faults")
    path = tmp_path / "ckpt"
    placement, args = two_group_app(path, LAYERS, EXPERTS, exchange_timeout_s=TIMEOUT_S)
    reference = InProcessModel(path)
    deploy(ray_head, [serve_application("faults", "/", args, placement,
                                         replicas_per_group={"ExpertShard-0": 2, "ExpertShard-1": 1})])
    url = f"http://127.0.0.1:{ray_head.serve_http_port}"
    try:
        wait_for(lambda: sum(len(r) for r in _status(url)["channel"]["members"].values()) == 3, timeout_s=60,
                 what="three shard replicas on the channel")
        # the app's steady state: a warm spare on the node (once the replicas have settled)
        wait_for(lambda: _spares(url), timeout_s=120, what="a warm spare worker", interval_s=1)
        spares = _spares(url)
        prompts = [[(i * 7 + k) % 90 + 3 for k in range(5)] for i in range(24)]
        expected = {tuple(p): reference.generate([p], max_tokens=24, stop_at_eos=True)[0] for p in prompts}
        outcomes: list[tuple[int, float, list[int] | None]] = []
        stop = threading.Event()

        def client(i):
            n = 0
            while not stop.is_set():
                p = prompts[(i * 5 + n) % len(prompts)]
                n += 1
                t0 = time.monotonic()
                r = requests.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0},
                                  timeout=TIMEOUT_S * 6)  # a hang would raise here and fail the test
                body = r.json()
                tokens = body["choices"][0]["token_ids"] if r.status_code == 200 else None
                if r.status_code == 503:
                    assert "unavailable" in body["error"]["message"] and r.headers.get("Retry-After")
                outcomes.append((r.status_code, time.monotonic() - t0, tokens, tuple(p)))

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            clients = [pool.submit(client, i) for i in range(3)]
            time.sleep(3)
            status = _status(url)
            victims = [status_r["pid"] for status_r in status["replicas"] if status_r["group"] == "ExpertShard-0"][:1]
            victims += [status_r["pid"] for status_r in status["replicas"] if status_r["group"] == "ExpertShard-1"]
            killed_at = len(outcomes)
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            # Serve brings the replicas back; they rejoin the channel with new endpoints
            wait_for(lambda: {r["pid"] for r in _status(url)["replicas"]}.isdisjoint(victims)
                     and sum(len(r) for r in _status(url)["channel"]["members"].values()) == 3,
                     timeout_s=120, what="replacement replicas on the channel", interval_s=1)
            recovered_at = len(outcomes)
            replacements = {r["pid"] for r in _status(url)["replicas"]} - {r["pid"] for r in status["replicas"]}
            time.sleep(4)
            hedged = _status(url)["channel"]["hedged"]
            stalled = next(r["pid"] for r in _status(url)["replicas"] if r["group"] == "ExpertShard-0")
            stall_from = len(outcomes)
            os.kill(stalled, signal.SIGSTOP)
            try:
                time.sleep(TIMEOUT_S * 1.6)
            finally:
                os.kill(stalled, signal.SIGCONT)
            stall_to = len(outcomes)
            time.sleep(2)
            stop.set()
            for c in clients:
                c.result(timeout=TIMEOUT_S * 8)  # re-raises a client's assertion or timeout

        codes = [code for code, *_ in outcomes]
        assert set(codes) <= {200, 503}, codes
        for code, seconds, tokens, prompt in outcomes:
            if code == 200:
                assert tokens == expected[prompt]
        # every request ends within a step's worth of exchange timeouts, none hangs
        assert max(seconds for _, seconds, *_ in outcomes) < TIMEOUT_S * 4
        after = [code for code, *_ in outcomes[recovered_at:]]
        assert after and all(code == 200 for code in after), after
        assert killed_at > 0
        # a replacement took the spare (a process that was already running, the app imported)
        assert replacements & spares, (replacements, spares)
        # the stall: hedged to the other replica of the group, nobody waits for the exchange timeout
        during = outcomes[stall_from:stall_to]
        assert during and all(code == 200 for code, *_ in during), [code for code, *_ in during]
        assert max(seconds for _, seconds, *_ in during) < TIMEOUT_S, [round(s, 2) for _, s, *_ in during]
        assert _status(url)["channel"]["hedged"] > hedged
        failed = codes.count(503)
        print(f"requests: {len(codes)}, answered {codes.count(200)}, 503 {failed}")
    finally:
        delete_all(ray_head)
        ray.shutdown()
