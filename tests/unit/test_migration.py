"""Request migration (moe_workers.serve.proxy.migration) and the proxy gate's part in it: a stream whose
Ingress replica dies goes on on another replica. No Ray: ASGI apps driven directly on one loop,
standing for Serve's proxy in front of two replicas, the first of which dies mid-stream."""

from __future__ import annotations

import asyncio
import json

import pytest

from moe_workers.serve.proxy.migration import (MAX_MIGRATIONS, RESUME_HEADER, Resume, StreamLog, parse_resume,
                                               resumable)
from moe_workers.serve.openai.protocol import RequestError
from moe_workers.serve.proxy.gate import AdmissionGate, admission_header

BODY = json.dumps({"prompt": [5, 6, 7], "max_tokens": 8, "stream": True}).encode()


def _event(tokens: list[int], finish: str | None = None, **extra) -> bytes:
    chunk = {"id": "cmpl-1", "created": 1700000000, "object": "text_completion", **extra,
             "choices": [{"index": 0, "text": "".join(f"<{t}>" for t in tokens), "token_ids": tokens,
                          "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def test_the_log_keeps_whole_events_and_what_they_carried():
    log = StreamLog()
    first, second = _event([11]), _event([12])
    # an event cut in two is held back until it is whole
    assert log.feed(first + second[:10]) == first
    assert log.token_ids == [11] and log.id == "cmpl-1" and log.created == 1700000000
    assert log.feed(second[10:] + _event([], "length")) == second + _event([], "length")
    assert log.token_ids == [11, 12] and log.finished and not log.usage_sent and not log.done
    usage = b'data: {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3}}\n\n'
    assert log.feed(usage + b"data: [DONE]\n\n")
    assert log.usage_sent and log.done
    assert log.resume() == Resume("cmpl-1", 1700000000, [11, 12], finished=True)
    assert StreamLog().resume() is None  # nothing sent: nothing to name


def test_the_resume_header_round_trips_and_bad_ones_name_the_header():
    name, value = Resume("c-1", 5, [1, 2, 3]).header()
    assert name == RESUME_HEADER
    assert parse_resume(value.decode(), vocab=10, max_tokens=4) == Resume("c-1", 5, [1, 2, 3], False)
    bad = {"{": "not JSON", '{"id": 1, "created": 5, "token_ids": []}': "expected",
           '{"id": "c", "created": true, "token_ids": []}': "expected",
           '{"id": "c", "created": 5, "token_ids": [1, 99]}': "token id 99",
           '{"id": "c", "created": 5, "token_ids": [1, "2"]}': "token id '2'",
           '{"id": "c", "created": 5, "token_ids": [1, 2, 3, 4, 5]}': "more than the request's 4"}
    for value, needle in bad.items():
        with pytest.raises(RequestError) as err:
            parse_resume(value, vocab=10, max_tokens=4)
        assert err.value.status == 400 and err.value.param == "x-moe-resume" and needle in err.value.message, value


def test_only_one_streamed_choice_is_resumable():
    assert resumable(BODY)
    for body in (b"{", b"[]", json.dumps({"prompt": [1], "stream": False}).encode(),
                 json.dumps({"prompt": [1], "stream": True, "n": 2}).encode(), json.dumps({"prompt": [1]}).encode()):
        assert not resumable(body), body


class Replicas:
    """Serve's proxy over replicas: send k goes to `plans[k]`, a list of what that replica sends
    (a response start, event bodies) before it dies (None: it finishes the response)."""

    def __init__(self, *plans):
        self.plans = list(plans)
        self.calls: list[tuple[dict, bytes]] = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:  # Serve's proxy reads the whole body for the replica
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        plan = self.plans[min(len(self.calls), len(self.plans) - 1)]
        self.calls.append((dict(scope.get("headers", [])), body))
        listening = asyncio.create_task(self._listen(receive))
        try:
            await self._answer(scope, plan, send)
        finally:
            listening.cancel()

    @staticmethod
    async def _listen(receive):
        while (await receive())["type"] != "http.disconnect":  # as Serve's proxy does, for a disconnect
            pass

    @staticmethod
    async def _answer(scope, plan, send):
        await asyncio.sleep(0.01)
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": [admission_header(4, "/")]})
            await send({"type": "http.response.body", "body": b"{}", "more_body": False})
            return
        for step in plan:
            if step is None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if isinstance(step, int):
                await send({"type": "http.response.start", "status": step,
                            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                        admission_header(4, "/")]})
            else:
                await send({"type": "http.response.body", "body": step, "more_body": True})
        # the replica died: Serve's proxy ends the request without the response's last message


async def _client(gate, body: bytes = BODY, headers=(), disconnect: asyncio.Event | None = None) -> list[dict]:
    sent: list[dict] = []
    queued = [{"type": "http.request", "body": body[:7], "more_body": True},
              {"type": "http.request", "body": body[7:], "more_body": False}]

    async def receive():
        if queued:
            return queued.pop(0)
        await (disconnect.wait() if disconnect else asyncio.Event().wait())
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await gate({"type": "http", "method": "POST", "path": "/v1/completions", "headers": list(headers)},
               receive, send)
    return sent


async def _learnt(inner) -> AdmissionGate:
    gate = AdmissionGate(inner)
    queued = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if queued:
            return queued.pop()
        await asyncio.Event().wait()

    async def send(message):
        pass
    await gate({"type": "http", "method": "GET", "path": "/v1/models", "headers": []}, receive, send)
    inner.calls.clear()
    return gate


def _stream(sent: list[dict]) -> tuple[list[int], bytes]:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    tokens = [t for e in body.split(b"\n\n") if e.startswith(b"data: {")
              for c in json.loads(e[6:]).get("choices", []) for t in c["token_ids"]]
    return tokens, body


def test_a_stream_cut_by_a_dying_replica_goes_on_on_another_as_one_stream():
    async def run():
        cut = _event([13])
        inner = Replicas([200, _event([10]), _event([11]) + _event([12]), cut[:15]],  # dies inside an event
                         [200, _event([13]), _event([14]), _event([], "length"), b"data: [DONE]\n\n", None])
        gate = await _learnt(inner)
        sent = await _client(gate, headers=[(RESUME_HEADER, b'{"forged": 1}')])
        # the client saw one response: one start, every token once, in order, and its end
        assert [m["type"] for m in sent].count("http.response.start") == 1 and sent[0]["status"] == 200
        tokens, body = _stream(sent)
        assert tokens == [10, 11, 12, 13, 14] and body.endswith(b"data: [DONE]\n\n") and body.count(b"[DONE]") == 1
        assert not sent[-1].get("more_body") and all(m.get("more_body") for m in sent[1:-1])
        # the second replica got the same body and where to go on; the client's forged header never passed
        (first_headers, first_body), (second_headers, second_body) = inner.calls
        assert RESUME_HEADER not in first_headers and first_body == second_body == BODY
        assert json.loads(second_headers[RESUME_HEADER]) == {"id": "cmpl-1", "created": 1700000000,
                                                             "token_ids": [10, 11, 12], "finished": False}
        assert gate.migrated == 1 and gate.apps["/"].in_flight == 0
    asyncio.run(run())


def test_a_request_with_nothing_sent_yet_is_sent_again_as_it_was():
    async def run():
        whole = json.dumps({"prompt": [1], "max_tokens": 2}).encode()  # not streamed: no start until done
        inner = Replicas([], [200, b'data: {"x": 1}\n\n', None])
        gate = await _learnt(inner)
        sent = await _client(gate, whole)
        assert sent[0]["status"] == 200 and _stream(sent)[1] == b'data: {"x": 1}\n\n'
        assert [h for h, _ in inner.calls] == [{}, {}] and inner.calls[1][1] == whole
    asyncio.run(run())


def test_what_cannot_be_continued_is_not_sent_again():
    async def run():
        # n 2: the gate cannot hand over two interleaved choices
        two = json.dumps({"prompt": [1], "max_tokens": 8, "stream": True, "n": 2}).encode()
        inner = Replicas([200, _event([10])], [200, _event([11]), None])
        gate = await _learnt(inner)
        sent = await _client(gate, two)
        assert len(inner.calls) == 1 and not any(m["type"] == "http.response.body" and not m.get("more_body")
                                                 for m in sent)
        # a client that went away is not served again
        gone = asyncio.Event()
        gone.set()
        inner = Replicas([200, _event([10])], [200, _event([11]), None])
        gate = await _learnt(inner)
        await _client(gate, disconnect=gone)
        assert len(inner.calls) == 1 and gate.migrated == 0
        # a replica that keeps dying is tried 1 + MAX_MIGRATIONS times, then the stream ends cut
        inner = Replicas([200, _event([10])], [200])
        gate = await _learnt(inner)
        await _client(gate)
        assert len(inner.calls) == 1 + MAX_MIGRATIONS and gate.apps["/"].in_flight == 0
    asyncio.run(run())


def test_a_stream_that_had_all_but_its_end_is_ended_by_the_gate():
    async def run():
        usage = b'data: {"id": "cmpl-1", "created": 1, "choices": [], "usage": {"total_tokens": 4}}\n\n'
        inner = Replicas([200, _event([10], "length"), usage])
        gate = await _learnt(inner)
        sent = await _client(gate)
        assert len(inner.calls) == 1 and _stream(sent)[1].endswith(usage + b"data: [DONE]\n\n")
        assert not sent[-1].get("more_body")
    asyncio.run(run())
