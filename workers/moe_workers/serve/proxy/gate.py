"""Admission in Ray Serve's HTTP proxy, before Serve's router: an ASGI middleware.

Serve's router refuses a request with 503 once the Ingress replicas are full and its own queue in
the proxy is too. That queue is the costly part under overload: a queued request asks the full
replicas again and again, with a backoff, and a small queue refuses requests that arrive
together while the replicas have room (Serve counts a request as queued while it asks one).
Measured on the 2-core machine: with everything admitted to the replica, 160 clients kept 0.92
of the knee's goodput; with Serve's queue full, 0.6-0.7.

This gate counts the generation requests (POST) it let through to each app and still in flight.
When the app's replicas hold as many as they take (their batch + wait queue), the next request
waits in the gate for a place, after those that came before it, for up to `ADMISSION_WAIT_S`
(4 s), and is refused with 503 and `Retry-After: 1` only if none frees: the replica is never
asked, Serve's router does not queue, nothing is logged. Under steady overload a place frees
every few tens of milliseconds, so a request waits its turn instead of being refused and sent
again: each refusal costs the proxy and the client a request's work, which on the 2-core machine
came out of the app's goodput (160 clients against an app holding 96: with a 1 s wait about 20
refusals a second and 0.79-0.92 of the knee's goodput; with 4 s, none refused and 0.90-0.94).
A refusal, when it comes, has been held for the wait: a refusal sent at once invites a client
that resends at once to resend hundreds of times a second (measured: 300/s from 64 such clients,
whose own CPU then took a core of the two), and holding it paces such a client like one that
honours the header.

It learns each app's capacity from the `x-moe-admission` header of the app's own responses, any
of them (set by the Ingress: capacity and route prefix; removed before the client sees it), and
gates nothing it has not learnt, so Serve's own limits stay the authority. Each proxy counts its
own traffic: with a proxy per node the replicas may still be offered more, and Serve's router
refuses that as before.

Serve installs it in a proxy process started with
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=moe_workers.serve.proxy.gate:middlewares` (`moectl up`
sets it on its Ray head; the project's Ray image sets it for KubeRay clusters).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque

from moe_workers.serve.proxy.prefix import PREFIX_HEADER, prefix_header
from moe_workers.serve.proxy.migration import MAX_MIGRATIONS, MAX_REPLAY_BYTES, RESUME_HEADER, StreamLog, resumable
from moe_workers.serve.openai.protocol import RequestError

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "moe_workers.serve.proxy.gate:middlewares"
ADMISSION_HEADER = b"x-moe-admission"
RETRY_AFTER_S = 1
ADMISSION_WAIT_S = 4.0  # how long a request past capacity waits in the gate for a place (then 503)
PREREAD_S = 1.0  # how long the gate waits for a generation request's body before Serve routes it


def admission_header(capacity: int, route_prefix: str) -> tuple[bytes, bytes]:
    """What the Ingress adds to a response: how many generation requests its replicas hold
    (all of them together) and the app's route prefix."""
    return ADMISSION_HEADER, f"{capacity} {route_prefix or '/'}".encode()


def parse_admission(value: bytes) -> tuple[int, str] | None:
    """(capacity, route prefix) from the header's value; None if it is not one."""
    try:
        capacity, prefix = value.decode().split(" ", 1)
        capacity_n = int(capacity)
    except (UnicodeDecodeError, ValueError):
        return None
    if capacity_n < 1 or not prefix.startswith("/"):
        return None
    return capacity_n, prefix.rstrip("/") or "/"


def under(path: str, prefix: str) -> bool:
    """Whether `path` is served by the app at route `prefix` (as Serve matches routes)."""
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


