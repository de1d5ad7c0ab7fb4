"""What every HTTP request passes before a route of the Ingress: the API key, the announced body
size (plain ASGI, answered here), and the body read within its size and time limits, as JSON
(Content-Type application/json) and, if gzip-encoded, decoded within the same size limit. Every
refusal, FastAPI's own 404 and 405 included, is OpenAI's error object (`install`).

What is taken, as vLLM's OpenAI server takes it where it decides: a body whose media type is not
application/json (or that has none) is refused, 415 (vLLM: 400 "Unsupported Media Type"); a
Content-Encoding other than gzip or identity is 415 (vLLM reads the bytes as JSON whatever the
encoding, so a gzip body fails there as not JSON); a gzip body is decoded with the body-size limit
applied to the decoded bytes (413 past it), so a small bomb cannot grow into memory."""

from __future__ import annotations

import asyncio
import zlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from moe_workers.serve.auth import authorized
from moe_workers.serve.openai.protocol import RequestError
from moe_workers.serve.proxy.gate import RETRY_AFTER_S, admission_header

JSON_MEDIA_TYPE = "application/json"
GZIP = ("gzip", "x-gzip")


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
                # tell the proxy's admission gate (moe_workers.serve.proxy.gate) what this app holds
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


def install(app: FastAPI) -> None:
    """The app's refusals in OpenAI's error object: a RequestError raised anywhere in a route
    (`Retry-After` on a 503), and Starlette's own HTTP errors (an unknown route 404, a method the
    route does not take 405 with `Allow`; a HEAD gets the status and headers without the body);
    then the Gate in front of every route."""

    async def request_error(_: Request, err: RequestError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    async def http_error(request: Request, exc: HTTPException):
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"{where}: no such route (the API is under /v1: completions, chat/completions, models)"
        elif exc.status_code == 405:
            message = f"{where}: method not allowed (allowed: {(exc.headers or {}).get('Allow', '')})"
        else:
            message = f"{where}: {exc.detail}"
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(RequestError(exc.status_code, message, err_type=err_type).body(),
                            status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_middleware(Gate)


def body_encoding(headers: Headers) -> str | None:
    """How a generation request's body is encoded ("gzip" or None), or a 415 naming the header:
    the body must be JSON (application/json, any parameters such as charset), plain or gzip."""
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != JSON_MEDIA_TYPE:
        got = f"{media!r}" if media else "none"
        raise RequestError(415, f"content-type: {got} is not accepted; send the body as JSON with "
                           f"Content-Type: {JSON_MEDIA_TYPE}", param="content-type", err_type="unsupported_media_type")
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in GZIP:
        return "gzip"
    raise RequestError(415, f"content-encoding: {encoding[:40]!r} is not accepted; send the body plain or gzip",
                       param="content-encoding", err_type="unsupported_media_type")


def gunzip(raw: bytes, limit: int) -> bytes:
    """A gzip body decoded, at most `limit` bytes of it (413 past that: the limit applies to
    what is decoded, so a small body cannot inflate into memory); a 400 if it is not gzip."""
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(raw, limit + 1)
    except zlib.error as err:
        raise RequestError(400, f"content-encoding: the body is not valid gzip ({err})",
                           param="content-encoding") from None
    if len(out) > limit or d.unconsumed_tail:
        raise RequestError(413, f"request body is larger than {limit} bytes once decoded from gzip "
                           "(spec.ingress.maxRequestBytes)", err_type="request_too_large")
    if not d.eof or d.unused_data:
        raise RequestError(400, "content-encoding: the gzip body is truncated or has data after its end",
                           param="content-encoding")
    return out


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The JSON body (its media type and encoding checked before it is read: `body_encoding`),
    read up to `limit` bytes (a chunked body has no Content-Length to check first) and within
    `timeout_s` (a client sending it a byte at a time does not hold the replica); a gzip body
    decoded within `limit`."""
    encoding = body_encoding(request.headers)
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
    raw = b"".join(parts)
    return gunzip(raw, limit) if encoding == "gzip" else raw
