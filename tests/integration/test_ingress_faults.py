"""An Ingress replica killed in the middle of streamed decode, on a real local Ray.

The app has two Ingress replicas. Clients stream greedy completions, and one Ingress replica that
has requests running is SIGKILLed; then, once Serve has replaced it, the same with chat
completions (with usage). Serve's proxy ends those
streams where they were; the admission gate in the proxy (moe_workers.serve.proxy.migration) sends each
again to the other replica with what its client already has, and the client sees one whole
stream: one id, every token once, the reference's tokens, `[DONE]`; a chat stream's role once,
its text the tokens' text, its usage counting every token. No request fails.
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

from tokenizers import Tokenizer

from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
from moe_workers.serve.openai.chat import ChatTemplate, write_tokenizer_config
from moe_workers.serve.config import serve_application
from moe_workers.serve.openai.protocol import ChatMessage
from serve_rest import delete_all, deploy, two_group_app
from waiting import wait_for

pytestmark = pytest.mark.ray

LAYERS, EXPERTS, NEW_TOKENS = 2, 4, 40


def _ingress(url) -> dict:
    return requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]


def _stream(url: str, prompt: list[int] | list[dict]) -> dict:
    """One streamed completion (a prompt of token ids) or chat completion (messages): its status,
    the ids, tokens, text, roles and usage of its events, and whether it ended."""
    chat = isinstance(prompt[0], dict)
    out = {"status": None, "ids": set(), "tokens": [], "text": "", "roles": [], "usage": None, "done": False,
           "error": "", "start": time.monotonic()}
    body = {"max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}
    body.update({"messages": prompt, "stream_options": {"include_usage": True}} if chat else {"prompt": prompt})
    try:
        with requests.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), stream=True, timeout=60,
                           json=body) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == b"data: [DONE]":
                    out["done"] = True
                elif line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    out["ids"].add(chunk["id"])
                    out["usage"] = chunk.get("usage") or out["usage"]
                    for choice in chunk["choices"]:
                        out["tokens"] += choice["token_ids"]
                        delta = choice.get("delta", {"content": choice.get("text")})
                        out["roles"] += [delta["role"]] if "role" in delta else []
                        out["text"] += delta.get("content") or ""
    except requests.RequestException as e:  # a stream cut short: what the gate is there to prevent
        out["error"] = e.__class__.__name__
    out["end"] = time.monotonic()
    return out


def test_streams_on_a_killed_ingress_replica_go_on_on_the_other_one(ray_head, tmp_path):
    ray = ray_head.connect_driver(namespace="ingress-faults")
    path = tmp_path / "ckpt"
    placement, args = two_group_app(path, LAYERS, EXPERTS, vocab_size=BYTE_VOCAB_SIZE, ingress_replicas=2)
    write_byte_tokenizer(path)
    write_tokenizer_config(path)
    reference = InProcessModel(path)
    tokenizer, template = Tokenizer.from_file(str(path / "tokenizer.json")), ChatTemplate.from_checkpoint(path)
    deploy(ray_head, [serve_application("ingress-faults", "/", args, placement)])
    url = f"http://127.0.0.1:{ray_head.serve_http_port}"
    try:
        pids: set[int] = set()
        wait_for(lambda: pids.add(_ingress(url)["pid"]) or len(pids) == 2, timeout_s=120, interval_s=0.2,
                 what="both Ingress replicas answering")  # (and the proxy's gate has learnt the app)
        prompts: list = [[(i * 11 + k) % 90 + 3 for k in range(6)] for i in range(6)]
        prompts += [[{"role": "user", "content": f"Count to {i}."}] for i in range(6)]

        def prompt_ids(p) -> list[int]:
            if isinstance(p[0], int):
                return p
            text = template.render([ChatMessage.model_validate(m) for m in p])
            return tokenizer.encode(text, add_special_tokens=False).ids
        expected = {json.dumps(p): reference.generate([prompt_ids(p)], max_tokens=NEW_TOKENS, stop_at_eos=True)[0]
                    for p in prompts}
        outcomes: list[tuple[str, dict]] = []

        def kill_under_load(kind: list) -> list[dict]:
            """Clients streaming `kind` prompts; an Ingress replica with streams running is killed
            (so those streams are of that kind); the streams in flight at the kill."""
            stop, start = threading.Event(), len(outcomes)

            def client(i):
                n = 0
                while not stop.is_set():
                    p = kind[(i * 5 + n) % len(kind)]
                    n += 1
                    outcomes.append((json.dumps(p), _stream(url, p)))

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                clients = [pool.submit(client, i) for i in range(6)]
                time.sleep(3)
                victim = wait_for(lambda: (s := _ingress(url))["running"] > 0 and s["pid"], timeout_s=30,
                                  interval_s=0.05, what="an Ingress replica with streams running")
                killed = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                time.sleep(6)
                stop.set()
                for c in clients:
                    c.result(timeout=120)
            # Serve's replacement answers before the next kill
            live: set[int] = set()
            wait_for(lambda: live.add(_ingress(url)["pid"]) or len(live - {victim}) == 2, timeout_s=120,
                     interval_s=0.2, what="a replacement Ingress replica")
            return [o for _, o in outcomes[start:] if o["start"] < killed < o["end"]]

        cut = kill_under_load(prompts[:6])  # completions
        assert cut, "no completion stream was in flight at the kill"
        chat_cut = kill_under_load(prompts[6:])
        assert chat_cut, "no chat stream was in flight at the kill"
        for prompt, o in outcomes:
            assert o["status"] == 200 and not o["error"] and o["done"], o
            assert len(o["ids"]) == 1, o["ids"]  # one response, even when two replicas made it
            assert o["tokens"] == expected[prompt], (o["tokens"], expected[prompt])
            assert o["text"] == tokenizer.decode(o["tokens"])
            if o["roles"] or o["usage"]:  # a chat stream: its role once, usage of every token
                assert o["roles"] == ["assistant"], o["roles"]
                assert o["usage"]["completion_tokens"] == len(o["tokens"])
                assert o["usage"]["prompt_tokens"] == len(prompt_ids(json.loads(prompt)))
        print(f"streams: {len(outcomes)}, in flight at the kills: {len(cut)} completions, {len(chat_cut)} chat")
    finally:
        delete_all(ray_head)
        ray.shutdown()