class _App:
    """One app's admission: places taken, and the requests waiting for one (oldest first)."""

    __slots__ = ("capacity", "in_flight", "waiting")

    def __init__(self, capacity: int):
        self.capacity, self.in_flight = capacity, 0
        self.waiting: deque[asyncio.Future] = deque()

    async def admit(self, wait_s: float) -> bool:
        """Take a place: at once if one is free and nobody waits, else the first one freed within
        `wait_s` after those who came before. False: none was."""
        if self.in_flight < self.capacity and not self.waiting:
            self.in_flight += 1
            return True
        place = asyncio.get_running_loop().create_future()
        self.waiting.append(place)
        try:
            await asyncio.wait((place,), timeout=wait_s)
        except BaseException:
            if place.done() and not place.cancelled():  # handed a place as it was cancelled: pass it on
                self.release()
            raise
        finally:
            if not place.done():
                place.cancel()
                self.waiting.remove(place)
        return not place.cancelled()

    def release(self) -> None:
        """A place is free: the longest waiter takes it, or it is free."""
        while self.waiting:
            place = self.waiting.popleft()
            if not place.done():
                place.set_result(True)
                return
        self.in_flight -= 1

    def resize(self, capacity: int) -> None:
        """The app holds `capacity` now: places it gained go to the waiters, oldest first."""
        self.capacity = capacity
        while self.waiting and self.in_flight < self.capacity:
            place = self.waiting.popleft()
            if not place.done():
                self.in_flight += 1
                place.set_result(True)


class AdmissionGate:
    """Pure ASGI (see the module doc). `apps`: route prefix -> what it learnt and counts."""

    def __init__(self, app):
        self.app = app
        self.apps: dict[str, _App] = {}
        self.refused = 0
        self.migrated = 0  # requests sent again after their Ingress replica failed them

    def _app_for(self, path: str) -> _App | None:
        best = None
        for prefix in self.apps:
            if under(path, prefix) and (best is None or len(prefix) > len(best)):
                best = prefix
        return self.apps.get(best) if best is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "/")
        # only this gate says where a stream resumes, and what prefix a request has
        scope = _without(_without(scope, RESUME_HEADER), PREFIX_HEADER)
        # only generation requests (POST) are counted, refused and migrated; any response may teach
        entry = self._app_for(path) if scope.get("method") == "POST" else None
        req = _Request(self, path, entry, send)
        if entry is None:  # not an app's generation request (or its app not learnt yet): as it is
            await self.app(scope, receive, req.send)
            return
        if not await entry.admit(ADMISSION_WAIT_S):
            self.refused += 1
            await _refuse(send, entry)
            return
        try:
            attempt_receive = await req.preread(req.teeing(receive), PREREAD_S)
            header = prefix_header(path, bytes(req.body)) if req.body_whole else None
            scope = {**scope, "headers": [*scope.get("headers", ()), header]} if header else scope
            attempt_scope = scope
            for attempt in range(MAX_MIGRATIONS + 1):
                failure = None
                try:
                    await self.app(attempt_scope, attempt_receive, req.send)
                except Exception as err:  # noqa: BLE001 - raised again below unless the request goes on
                    failure = err
                attempt_scope = await req.next_scope(scope) if attempt < MAX_MIGRATIONS else None
                if attempt_scope is None:
                    if failure is not None:
                        raise failure
                    return
                self.migrated += 1
                attempt_receive = req.replaying(receive)
        finally:
            req.release()

    def _learn(self, path: str, value: bytes) -> None:
        got = parse_admission(value)
        if got is None or not under(path, got[1]):  # an app speaks only for its own route
            return
        capacity, prefix = got
        if prefix in self.apps:
            self.apps[prefix].resize(capacity)
        else:
            self.apps[prefix] = _App(capacity)


