"""Admission in Ray Serve's HTTP proxy, before Serve's router: an ASGI middleware.

Serve's router refuses a request with 503 once the Ingress replicas are full and its own queue in
the proxy is too. That queue is the costly part under overload: a queued request asks the full
replicas again and again, with a backoff, and a small queue refuses requests that arrive
together while the replicas have room (Serve counts a request as queued while it asks one).
Measured on the 2-core machine: with everything admitted to the replica, 160 clients kept 0.92
of the knee's goodput; with Serve's queue full, 0.6-0.7.

This gate counts the generation requests (POST) it let through to each app and still in flight,
and refuses the next one, with 503 and `Retry-After: 1`, when the app's replicas hold as many as
they take (their batch + wait queue): the replica is never asked, Serve's router does not queue,
nothing is logged. The refusal is sent after its Retry-After: a refusal that cheap invites a
client that resends at once to resend hundreds of times a second (measured: 300/s from 64 such
clients, whose own CPU then took a core of the two), and holding it paces such a client like one
that honours the header, for the price of an open connection and a timer.

It learns each app's capacity from the `x-moe-admission` header of the app's own responses, any
of them (set by the Ingress: capacity and route prefix; removed before the client sees it), and
gates nothing it has not learnt, so Serve's own limits stay the authority. Each proxy counts its
own traffic: with a proxy per node the replicas may still be offered more, and Serve's router
refuses that as before.

Serve installs it in a proxy process started with
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=moe_workers.serve.proxy_gate:middlewares` (`moectl up`
sets it on its Ray head; the project's Ray image sets it for KubeRay clusters).
"""

from __future__ import annotations

import asyncio
import json

from moe_workers.serve.protocol import RequestError

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "moe_workers.serve.proxy_gate:middlewares"
ADMISSION_HEADER = b"x-moe-admission"
RETRY_AFTER_S = 1


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
    __slots__ = ("capacity", "in_flight")

    def __init__(self, capacity: int):
        self.capacity, self.in_flight = capacity, 0


class AdmissionGate:
    """Pure ASGI (see the module doc). `apps`: route prefix -> what it learnt and counts."""

    def __init__(self, app):
        self.app = app
        self.apps: dict[str, _App] = {}
        self.refused = 0

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
        # only generation requests (POST) are counted and refused; any response may teach
        entry = self._app_for(path) if scope.get("method") == "POST" else None
        if entry is not None and entry.in_flight >= entry.capacity:
            self.refused += 1
            await _refuse(send, entry)
            return

        counted = entry is not None

        async def learning_send(message):
            nonlocal counted
            if message["type"] == "http.response.start" and message.get("headers"):
                kept = []
                for name, value in message["headers"]:
                    if name.lower() == ADMISSION_HEADER:
                        self._learn(path, value)
                    else:
                        kept.append((name, value))
                message = {**message, "headers": kept}
            elif counted and message["type"] == "http.response.body" and not message.get("more_body"):
                # the client has its whole answer and may send the next request at once; Serve's
                # handler returns a little later (the replica's generator ending), and the next
                # request must not find this one still counted (the replica's headroom covers it)
                counted = False
                entry.in_flight -= 1
            await send(message)

        if entry is not None:
            entry.in_flight += 1
        try:
            await self.app(scope, receive, learning_send)
        finally:
            if counted:
                entry.in_flight -= 1

    def _learn(self, path: str, value: bytes) -> None:
        got = parse_admission(value)
        if got is None or not under(path, got[1]):  # an app speaks only for its own route
            return
        capacity, prefix = got
        if prefix in self.apps:
            self.apps[prefix].capacity = capacity
        else:
            self.apps[prefix] = _App(capacity)


async def _refuse(send, entry: _App) -> None:
    # held for its Retry-After: a client that resends at once comes back no sooner than told to,
    # so a few dozen of them cannot fill the proxy's (and the machine's) time with refusals
    await asyncio.sleep(RETRY_AFTER_S)
    body = json.dumps(RequestError(
        503, f"server overloaded: the app's replicas hold {entry.capacity} requests and all are taken; "
             f"refused in the proxy; retry after {RETRY_AFTER_S} s", err_type="overloaded").body()).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def middlewares() -> list:
    """What Serve's proxy calls (through CALLBACK_ENV) for the middlewares to wrap its app in."""
    from starlette.middleware import Middleware

    return [Middleware(AdmissionGate)]
