"""An autoscaled Ingress with prefix-aware routing, on a real local Ray (proxy gate installed).

The Ingress starts with one replica and may grow to two (Serve's autoscaler, target 1 request a
replica). Clients stream completions without pause: Serve adds the second replica, both count
themselves through the StatusBoard and announce twice the capacity to the proxy's admission gate,
and no request fails while it happens. Then five tenants (each its own system prompt; an odd count, as Serve's
default router, on idle replicas, alternates between them) send chat
requests one after another: each tenant's requests after its first find their prompt's prefix
computed (usage.prompt_tokens_details.cached_tokens), because the router sends them to the replica
that took the tenant first; the tenants are spread over both replicas.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import requests

from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
from moe_workers.serve.openai.chat import write_tokenizer_config
from moe_workers.serve.config import AUTO, IngressScaling, serve_application
from serve_rest import delete_all, deploy, two_group_app
from waiting import wait_for

pytestmark = pytest.mark.ray

BATCH, QUEUE = 4, 8
TENANTS = [f"You are assistant {t} of shop {t * 7}; answer briefly, politely and only about shop {t * 7}'s "
           f"catalogue, prices and delivery times. " for t in range(5)]


def _status(url) -> dict:
    return requests.get(url + "/moe/v1/status", timeout=30).json()


def test_the_ingress_scales_on_load_with_no_failed_request_and_each_prefix_keeps_to_one_replica(ray_head, tmp_path):
    path = tmp_path / "ckpt"
    scaling = IngressScaling(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0,
                             downscale_delay_s=600)
    placement, args = two_group_app(path, 2, 4, vocab_size=BYTE_VOCAB_SIZE, max_batch_size=BATCH,
                                    max_queued_requests=QUEUE, ingress_autoscaling=scaling)
    write_byte_tokenizer(path)
    write_tokenizer_config(path)
    deploy(ray_head, [serve_application("ingress-scaling", "/", args, placement)])
    url = f"http://127.0.0.1:{ray_head.serve_http_port}"
    try:
        first = _status(url)
        assert first["ingress_replicas"] == {"configured": AUTO, "live": 1}
        assert first["admission_capacity"] == BATCH + QUEUE

        outcomes: list[tuple[int, str]] = []
        stop = threading.Event()

        def client(i):
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    with requests.post(url + "/v1/completions", stream=True, timeout=60,
                                       json={"prompt": [3 + (i * 7 + n) % 90] * 5, "max_tokens": 24,
                                             "temperature": 0, "stream": True}) as r:
                        lines = [line for line in r.iter_lines() if line]
                        outcomes.append((r.status_code, "" if lines[-1:] == [b"data: [DONE]"] else repr(lines[-1:])))
                except requests.RequestException as e:
                    outcomes.append((0, e.__class__.__name__))

        pids: set[int] = set()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            clients = [pool.submit(client, i) for i in range(6)]
            started = time.monotonic()
            try:
                def scaled() -> bool:
                    s = _status(url)
                    pids.add(s["ingress"]["pid"])
                    return len(pids) == 2 and s["ingress_replicas"]["live"] == 2 \
                        and s["admission_capacity"] == 2 * (BATCH + QUEUE)
                wait_for(scaled, timeout_s=120, interval_s=0.3, what="a second Ingress replica serving, counted")
                scale_up_s = time.monotonic() - started
                time.sleep(2)  # requests on both replicas
            finally:
                stop.set()
                for c in clients:
                    c.result(timeout=120)
        failed = [o for o in outcomes if o != (200, "")]
        assert outcomes and not failed, failed[:5]

        cached: dict[int, list[int]] = {}
        for _ in range(3):
            for t, system in enumerate(TENANTS):
                r = requests.post(url + "/v1/chat/completions", timeout=60, json={
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
                    "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
                cached.setdefault(t, []).append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        # the prompt's system part is about 130 tokens (byte tokenizer): at least 7 whole blocks of 16;
        # a tenant's first request finds at most the template's and "You are assistant"'s blocks
        assert all(c[0] < 7 * 16 <= min(c[1:]) for c in cached.values()), cached
        hits: dict[int, int] = {}
        wait_for(lambda: hits.update({(s := _status(url))["ingress"]["pid"]: s["ingress"]["kv"]["prefix_hit_tokens"]})
                 or len(hits) == 2, timeout_s=30, interval_s=0.1, what="both replicas' status")
        assert all(h > 0 for h in hits.values()), hits  # the tenants are spread over both replicas
        print(f"scale-up {scale_up_s:.1f} s under load, {len(outcomes)} streams, none failed; cached {cached}")
    finally:
        delete_all(ray_head)
