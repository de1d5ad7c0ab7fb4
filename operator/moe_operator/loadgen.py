"""Closed-loop load for `moectl bench` and `bench/chaos.py`: concurrent streaming clients, each
sending its next completion as soon as the last one ends, every outcome recorded with its times.

A refused request (503 or 429) is counted apart from a failure. By default a client honours the
`Retry-After` the server sends (it waits that long before its next request, as the openai client
and most HTTP clients do); `hammer=True` resends at once, the worst case for a server shedding load.
`summarize` (pure) turns records into the figures both tools print.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import requests

REFUSED = (429, 503)
CONNECTION_ERROR = -1  # the status recorded when no HTTP answer came back
MID_STREAM_ERROR = 500  # a stream that ended with an error finish_reason


@dataclass
class Record:
    """One request: monotonic start and end, HTTP status (or CONNECTION_ERROR), tokens received."""

    start: float
    end: float
    status: int
    tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str = ""
    structured: bool | None = None  # with a schema or tools: whether the answer parsed / called a tool

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def refused(self) -> bool:
        return self.status in REFUSED


def retry_after_s(value: str | None, default: float = 1.0, cap: float = 30.0) -> float:
    """Seconds to wait from a Retry-After header (delay-seconds form; an HTTP date or garbage
    reads as `default`), never more than `cap`."""
    try:
        return min(cap, max(0.0, float(value))) if value is not None else default
    except ValueError:
        return default


def model_info(base: str, headers: dict | None = None, timeout_s: float = 10.0) -> dict:
    """The app's first /v1/models entry (vocab_size, max_model_len)."""
    return requests.get(base + "/v1/models", timeout=timeout_s, headers=headers or {}).json()["data"][0]


