"""Hostile HTTP input against the Serve app on a real local Ray: every case the issue found is a
regression test (a 4xx with a JSON reason naming the field, never a 5xx, and the server keeps
serving others), bodies above the limit get 413 before they are read, clients that go away free
their sequences, and hypothesis-generated bodies never get a 5xx or a hang."""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import socket
import time
from urllib.parse import urlsplit

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints import add_tokenizer, make_mixtral
from moe_workers.model.inprocess import InProcessModel
from moe_workers.serve.config import AppArgs, serve_application
from serve_rest import delete_all, deploy
from waiting import wait_for

pytestmark = pytest.mark.ray

LIMIT = 64 * 1024  # max_request_bytes of this app
MAX_LEN = 2048
BODY_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def app(ray_head, tmp_path_factory):
    ray = ray_head.connect_driver(namespace="hostile-test")
    path = tmp_path_factory.mktemp("ckpt-hostile")
    make_mixtral(path, num_local_experts=4, num_hidden_layers=2, max_position_embeddings=MAX_LEN)
    add_tokenizer(path, 96)
    args = AppArgs(model_path=str(path), served_model_name="tiny", num_groups=2, max_batch_size=8,
                   kv_cache_budget_bytes=16 * 2**20, max_queued_requests=16, max_request_bytes=LIMIT,
                   request_body_timeout_s=BODY_TIMEOUT_S)
    placement = {"ExpertShard-0": ["0.0", "0.1", "1.0", "1.1"], "ExpertShard-1": ["0.2", "0.3", "1.2", "1.3"]}
    deploy(ray_head, [serve_application("hostile", "/", args, placement)])
    url = f"http://127.0.0.1:{ray_head.serve_http_port}"
    try:
        yield url, InProcessModel(path, max_len=64)
    finally:
        delete_all(ray_head)
        ray.shutdown()


def _post(url: str, raw: bytes, path: str = "/v1/completions", timeout: float = 60) -> requests.Response:
    return requests.post(url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=timeout)


