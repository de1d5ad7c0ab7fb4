"""An Ingress replica killed in the middle of streamed decode, on a real local Ray.

The app has two Ingress replicas. Clients stream greedy completions; one Ingress replica that has
requests running is SIGKILLed. Serve's proxy ends those streams where they were; the admission
gate in the proxy (moe_workers.serve.migration) sends each again to the other replica with what
its client already has, and the client sees one whole stream: one id, every token once, the
reference's tokens, `[DONE]`. No request fails.
"""

from __future__ import annotations

import concurrent.futures
import json
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

LAYERS, EXPERTS, NEW_TOKENS = 2, 4, 40


def _ingress(url) -> dict:
    return requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]


def _stream(url: str, prompt: list[int]) -> dict:
    """One streamed completion: its status, the ids and tokens of its events, and whether it ended."""
    out = {"status": None, "ids": set(), "tokens": [], "done": False, "error": "", "start": time.monotonic()}
    try:
        with requests.post(url + "/v1/completions", stream=True, timeout=60,
                           json={"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == b"data: [DONE]":
                    out["done"] = True
                elif line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    out["ids"].add(chunk["id"])
                    for choice in chunk["choices"]:
                        out["tokens"] += choice["token_ids"]
    except requests.RequestException as e:  # a stream cut short: what the gate is there to prevent
        out["error"] = e.__class__.__name__
    out["end"] = time.monotonic()
    return out


def test_streams_on_a_killed_ingress_replica_go_on_on_the_other_one(ray_head, tmp_path):
    ray = ray_head.connect_driver(namespace="ingress-faults")
    path = tmp_path / "ckpt"
    placement, args = two_group_app(path, LAYERS, EXPERTS, ingress_replicas=2)
    reference = InProcessModel(path)
    deploy(ray_head, [serve_application("ingress-faults", "/", args, placement)])
    url = f"http://127.0.0.1:{ray_head.serve_http_port}"
    try:
        pids: set[int] = set()
        wait_for(lambda: pids.add(_ingress(url)["pid"]) or len(pids) == 2, timeout_s=120, interval_s=0.2,
                 what="both Ingress replicas answering")  # (and the proxy's gate has learnt the app)
        prompts = [[(i * 11 + k) % 90 + 3 for k in range(6)] for i in range(12)]
        expected = {tuple(p): reference.generate([p], max_tokens=NEW_TOKENS, stop_at_eos=True)[0] for p in prompts}
        outcomes: list[tuple[tuple, dict]] = []
        stop = threading.Event()

        def client(i):
            n = 0
            while not stop.is_set():
                p = prompts[(i * 5 + n) % len(prompts)]
                n += 1
                outcomes.append((tuple(p), _stream(url, p)))

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            clients = [pool.submit(client, i) for i in range(6)]
            time.sleep(3)
            # a replica with streams running: the kill cuts them
            victim = wait_for(lambda: (s := _ingress(url))["running"] > 0 and s["pid"], timeout_s=30, interval_s=0.05,
                              what="an Ingress replica with streams running")
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            time.sleep(6)
            stop.set()
            for c in clients:
                c.result(timeout=120)

        cut = [o for _, o in outcomes if o["start"] < killed < o["end"]]
        assert cut, "no stream was in flight at the kill"
        for prompt, o in outcomes:
            assert o["status"] == 200 and not o["error"] and o["done"], o
            assert len(o["ids"]) == 1, o["ids"]  # one response, even when two replicas made it
            assert o["tokens"] == expected[prompt], (o["tokens"], expected[prompt])
        print(f"streams: {len(outcomes)}, in flight at the kill: {len(cut)}")
    finally:
        delete_all(ray_head)
        ray.shutdown()
