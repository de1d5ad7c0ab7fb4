"""The load generator of moectl bench and bench/chaos.py: refused requests apart from failures,
Retry-After honoured unless hammering (against a real HTTP server on loopback)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe_operator.loadgen import CONNECTION_ERROR, LoadGen, Record, retry_after_s, summarize


def test_retry_after_reads_delay_seconds_and_falls_back_on_anything_else():
    assert retry_after_s("2") == 2.0 and retry_after_s("0") == 0.0
    assert retry_after_s(None) == 1.0 and retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 1.0
    assert retry_after_s("-3") == 0.0 and retry_after_s("86400") == 30.0


def test_summary_counts_refused_apart_from_failed_and_goodput_from_answers_only():
    rs = [Record(0.0, 1.0, 200, 4, 0.2, [0.1, 0.1, 0.1]), Record(0.5, 1.5, 200, 4, 0.3, [0.2] * 3),
          Record(1.0, 1.01, 503), Record(1.2, 1.21, 429), Record(1.3, 2.0, 500, error="boom"),
          Record(1.4, 2.5, CONNECTION_ERROR, error="ConnectionError")]
    s = summarize(rs, wall_s=2.0)
    assert (s["requests"], s["ok"], s["refused"], s["failed"]) == (6, 2, 2, 2)
    assert s["goodput_rps"] == 1.0 and s["tokens_per_s"] == 4.0
    assert s["latency_s"]["p50"] == 1.0 and s["ttft_s"]["p99"] == 0.3
    assert s["errors"] == ["ConnectionError", "boom"]
    # a window: only requests that ended inside it
    w = summarize(rs, wall_s=1.0, since=1.4, until=2.1)
    assert (w["requests"], w["ok"], w["failed"]) == (2, 1, 1)


class _Shedding(BaseHTTPRequestHandler):
    """Refuses every completion with 503 + Retry-After: 1; answers /v1/models."""

    hits: list[float] = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = json.dumps({"data": [{"id": "m", "vocab_size": 50, "max_model_len": 64}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        _Shedding.hits.append(time.monotonic())
        body = b"Request dropped due to backpressure"
        self.send_response(503)
        self.send_header("Retry-After", "1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def shedding_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Shedding)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    _Shedding.hits = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_client_waits_for_retry_after_unless_it_hammers(shedding_server):
    polite = LoadGen(shedding_server, concurrency=2, prompt_len=3, max_tokens=2, vocab_hi=50)
    polite.run(1.5)
    # two clients, one request each at 0 s and one more each after the 1 s Retry-After
    assert 2 <= len(polite.records) <= 4 and all(r.refused for r in polite.records)
    s = summarize(polite.records, 1.5)
    assert s["failed"] == 0 and s["ok"] == 0 and s["refused"] == len(polite.records)
    hammer = LoadGen(shedding_server, concurrency=2, prompt_len=3, max_tokens=2, vocab_hi=50, hammer=True)
    hammer.run(1.0)
    assert len(hammer.records) > 20 and all(r.refused for r in hammer.records)


def test_a_closed_port_is_a_failure_not_a_refusal():
    load = LoadGen("http://127.0.0.1:9", concurrency=1, prompt_len=2, max_tokens=1, timeout_s=2)
    load.run(0.3)
    assert load.records and all(r.status == CONNECTION_ERROR and not r.refused for r in load.records)
    assert summarize(load.records, 0.3)["failed"] == len(load.records)
