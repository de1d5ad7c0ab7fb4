"""The admission gate in Serve's proxy (no Ray: ASGI apps driven directly on one event loop)."""

from __future__ import annotations

import asyncio
import json

from moe_workers.serve.config import AppArgs, admission_capacity
from moe_workers.serve.proxy.prefix import PREFIX_HEADER, prefix_header
from moe_workers.serve.proxy.gate import (ADMISSION_WAIT_S, PREREAD_S, AdmissionGate, admission_header, middlewares,
                                          parse_admission, under)


class Replica:
    """An ASGI app standing for the Ingress behind the proxy: each POST waits until released,
    then answers 200 with the admission header of an app at `prefix` holding `capacity`."""

    def __init__(self, capacity: int, prefix: str = "/"):
        self.capacity, self.prefix = capacity, prefix
        self.seen = 0
        self.release = asyncio.Event()

    async def __call__(self, scope, receive, send):
        self.seen += 1
        if scope.get("method") == "POST":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), admission_header(self.capacity, self.prefix)]})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _request(app, path: str = "/v1/completions", method: str = "POST") -> list[dict]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}
    await app({"type": "http", "method": method, "path": path}, receive, send)
    return sent


def _status(sent: list[dict]) -> int:
    return sent[0]["status"]


def test_the_header_round_trips_and_bad_ones_are_ignored():
    assert parse_admission(admission_header(96, "")[1]) == (96, "/")
    assert parse_admission(admission_header(8, "/m/")[1]) == (8, "/m")
    for bad in (b"", b"96", b"x /", b"0 /", b"-3 /", b"12 m", b"\xff /"):
        assert parse_admission(bad) is None, bad
    assert under("/v1/completions", "/") and under("/m/v1/x", "/m") and under("/m", "/m")
    assert not under("/mm/v1", "/m") and not under("/v1", "/m")


def test_capacity_is_every_ingress_replicas_batch_and_queue():
    args = AppArgs(model_path="/m", num_groups=2, max_batch_size=32, max_queued_requests=64, ingress_replicas=2)
    assert admission_capacity(args) == 192


