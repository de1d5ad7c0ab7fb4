"""What every HTTP request passes before a route (serve/http_gate.py), on a real FastAPI app wired
as the Ingress wires its own (`install`), driven as ASGI on one event loop (no Ray, no server):
refusals in OpenAI's error object, the body's media type and encoding."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from fastapi import FastAPI, Request
from starlette.datastructures import Headers

from moe_workers.serve.http_gate import body_encoding, gunzip, install, read_body
from moe_workers.serve.openai.protocol import RequestError

LIMIT = 1024


def _app() -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None)
    install(app)
    app.state.max_request_bytes = LIMIT

    @app.post("/v1/completions")
    async def completions(request: Request):
        return json.loads(await read_body(request, LIMIT, 5.0))

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list"}

    return app


def _call(app, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""):
    """(status, headers, body) of one request through the app."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "scheme": "http", "server": ("test", 80), "http_version": "1.1",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(app(scope, receive, send))
    start = sent[0]
    return (start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in sent[1:]))


JSON = {"content-type": "application/json"}


def _error(status_headers_body) -> dict:
    status, headers, body = status_headers_body
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_an_unknown_route_and_a_wrong_method_are_openai_errors():
    """Were FastAPI's {"detail": "Not Found"} / {"detail": "Method Not Allowed"}."""
    app = _app()
    status, _, _ = got = _call(app, "POST", "/v1/nope", JSON, b"{}")
    assert status == 404 and _error(got)["message"].startswith("POST /v1/nope: no such route")
    status, headers, _ = got = _call(app, "GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST"
    assert _error(got)["message"] == "GET /v1/completions: method not allowed (allowed: POST)"
    status, headers, _ = _call(app, "HEAD", "/v1/completions")  # HEAD: the status and Allow (the server drops bodies)
    assert status == 405 and headers["allow"] == "POST"
    assert _call(app, "HEAD", "/v1/models")[0] == 200
    assert json.loads(_call(app, "GET", "/v1/models")[2]) == {"object": "list"}


@pytest.mark.parametrize("headers,status,says", [
    ({}, 415, "content-type: none is not accepted"),
    ({"content-type": "text/plain"}, 415, "content-type: 'text/plain' is not accepted"),
    ({"content-type": "application/x-www-form-urlencoded"}, 415, "content-type: 'application/x-www-form-urlencoded'"),
    ({"content-type": "application/json", "content-encoding": "br"}, 415, "content-encoding: 'br' is not accepted"),
    ({"content-type": "application/json", "content-encoding": "gzip"}, 400, "content-encoding: the body is not valid"),
])
def test_a_body_that_is_not_plain_or_gzip_json_is_refused_naming_the_header(headers, status, says):
    """Any media type was parsed as JSON, and a gzip body refused as 'not valid JSON'."""
    got = _call(_app(), "POST", "/v1/completions", headers, b'{"prompt": "hi"}')
    assert got[0] == status
    err = _error(got)
    assert err["message"].startswith(says) and err["param"] == says.split(":")[0], err


def test_a_gzip_body_is_decoded_within_the_size_limit():
    app = _app()
    body = json.dumps({"prompt": "hi"}).encode()
    for media in ("application/json", "Application/JSON; charset=utf-8"):
        got = _call(app, "POST", "/v1/completions", {"content-type": media, "content-encoding": "gzip"},
                    gzip.compress(body))
        assert got[0] == 200 and json.loads(got[2]) == {"prompt": "hi"}
    assert _call(app, "POST", "/v1/completions", {**JSON, "content-encoding": "identity"}, body)[0] == 200
    bomb = gzip.compress(b" " * (LIMIT + 1))  # a few dozen bytes on the wire, over the limit decoded
    assert len(bomb) < LIMIT
    got = _call(app, "POST", "/v1/completions", {**JSON, "content-encoding": "gzip"}, bomb)
    assert got[0] == 413 and "once decoded from gzip" in _error(got)["message"]
    assert gunzip(gzip.compress(b" " * LIMIT), LIMIT) == b" " * LIMIT  # at the limit: taken
    for broken in (gzip.compress(body)[:-6], gzip.compress(body) + b"x"):
        with pytest.raises(RequestError) as info:
            gunzip(broken, LIMIT)
        assert info.value.status == 400 and info.value.param == "content-encoding"


def test_the_media_type_is_read_as_peers_read_it():
    assert body_encoding(Headers({"content-type": "application/json"})) is None
    assert body_encoding(Headers({"content-type": "application/json;charset=UTF-8",
                                  "content-encoding": "x-gzip"})) == "gzip"
    with pytest.raises(RequestError):
        body_encoding(Headers({"content-type": "application/jsonx"}))