class LoadGen:
    """`concurrency` clients sending streaming completions of random prompts to `base` until
    `stop()` (or for `run(duration)`)."""

    def __init__(self, base: str, concurrency: int, prompt_len: int = 32, max_tokens: int = 32,
                 vocab_hi: int = 256, seed: int = 0, headers: dict | None = None, hammer: bool = False,
                 timeout_s: float = 600.0, json_schema: dict | None = None, tools: list[dict] | None = None):
        """`json_schema`: every completion asks for JSON that fits it (response_format), sampled
        at temperature 1; `tools`: chat completions with these tools and tool_choice "required"
        (prompts of random words; needs the checkpoint's tokenizer and chat template)."""
        self.base, self.prompt_len, self.max_tokens, self.vocab_hi = base, prompt_len, max_tokens, vocab_hi
        self.json_schema, self.tools = json_schema, tools
        self.headers, self.hammer, self.timeout_s = dict(headers or {}), hammer, timeout_s
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._rng = random.Random(seed)
        self._threads = [threading.Thread(target=self._client, daemon=True, name=f"load-{i}")
                         for i in range(concurrency)]

    def _prompt(self) -> list[int]:
        with self._lock:
            return [self._rng.randrange(3, self.vocab_hi) for _ in range(self.prompt_len)]

    def _one(self, s: requests.Session) -> tuple[Record, float]:
        """One request; returns its record and how long to wait before the next one."""
        t0 = time.monotonic()
        times: list[float] = []
        wait, error = 0.0, ""
        text, calls = [], 0
        path, body = self._request()
        try:
            with s.post(self.base + path, json=body, timeout=self.timeout_s, stream=True) as r:
                status = r.status_code
                if status == 200:
                    for line in r.iter_lines(chunk_size=None):  # as it arrives: 512-byte reads joined events
                        if line.startswith(b"data: {"):
                            chunks = json.loads(line[6:])["choices"]
                            if not chunks:  # the usage chunk
                                continue
                            choice = chunks[0]
                            times += [time.monotonic()] * len(choice.get("token_ids", []))
                            delta = choice.get("delta", {})
                            text.append(choice.get("text") or delta.get("content") or "")
                            calls += len(delta.get("tool_calls") or [])
                            if choice["finish_reason"] and choice["finish_reason"] not in ("length", "stop",
                                                                                           "tool_calls"):
                                status, error = MID_STREAM_ERROR, f"finish_reason {choice['finish_reason']}"
                else:
                    error = r.text[:200]
                    if status in REFUSED and not self.hammer:
                        wait = retry_after_s(r.headers.get("Retry-After"))
        except (requests.RequestException, ValueError, KeyError) as e:
            status, error = CONNECTION_ERROR, e.__class__.__name__
        ok = status == 200
        rec = Record(t0, time.monotonic(), status, len(times) if ok else 0,
                     times[0] - t0 if ok and times else None,
                     [b - a for a, b in zip(times, times[1:])] if ok else [], error)
        if ok and self.tools:
            rec.structured = calls > 0
        elif ok and self.json_schema is not None:
            rec.structured = _parses("".join(text))
        return rec, wait

    def _request(self) -> tuple[str, dict]:
        """The route and body of the next request."""
        if self.tools:
            with self._lock:
                words = " ".join(self._rng.choice(WORDS) for _ in range(max(1, self.prompt_len // 2)))
            return "/v1/chat/completions", {
                "messages": [{"role": "user", "content": words}], "max_tokens": self.max_tokens, "temperature": 1.0,
                "stream": True, "tools": self.tools, "tool_choice": "required", "parallel_tool_calls": False}
        body = {"prompt": self._prompt(), "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        if self.json_schema is not None:
            body.update(temperature=1.0, response_format={"type": "json_schema", "json_schema": {
                "name": "bench", "schema": self.json_schema}})
        return "/v1/completions", body

    def _client(self) -> None:
        s = requests.Session()
        s.headers.update(self.headers)
        while not self._stop.is_set():
            rec, wait = self._one(s)
            with self._lock:
                self.records.append(rec)
            if wait:
                self._stop.wait(wait)

    def start(self) -> "LoadGen":
        for t in self._threads:
            t.start()
        return self

    def stop(self, join_timeout_s: float | None = None) -> None:
        """Stop sending; waits for requests in flight (at most `join_timeout_s` each)."""
        self._stop.set()
        for t in self._threads:
            t.join(join_timeout_s if join_timeout_s is not None else self.timeout_s)

    def run(self, duration_s: float, tick=None) -> float:
        """Send for `duration_s`, then wait for what is in flight; `tick(elapsed, done)` every 0.2 s.
        Returns the wall time."""
        started = time.monotonic()
        self.start()
        while time.monotonic() - started < duration_s:
            time.sleep(0.2)
            if tick:
                tick(time.monotonic() - started, len(self.records))
        self._stop.set()
        while any(t.is_alive() for t in self._threads):
            time.sleep(0.2)
            if tick:
                tick(time.monotonic() - started, len(self.records))
        return time.monotonic() - started

    def __enter__(self) -> "LoadGen":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


WORDS = ("weather", "city", "add", "numbers", "please", "what", "is", "the", "in", "Paris", "two", "and")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def percentiles(values: list[float]) -> dict:
    """p50 / p90 / p99 (nearest rank; NaN when empty)."""
    v = sorted(values)
    return {q: round(v[min(len(v) - 1, int(round(p * (len(v) - 1))))], 4) if v else float("nan")
            for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def summarize(records: list[Record], wall_s: float, since: float | None = None, until: float | None = None) -> dict:
    """Figures over the requests that ended in [since, until) (all by default): `goodput_rps` is
    answered requests per second of `wall_s`; refused (503/429) and failed are apart."""
    rs = [r for r in records if (since is None or r.end >= since) and (until is None or r.end < until)]
    ok = [r for r in rs if r.ok]
    refused = [r for r in rs if r.refused]
    failed = [r for r in rs if not r.ok and not r.refused]
    wall = max(wall_s, 1e-9)
    return {"requests": len(rs), "ok": len(ok), "refused": len(refused), "failed": len(failed),
            "wall_s": round(wall_s, 3), "goodput_rps": round(len(ok) / wall, 3),
            "tokens_per_s": round(sum(r.tokens for r in ok) / wall, 2),
            "latency_s": percentiles([r.end - r.start for r in ok]),
            "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
            "itl_s": percentiles([x for r in ok for x in r.itl]),
            **({"structured_ok": sum(bool(r.structured) for r in ok if r.structured is not None)}
               if any(r.structured is not None for r in ok) else {}),
            "errors": sorted({r.error for r in failed if r.error})[:5]}