def test_past_the_learnt_capacity_a_request_is_refused_without_reaching_the_replica():
    async def run():
        replica = Replica(capacity=3)
        gate = AdmissionGate(replica)
        # nothing learnt yet: the first request passes and teaches the gate; the header is removed
        replica.release.set()
        first = await _request(gate)
        assert _status(first) == 200 and all(n != b"x-moe-admission" for n, _ in first[0]["headers"])
        assert gate.apps["/"].capacity == 3 and gate.apps["/"].in_flight == 0
        replica.release.clear()
        held = [asyncio.create_task(_request(gate)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert gate.apps["/"].in_flight == 3 and replica.seen == 4
        t0 = asyncio.get_running_loop().time()
        refused = await _request(gate)
        # it waited for a place before it was refused (a resend-at-once client is paced)
        assert asyncio.get_running_loop().time() - t0 >= ADMISSION_WAIT_S
        assert _status(refused) == 503 and replica.seen == 4 and gate.refused == 1
        headers = dict(refused[0]["headers"])
        assert headers[b"retry-after"] == b"1"
        error = json.loads(refused[1]["body"])["error"]
        assert error["code"] == 503 and error["type"] == "overloaded" and "3 requests" in error["message"]
        # GETs (health, models, status) are never gated
        replica.release.set()
        assert _status(await _request(gate, "/v1/models", "GET")) == 200
        assert [_status(s) for s in await asyncio.gather(*held)] == [200, 200, 200]
        assert gate.apps["/"].in_flight == 0
        assert _status(await _request(gate)) == 200  # room again
    asyncio.run(run())


def test_each_app_is_gated_by_its_own_route_and_cannot_speak_for_another():
    async def run():
        inner = {"/a": Replica(capacity=1, prefix="/a"), "/b": Replica(capacity=5, prefix="/b")}

        async def proxy(scope, receive, send):
            await inner["/" + scope["path"].split("/")[1]](scope, receive, send)
        gate = AdmissionGate(proxy)
        for r in inner.values():
            r.release.set()
        await _request(gate, "/a/v1/completions")
        await _request(gate, "/b/v1/completions")
        assert {p: a.capacity for p, a in gate.apps.items()} == {"/a": 1, "/b": 5}
        inner["/a"].release.clear()
        busy = asyncio.create_task(_request(gate, "/a/v1/completions"))
        await asyncio.sleep(0.01)
        assert _status(await _request(gate, "/a/v1/completions")) == 503
        assert _status(await _request(gate, "/b/v1/completions")) == 200  # another app's room
        inner["/a"].release.set()
        await busy
        # an app that claims a route its request was not under is not believed
        liar = Replica(capacity=1, prefix="/b")
        liar.release.set()
        gate2 = AdmissionGate(liar)
        await _request(gate2, "/a/v1/completions")
        assert gate2.apps == {}
    asyncio.run(run())


def test_a_place_is_free_once_the_client_has_its_whole_answer():
    """Serve's handler returns after the last byte is sent (the replica's generator ending); a
    client that sends its next request at once must find its place free by then."""
    async def run():
        after_last_byte = asyncio.Event()

        async def replica(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": [admission_header(1, "/")]})
            await send({"type": "http.response.body", "body": b"done", "more_body": False})
            await after_last_byte.wait()  # Serve still winding down the request
        gate = AdmissionGate(replica)
        after_last_byte.set()
        await _request(gate)  # learns: capacity 1
        after_last_byte.clear()
        first = asyncio.create_task(_request(gate))
        await asyncio.sleep(0.01)
        assert not first.done() and gate.apps["/"].in_flight == 0
        second = asyncio.create_task(_request(gate))
        await asyncio.sleep(0.01)
        assert gate.refused == 0
        after_last_byte.set()
        assert [_status(s) for s in await asyncio.gather(first, second)] == [200, 200]
        assert gate.apps["/"].in_flight == 0
    asyncio.run(run())


def test_a_failing_app_does_not_leak_its_place():
    async def run():
        async def broken(scope, receive, send):
            raise RuntimeError("replica died")
        gate = AdmissionGate(broken)
        gate._learn("/v1/completions", admission_header(2, "/")[1])
        for _ in range(3):
            try:
                await _request(gate)
            except RuntimeError:
                pass
        assert gate.apps["/"].in_flight == 0 and gate.refused == 0
    asyncio.run(run())


def test_serve_gets_starlette_middlewares_from_the_callback():
    from starlette.middleware import Middleware

    got = middlewares()
    assert len(got) == 1 and isinstance(got[0], Middleware) and got[0].cls is AdmissionGate


def test_a_request_without_a_place_waits_for_one_in_arrival_order_and_only_then_is_refused():
    async def run():
        order: list[int] = []
        release = asyncio.Event()

        async def replica(scope, receive, send):
            body = (await receive())["body"]
            order.append(int(body))
            if body == b"0":
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": [admission_header(1, "/")]})
            await send({"type": "http.response.body", "body": b"ok", "more_body": False})

        async def request(i: int) -> list[dict]:
            sent: list[dict] = []

            async def send(message):
                sent.append(message)

            async def receive():
                return {"type": "http.request", "body": str(i).encode(), "more_body": False}
            await gate({"type": "http", "method": "POST", "path": "/v1/completions"}, receive, send)
            return sent
        gate = AdmissionGate(replica)
        gate._learn("/v1/completions", admission_header(1, "/")[1])
        first = asyncio.create_task(request(0))
        await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(request(i)) for i in (1, 2)]
        await asyncio.sleep(0.3)
        assert order == [0] and len(gate.apps["/"].waiting) == 2
        release.set()  # the place is handed on, oldest waiter first; nobody is refused
        assert [_status(s) for s in await asyncio.gather(first, *waiting)] == [200, 200, 200]
        assert order == [0, 1, 2] and gate.refused == 0
        assert gate.apps["/"].in_flight == 0 and not gate.apps["/"].waiting
        # no place within the wait: refused after it, and the refused request holds nothing
        release.clear()
        order.clear()
        first = asyncio.create_task(request(0))
        await asyncio.sleep(0.01)
        t0 = asyncio.get_running_loop().time()
        assert _status(await request(3)) == 503 and asyncio.get_running_loop().time() - t0 >= ADMISSION_WAIT_S
        assert order == [0] and gate.refused == 1 and not gate.apps["/"].waiting
        release.set()
        await first
        assert gate.apps["/"].in_flight == 0
    asyncio.run(run())


def test_places_an_app_gains_go_to_the_requests_waiting():
    async def run():
        gate = AdmissionGate(None)
        gate._learn("/v1/completions", admission_header(1, "/")[1])
        app = gate.apps["/"]
        assert await app.admit(1.0)
        waiters = [asyncio.create_task(app.admit(5.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert len(app.waiting) == 3
        gate._learn("/v1/completions", admission_header(3, "/")[1])  # a scale-up: two more places
        await asyncio.sleep(0.01)
        assert [w.done() for w in waiters] == [True, True, False] and app.in_flight == 3
        app.release()  # a place freed goes to the last waiter, not back to the count
        assert await waiters[2] and app.in_flight == 3 and not app.waiting
    asyncio.run(run())


class Recorder:
    """An ASGI app that reads the whole body as an app would and answers with what it saw."""

    def __init__(self):
        self.scopes: list[dict] = []
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        self.scopes.append(scope)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": [admission_header(8, "/")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})


def _prefix_of(scope) -> list[bytes]:
    return [v for n, v in scope.get("headers", ()) if n == PREFIX_HEADER]


def test_a_generation_request_reaches_serve_with_its_prompts_prefix_and_its_whole_body():
    async def run():
        app = Recorder()
        gate = AdmissionGate(app)
        chat = json.dumps({"messages": [{"role": "system", "content": "s" * 700}]}).encode()
        await _request(gate)  # learns the app
        parts = [chat[:100], chat[100:400], chat[400:]]

        async def receive():
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        forged = (PREFIX_HEADER, b"aaaaaaaaaaaa")  # a client cannot pick the replica
        await gate({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [forged]},
                   receive, lambda m: asyncio.sleep(0))
        assert app.bodies[-1] == chat
        (value,) = _prefix_of(app.scopes[-1])
        assert value == prefix_header("/v1/chat/completions", chat)[1] and value != forged[1]
        await _request(gate, "/v1/models", "GET")
        assert not _prefix_of(app.scopes[-1])
    asyncio.run(run())


def test_a_body_still_arriving_after_the_wait_goes_on_routed_by_load():
    async def run():
        app = Recorder()
        gate = AdmissionGate(app)
        await _request(gate)
        prompt = json.dumps({"prompt": "p" * 1000}).encode()
        parts = [prompt[:10], prompt[10:]]

        async def receive():
            if len(parts) == 1:
                await asyncio.sleep(PREREAD_S * 1.5)  # a slow client: the rest comes after the wait
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        await gate({"type": "http", "method": "POST", "path": "/v1/completions"}, receive, lambda m: asyncio.sleep(0))
        assert app.bodies[-1] == prompt and not _prefix_of(app.scopes[-1])
    asyncio.run(run())