class _Request:
    """One request through the gate, over all its sends: what the client has been sent, its
    admission place, its body (kept for a second send) and its stream's log."""

    def __init__(self, gate: AdmissionGate, path: str, entry: _App | None, send):
        self.gate, self.path, self.entry, self.client_send = gate, path, entry, send
        self.counted = entry is not None  # holds an admission place until the client has its answer
        self.body = bytearray()
        self.body_whole = False  # the whole body was seen, and kept
        self.body_dropped = False  # ... or it was too large to keep
        self.disconnected = False
        self.started = False  # a response start went to the client
        self.completed = False  # ... and its last byte
        self.forwarding = True  # this send's messages go to the client
        self.log: StreamLog | None = None

    def release(self) -> None:
        if self.counted:
            self.counted = False
            self.entry.release()

    def teeing(self, receive):
        async def tee():
            message = await receive()
            if message["type"] == "http.request" and not self.body_dropped:
                if len(self.body) + len(message.get("body", b"")) <= MAX_REPLAY_BYTES:
                    self.body += message.get("body", b"")
                    self.body_whole = not message.get("more_body", False)
                else:
                    self.body, self.body_dropped = bytearray(), True
            elif message["type"] == "http.disconnect":
                self.disconnected = True
            return message
        return tee

    async def preread(self, receive, wait_s: float):
        """Read the body before Serve routes the request (its prompt says which replica holds its
        prefix: moe_workers.serve.proxy.router), for up to `wait_s`; the receive that gives the
        app what was read and then the rest. A body still arriving after `wait_s`, or larger than
        what the gate keeps, goes on as it comes (routed by load): the Ingress' own body timeout
        and size limit still judge it."""
        read: list[dict] = []
        deadline = asyncio.get_running_loop().time() + wait_s
        pending = None
        while not (self.body_whole or self.body_dropped or self.disconnected):
            pending = asyncio.ensure_future(receive())
            left = deadline - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait((pending,), timeout=max(left, 0))
            if not done:
                break
            read.append(pending.result())
            pending = None

        async def replay():
            nonlocal pending
            if read:
                return read.pop(0)
            if pending is not None:
                message, pending = await pending, None
                return message
            return await receive()
        return replay

    def replaying(self, receive):
        queued = [{"type": "http.request", "body": bytes(self.body), "more_body": False}]

        async def replay():
            if queued:
                return queued.pop()
            message = await receive()  # the client's receive: only its disconnect is left
            self.disconnected = self.disconnected or message["type"] == "http.disconnect"
            return message
        return replay

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            if message.get("headers"):
                kept = []
                for name, value in message["headers"]:
                    if name.lower() == ADMISSION_HEADER:
                        self.gate._learn(self.path, value)
                    else:
                        kept.append((name, value))
                message = {**message, "headers": kept}
            if self.started:  # a migrated stream goes on under the response the client has
                self.forwarding = message["status"] == 200
                return
            self.started = True
            if self.entry is not None and message["status"] == 200 and _event_stream(message):
                self.log = StreamLog()
        elif message["type"] == "http.response.body":
            if not self.forwarding:
                return
            last = not message.get("more_body", False)
            if self.log is not None:
                body = self.log.feed(message.get("body", b""))
                if last:
                    body, self.log.pending = body + self.log.pending, b""
                elif not body:
                    return
                message = {**message, "body": body}
            if last:
                # the client has its whole answer and may send the next request at once; Serve's
                # handler returns a little later (the replica's generator ending), and the next
                # request must not find this one still counted (the replica's headroom covers it)
                self.completed = True
                self.release()
        await self.client_send(message)

    async def next_scope(self, scope) -> dict | None:
        """The scope of the next send of this request, if it should have one: it failed before
        the client had all of it, the client is still there, and what it has can be continued."""
        if self.completed or self.disconnected or not self.body_whole:
            return None
        self.forwarding = True
        if not self.started or (self.log is not None and self.log.id is None):
            return scope  # the client has nothing of the answer yet: the same request again
        if self.log is None or not resumable(bytes(self.body)):
            return None
        self.log.pending = b""  # an event the dead replica did not finish: never sent, sent again whole
        if self.log.usage_sent:  # all but the stream's end: that is the gate's to send
            await self.send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return None
        resume = self.log.resume()
        return {**scope, "headers": [*scope.get("headers", ()), resume.header()]}


def _without(scope, header: bytes) -> dict:
    headers = scope.get("headers") or ()
    if not any(name.lower() == header for name, _ in headers):
        return scope
    return {**scope, "headers": [(n, v) for n, v in headers if n.lower() != header]}


def _event_stream(start) -> bool:
    return any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
               for name, value in start.get("headers", ()))


async def _refuse(send, entry: _App) -> None:
    body = json.dumps(RequestError(
        503, f"server overloaded: the app's replicas hold {entry.capacity} requests and none was freed "
             f"within {ADMISSION_WAIT_S:g} s; refused in the proxy; retry after {RETRY_AFTER_S} s",
        err_type="overloaded").body()).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def middlewares() -> list:
    """What Serve's proxy calls (through CALLBACK_ENV) for the middlewares to wrap its app in."""
    from starlette.middleware import Middleware

    return [Middleware(AdmissionGate)]
