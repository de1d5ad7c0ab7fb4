"""What every HTTP request passes before a route of the Ingress: the API key, the announced body
size (plain ASGI, answered here), and the body read within its size and time limits."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from moe_workers.serve.auth import authorized
from moe_workers.serve.protocol import RequestError
from moe_workers.serve.proxy_gate import admission_header


class Gate:
    """What every request passes before a route, as plain ASGI: the API key, then the announced
    body size. A refusal is answered here; anything else goes through untouched. (Starlette's
    `@app.middleware("http")` would wrap every response, and each streamed token, in an extra
    task and memory stream per middleware: work that competes with the engine for the GIL.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            capacity = getattr(scope["app"].state, "admission_capacity", None)
            if capacity:
                # tell the proxy's admission gate (moe_workers.serve.proxy_gate) what this app holds
                header = admission_header(capacity, scope.get("root_path", ""))

                async def send_admission(message):
                    if message["type"] == "http.response.start":
                        message = {**message, "headers": [*message.get("headers", []), header]}
                    await send(message)
                await self.app(scope, receive, send_admission)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _refusal(scope) -> JSONResponse | None:
        state = scope["app"].state
        headers = Headers(scope=scope)
        # /v1/* needs `Authorization: Bearer <key>` when keys are configured (user_config);
        # /moe/v1/status stays open, for in-cluster use (the operator, moectl)
        keys = getattr(state, "api_keys_sha256", None)
        path, root = scope["path"], scope.get("root_path", "").rstrip("/")
        if root and path.startswith(root):
            path = path[len(root):]
        if keys and path.startswith("/v1/") and not authorized(headers.get("authorization"), keys):
            err = RequestError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                               err_type="invalid_request_error")
            body = err.body()
            body["error"]["code"] = "invalid_api_key"
            metrics = getattr(state, "metrics", None)
            if metrics is not None:
                metrics.reject(401)
            return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        # every route: a body announced larger than the limit is refused before it is read
        limit = getattr(state, "max_request_bytes", None)
        length = headers.get("content-length")
        if limit is not None and length is not None:
            if not length.isdigit():
                return JSONResponse(RequestError(400, "Content-Length is not a number").body(), status_code=400)
            if int(length) > limit:
                return JSONResponse(too_large(limit).body(), status_code=413)
        return None


def too_large(limit: int) -> RequestError:
    return RequestError(413, f"request body is larger than {limit} bytes (spec.ingress.maxRequestBytes)",
                        err_type="request_too_large")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, read up to `limit` bytes (a chunked body has no Content-Length to check first)
    and within `timeout_s` (a client sending it a byte at a time does not hold the replica)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks = request.stream().__aiter__()
    parts, size = [], 0
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise RequestError(408, f"request body not received within {timeout_s:g} s", err_type="request_timeout")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
    return b"".join(parts)