def _good(url: str) -> list[int]:
    resp = requests.post(url + "/v1/completions", json={"prompt": [5, 9, 11], "max_tokens": 4, "temperature": 0},
                         timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


BAD = [
    (b'{"prompt":"hi","max_tokens":4,"temperature":5e-324}', "temperature: must be 0 (greedy) or at least"),
    (b'{"prompt":"hi","seed":18446744073709551616}', "seed:"),
    (b'{"prompt":"hi","seed":-9223372036854775809}', "seed:"),
    (b'{"prompt":"\\ud800"}', "prompt: not valid Unicode"),
    (b'{"prompt":"hi","user":"\\udfff"}', "user: not valid Unicode"),
    (b"[" * 60_000, "nests arrays or objects more than"),  # 100,000 is over this app's body limit
    (b'{"prompt":' + b"[" * 2000 + b"]" * 2000 + b"}", "prompt: nests arrays or objects more than"),
    (b'{"prompt":"hi","user":' + b"[" * 30_000 + b"]" * 30_000 + b"}", "user: nests arrays or objects more than"),
    (b'{"prompt":"hi","max_tokens":' + b"9" * 5000 + b"}", "max_tokens: an integer of 5000 digits"),
    (b'{"prompt":"hi","max_tokens":' + b"9" * 31 + b"}", "max_tokens: an integer of 31 digits"),
    (b'{"prompt":"hi","temperature":NaN}', "temperature: NaN is not a JSON number"),
    (b'{"prompt":"hi","temperature":-Infinity}', "temperature: -Infinity is not a JSON number"),
    (b'{"prompt":"hi","top_p":Infinity}', "top_p: Infinity is not a JSON number"),
    (b'{"prompt":[true]}', "prompt: expected a string or a list of integer token ids"),
    (b'{"prompt":["5"]}', "prompt: expected a string or a list of integer token ids"),
    (b'{"prompt":[1.0,2.0]}', "prompt: expected a string or a list of integer token ids"),
    (b'{"prompt":"hi","stream":0}', "stream: Input should be a valid boolean (got an integer)"),
    (b'{"prompt":"hi","stream":"yes"}', "stream: Input should be a valid boolean (got a string)"),
    (b'"just a string"', "request body must be a JSON object"),
    (b"\xff\xfe{}", "not valid JSON"),
] + [(b'{"prompt":"hi","%s":true}' % f.encode(), f"{f}: ") for f in ("max_tokens", "temperature", "top_p", "seed", "n")] + [
    # integers past 64 bits in any numeric keyword of a schema (a 500 from the grammar compiler before)
    (b'{"prompt":"hi","max_tokens":3,"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":'
     b'{"type":"%s","%s":%d}}}}' % (kind.encode(), keyword.encode(), value),
     f"response_format.json_schema.schema: {keyword}: {value} is outside the integers a schema can hold")
    for kind, keywords in (("number", ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")),
                           ("string", ("minLength", "maxLength")), ("array", ("minItems", "maxItems")),
                           ("object", ("minProperties", "maxProperties")))
    for keyword in keywords for value in (-(2**63) - 1, 2**64)] + [
    # a divisor whose grammar takes gigabytes and minutes to compile
    (b'{"prompt":"hi","max_tokens":3,"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":'
     b'{"type":"number","multipleOf":5000011}}}}', "response_format.json_schema.schema: multipleOf: 5000011 is not")]


@pytest.mark.parametrize("raw,needle", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_bodies_get_400_naming_what_is_wrong(app, raw, needle):
    url, _ = app
    resp = _post(url, raw)
    assert resp.status_code == 400, resp.text[:300]
    err = resp.json()["error"]
    assert needle in err["message"], err
    field = needle.split(":")[0].split(".")[0]
    if field in ("temperature", "seed", "prompt", "user", "stream", "max_tokens", "top_p", "n", "response_format"):
        assert err["param"] == field


def _openai_error(resp: requests.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_unknown_routes_and_methods_get_openai_errors(app):
    """404 and 405 were FastAPI's {"detail": ...}; HEAD got an empty 405 on every route."""
    url, _ = app
    assert "no such route" in _openai_error(requests.post(url + "/v1/nope", json={}, timeout=30), 404)["message"]
    assert "no such route" in _openai_error(requests.get(url + "/v2/models", timeout=30), 404)["message"]
    resp = requests.get(url + "/v1/completions", timeout=30)
    assert "method not allowed (allowed: POST)" in _openai_error(resp, 405)["message"]
    assert resp.headers["allow"] == "POST"
    assert _openai_error(requests.put(url + "/v1/chat/completions", json={}, timeout=30), 405)
    head = requests.head(url + "/v1/models", timeout=30)
    assert head.status_code == 200 and head.content == b""
    head = requests.head(url + "/v1/completions", timeout=30)
    assert head.status_code == 405 and head.headers["allow"] == "POST"


def test_bodies_that_are_not_json_are_415_and_gzip_is_decoded_within_the_limit(app):
    url, _ = app
    body = json.dumps({"prompt": [5, 9, 11], "max_tokens": 4, "temperature": 0}).encode()
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        err = _openai_error(requests.post(url + "/v1/completions", data=body, headers=headers, timeout=30), 415)
        assert err["param"] == "content-type"
    json_gzip = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    resp = requests.post(url + "/v1/completions", data=gzip.compress(body), headers=json_gzip, timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["token_ids"] == _good(url), resp.text[:300]
    bomb = gzip.compress(b'{"prompt": "' + b" " * (LIMIT * 4) + b'"}')  # 1 KB on the wire, 256 KB decoded
    assert len(bomb) < LIMIT
    err = _openai_error(requests.post(url + "/v1/completions", data=bomb, headers=json_gzip, timeout=30), 413)
    assert "once decoded from gzip" in err["message"]
    resp = requests.post(url + "/v1/completions", data=body, headers={**json_gzip, "Content-Encoding": "br"}, timeout=30)
    assert _openai_error(resp, 415)["param"] == "content-encoding"
    resp = _post(url, b'{"prompt":"hi","max_tokens":2,"stream_options":{"include_usage":true}}')
    assert _openai_error(resp, 400)["param"] == "stream_options"
    assert _good(url)


def test_a_tiny_top_p_is_served_and_does_not_break_the_batch(app):
    """top_p 5e-324 with temperature 1 (and a temperature at the lower limit) used to make a NaN
    distribution, and the 500 took every request of the same step with it."""
    url, reference = app
    want = reference.generate([[5, 9, 11]], max_tokens=4)[0]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        odd = [pool.submit(requests.post, url + "/v1/completions", timeout=60,
                           json={"prompt": [5, 9, 11], "max_tokens": 8, "temperature": t, "top_p": p, "seed": 1})
               for t, p in ((1.0, 5e-324), (1e-5, 1.0), (2.0, 5e-324), (1e-5, 5e-324))]
        greedy = [pool.submit(_good, url) for _ in range(2)]
        for f in odd:
            assert f.result().status_code == 200, f.result().text
        assert all(g.result() == want for g in greedy)


def test_bodies_over_the_limit_get_413_before_being_read(app):
    url, _ = app
    big = json.dumps({"prompt": "w5 " * (LIMIT // 3 + 10)}).encode()
    resp = _post(url, big)
    assert resp.status_code == 413 and "larger than 65536 bytes" in resp.json()["error"]["message"]
    # every route, not only completions
    assert requests.get(url + "/v1/models", data=big, timeout=60).status_code == 413

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(LIMIT // 1024 + 4):
            yield b" " * 1024

    resp = requests.post(url + "/v1/completions", data=chunks(), timeout=60, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text[:300]
    assert _good(url)


def test_a_text_too_long_for_the_context_is_refused_untokenized(app):
    url, _ = app
    # 4,000 words of 2-3 characters each fit under the body limit but not in 2048 tokens... and
    # more characters than the context can hold at the longest token's length are refused before
    # tokenizing
    words = "w5 " * 8000
    resp = requests.post(url + "/v1/completions", json={"prompt": words, "max_tokens": 1}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text[:300]
    assert "characters are more than the context" in resp.json()["error"]["message"]
    tokens = requests.post(url + "/v1/completions", json={"prompt": "w5 " * 3000, "max_tokens": 1}, timeout=60)
    assert tokens.status_code == 400 and tokens.json()["error"]["param"] == "prompt", tokens.text[:300]
    assert "the prompt is" in tokens.json()["error"]["message"]
    # a prompt that alone leaves no room for a token names the prompt, not max_tokens
    for ids in ([5] * 5000, [5] * MAX_LEN):
        resp = requests.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text[:300]
        assert f"the prompt is {len(ids)} tokens" in resp.json()["error"]["message"]
    resp = requests.post(url + "/v1/completions", json={"prompt": [5] * (MAX_LEN - 1), "max_tokens": 2}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text[:300]
    assert "exceeds the context of 2048 tokens" in resp.json()["error"]["message"]


def test_a_body_sent_a_byte_at_a_time_gets_408(app):
    """A chunked body that stalls after its first byte: 408 once the body timeout passes, and the
    replica keeps serving others meanwhile."""
    url, _ = app
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")
        assert _good(url)  # served while the slow body is pending
        t0 = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < 100:
            more = sock.recv(4096)
            if not more:
                break
            reply += more
        waited = time.monotonic() - t0
        reply = reply.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 408"), reply[:200]
    assert "not received within 3 s" in reply
    assert waited < 30  # answered by the body timeout, not the socket's


def _running(url: str) -> int:
    return requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]["running"]


def _steps(url: str) -> int:
    return requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]["tokens"]  # sequence-steps


def test_clients_that_go_away_free_their_sequences(app):
    """A stream read for two tokens and closed, and a non-streaming request whose client closes
    its connection once the sequence runs, both asked for 2,000 tokens: their sequences leave
    the batch long before that (closed while running, so how fast steps go does not matter)."""
    url, _ = app
    start = _steps(url)
    resp = requests.post(url + "/v1/completions", stream=True, timeout=60,
                         json={"prompt": [5, 9], "max_tokens": 2000, "temperature": 0, "stream": True})
    lines = resp.iter_lines()
    assert next(lines).startswith(b"data: ")
    wait_for(lambda: _running(url) == 1, timeout_s=30, what="the stream's sequence to run")
    resp.close()
    wait_for(lambda: _running(url) == 0, timeout_s=30, what="the abandoned stream's sequence to be freed")
    assert _steps(url) - start < 1000  # generating all 2,000 tokens would have taken 2,000 steps
    start = _steps(url)
    body = json.dumps({"prompt": [5, 9], "max_tokens": 2000, "temperature": 0}).encode()
    client = socket.create_connection((urlsplit(url).hostname, urlsplit(url).port), timeout=30)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: _running(url) == 1, timeout_s=30, what="the non-streaming request's sequence to run")
    client.close()
    wait_for(lambda: _running(url) == 0, timeout_s=30, what="the closed request's sequence to be freed")
    assert _steps(url) - start < 1000
    assert _good(url)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
SCHEMA_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                          "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_schema = st.fixed_dictionaries(
    {"type": st.sampled_from(["number", "integer", "string", "array", "object"])},
    optional={k: st.integers(-(2**70), 2**70) | st.sampled_from([-(2**63) - 1, -(2**63), 2**64 - 1, 2**64])
              for k in SCHEMA_NUMBER_KEYWORDS})
_response_format = st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
    {"name": st.just("a"), "schema": _schema | _json})}) | _json
_fields = st.fixed_dictionaries({}, optional={
    "prompt": _json | st.lists(st.integers(-5, 200), max_size=8) | st.text(max_size=30),
    "max_tokens": _json | st.integers(-3, 5), "temperature": _json | st.floats(-1, 3), "top_p": _json | st.floats(-1, 2),
    "seed": _json | st.integers(-(2**65), 2**65), "stream": _json, "n": _json, "model": _json, "user": _json,
    "logprobs": _json, "response_format": _response_format})


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=_fields | _json)
def test_generated_bodies_never_get_a_5xx(app, body):
    url, _ = app
    raw = json.dumps(body).encode()
    resp = _post(url, raw, timeout=60)
    assert resp.status_code < 500, (body, resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert err["message"]
        if resp.status_code == 400 and isinstance(body, dict) and not err["message"].startswith("request body"):
            assert err["param"] in body or err["param"] == "prompt", (body, err)  # the field is named


def test_the_server_is_unchanged_after_the_fuzzing(app):
    """Runs after the generated bodies: a good request gets the reference's tokens, and the
    Ingress' peak memory stays bounded."""
    url, reference = app
    before = requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]["peak_rss_bytes"]
    for raw, _ in BAD:
        _post(url, raw)
    for _ in range(5):
        _post(url, b'{"prompt":"' + b"w5 " * (LIMIT // 3) + b'"}')  # just under / over the limit
    assert _good(url) == reference.generate([[5, 9, 11]], max_tokens=4)[0]
    after = requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]["peak_rss_bytes"]
    assert after - before < 64 * 2**20, (before, after)
