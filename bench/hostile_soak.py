"""Memory under a long hostile soak: the quickstart app under `moectl up` (bench/chaos.py's
StandaloneApp) gets --requests hostile and malformed requests from --clients threads, with greedy
requests beside them, and the resident memory of the Ingress replica and of Serve's HTTP proxy is
read every --sample-every requests. Ends with `figure: value` lines.

    python bench/hostile_soak.py                 # 20,000 requests, RSS every 1,000
    python bench/hostile_soak.py --quick         # 3,000, growth over the 1,000 baseline
    python bench/hostile_soak.py --requests 6000 --baseline 2000

The mix (one class per request, drawn at random, each body new): wrong types for every field
(tools, tool_choice, response_format, logit_bias, penalties included); NaN, 1e400 and integers
past 64 bits; JSON schemas with random numeric keywords, in range (each a new grammar to compile,
so the grammar cache turns over) and past 64 bits; forced tool calls cut by max_tokens;
malformed, truncated, deeply nested and non-UTF-8 bodies; bodies over the size limit; gzip
bodies, gzip bombs and broken gzip; wrong content types and encodings; unknown routes, wrong
methods, HEAD; bad message lists; prompts longer than the context; streams dropped after their
first event; random JSON. Beside them one client sends a greedy completion at a time and checks
its tokens never change.

Figures: `hostile-soak-rss-growth` = the Ingress' RSS after --requests / after --baseline (the
issue's target: <= 1.1 at 20k over 2k); the same for the proxy; 5xx answers (must be 0);
refusals not in OpenAI's error shape (must be 0); greedy answers that differed (must be 0).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import threading
import time
from pathlib import Path

from chaos import StandaloneApp  # noqa: E402 - also puts workers/ and operator/ on sys.path
from figures import report, scratch  # noqa: E402

import requests  # noqa: E402

from moe_operator.loadgen import model_info  # noqa: E402
from moe_workers.serve.config import AppArgs  # noqa: E402

GREEDY = {"prompt": [5, 9, 11], "max_tokens": 4, "temperature": 0}
SCHEMA_KEYWORDS = {"number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
                   "string": ("minLength", "maxLength"), "array": ("minItems", "maxItems"),
                   "object": ("minProperties", "maxProperties")}
WRONG = [True, False, None, "5", "", [], {}, [1, "a"], {"a": 1}, -1, 0, 2**31, 1.5, -0.0, "NaN", [[[]]]]
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "n", "stop", "logprobs", "top_k",
          "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop_token_ids",
          "ignore_eos", "min_tokens", "response_format", "stream_options", "model", "user"]
CHAT_FIELDS = ["messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens", "top_logprobs",
               "include_reasoning", "logprobs"]
JSON = {"Content-Type": "application/json"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20_000, help="hostile requests in all")
    p.add_argument("--baseline", type=int, default=2_000, help="the RSS the growth is measured against: after this many")
    p.add_argument("--sample-every", type=int, default=1_000, help="read the RSS every this many requests")
    p.add_argument("--clients", type=int, default=8, help="threads sending hostile requests")
    p.add_argument("--quick", action="store_true", help="3,000 requests, growth over the 1,000 baseline")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "hostile_soak.json"))
    return p.parse_args()


def rss_bytes(pid: int) -> int:
    """Resident memory now (VmRSS), not the peak."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def listener_pid(port: int) -> int | None:
    """The process listening on TCP `port` (Serve's HTTP proxy): its socket's inode in
    /proc/net/tcp, then the process holding it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{f[9]}]")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if any(str(fd.readlink()) in inodes for fd in (d / "fd").iterdir()):
                return int(d.name)
        except OSError:
            continue
    return None


class Mix:
    """Hostile requests, one class drawn per request: (name, method, path, headers, body, stream)."""

    def __init__(self, rng: random.Random, vocab: int, max_len: int, limit: int):
        self.rng, self.vocab, self.max_len, self.limit = rng, vocab, max_len, limit
        self.classes = [(getattr(self, n), w) for n, w in (
            ("wrong_type", 12), ("wrong_chat_type", 8), ("literal", 6), ("schema_wide_int", 8), ("schema_compiled", 8),
            ("forced_tool_cut", 6), ("malformed", 8), ("deep", 3), ("non_utf8", 3), ("over_limit", 1),
            ("gzip", 4), ("media", 5), ("route", 6), ("messages", 5), ("too_long", 3), ("dropped_stream", 3),
            ("random_json", 8), ("logit_bias", 3))]
        self.weights = [w for _, w in self.classes]

    def next(self):
        make = self.rng.choices([c for c, _ in self.classes], self.weights)[0]
        return (make.__name__, *make())

    def _prompt(self) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(1, 8))]

    def _post(self, body, path="/v1/completions", headers=JSON):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return "POST", path, headers, raw, False

    def wrong_type(self):
        return self._post({"prompt": self._prompt(), "max_tokens": 2, self.rng.choice(FIELDS): self.rng.choice(WRONG)})

    def wrong_chat_type(self):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                self.rng.choice(CHAT_FIELDS): self.rng.choice(WRONG)}
        return self._post(body, "/v1/chat/completions")

    def literal(self):
        value = self.rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400",
                                 str(self.rng.choice([-1, 1]) * self.rng.randrange(2**63, 10**25)).encode()])
        field = self.rng.choice(["max_tokens", "temperature", "top_p", "seed", "n", "top_k", "min_p"]).encode()
        return self._post(b'{"prompt":[5,9],"max_tokens":2,"%s":%s}' % (field, value))

    def _schema(self, wide: bool) -> dict:
        kind = self.rng.choice(sorted(SCHEMA_KEYWORDS))
        keyword = self.rng.choice(SCHEMA_KEYWORDS[kind])
        value = (self.rng.choice([-1, 1]) * self.rng.randrange(2**63 + 1, 2**66) if wide
                 else self.rng.randrange(1, self.rng.choice([10_001, 2**20])))  # multipleOf past 10,000: refused
        return {"type": kind, keyword: value}

    def schema_wide_int(self):
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": self._schema(True)}}
        return self._post({"prompt": self._prompt(), "max_tokens": 3, "response_format": fmt})

    def schema_compiled(self):  # in range, each new: a grammar compiled, the cache turning over
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": self._schema(False)}}
        return self._post({"prompt": self._prompt(), "max_tokens": 3, "response_format": fmt})

    def forced_tool_cut(self):
        params = {"type": "object", "properties": {"x": self._schema(False)}, "required": ["x"]}
        tool = {"type": "function", "function": {"name": f"f{self.rng.randrange(10**6)}", "parameters": params}}
        return self._post({"messages": [{"role": "user", "content": "call"}], "tools": [tool], "max_tokens": 4,
                           "tool_choice": {"type": "function", "function": {"name": tool["function"]["name"]}}},
                          "/v1/chat/completions")

    def malformed(self):
        good = json.dumps({"prompt": "hi", "max_tokens": 2, "stop": ["a"]}).encode()
        return self._post(self.rng.choice([good[:self.rng.randrange(len(good))], b"{", b"}", b"", b"[]", b"null",
                                           b'{"prompt":"hi",}', b"{'prompt': 'hi'}", good + b"garbage"]))

    def deep(self):
        depth = self.rng.choice([33, 100, 5000])
        return self._post(b'{"prompt":"hi","user":' + b"[" * depth + b"]" * depth + b"}")

    def non_utf8(self):
        return self._post(self.rng.choice([b'{"prompt":"\xff\xfe"}', b'{"prompt":"\\ud800"}', b"\xc3\x28",
                                           b'{"\\udc00":1,"prompt":"x"}']))

    def over_limit(self):
        return self._post(b'{"prompt":"' + b"a" * (self.limit + 10) + b'"}')

    def gzip(self):
        body = json.dumps({"prompt": self._prompt(), "max_tokens": 2}).encode()
        raw = self.rng.choice([gzip.compress(body), gzip.compress(b" " * (self.limit + 1)), gzip.compress(body)[:-5],
                               b"\x1f\x8b not gzip"])
        return self._post(raw, headers={**JSON, "Content-Encoding": self.rng.choice(["gzip", "gzip", "br", "deflate"])})

    def media(self):
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        media = self.rng.choice([None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                 "application/jsonx"])
        return self._post(body, headers={} if media is None else {"Content-Type": media})

    def route(self):
        return self.rng.choice([("POST", f"/v1/x{self.rng.randrange(10**6)}", JSON, b"{}", False),
                                ("GET", "/v1/completions", {}, b"", False),
                                ("PUT", "/v1/chat/completions", JSON, b"{}", False),
                                ("DELETE", "/v1/models", {}, b"", False),
                                ("HEAD", "/v1/completions", {}, b"", False),
                                ("HEAD", "/v1/models", {}, b"", False)])

    def messages(self):
        msgs = self.rng.choice([[], "hi", [{"role": "bot", "content": "x"}], [{"content": "x"}],
                                [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image"}]}],
                                [{"role": "tool", "content": "x", "tool_call_id": 5}], [None]])
        return self._post({"messages": msgs, "max_tokens": 2}, "/v1/chat/completions")

    def too_long(self):
        return self._post({"prompt": [5] * (self.max_len + self.rng.randrange(0, 100)), "max_tokens": 1})

    def dropped_stream(self):
        return "POST", "/v1/completions", JSON, json.dumps(
            {"prompt": self._prompt(), "max_tokens": 64, "stream": True, "temperature": 1.0}).encode(), True

    def random_json(self):
        def value(depth=0):
            kind = self.rng.randrange(7 if depth < 3 else 4)
            if kind == 0:
                return self.rng.choice([None, self.rng.random() < 0.5])
            if kind == 1:
                return self.rng.random() * 10**self.rng.randrange(-5, 30)
            if kind == 2:
                return self.rng.randrange(-2**70, 2**70)
            if kind == 3:
                return "".join(chr(self.rng.randrange(32, 0x2FFF)) for _ in range(self.rng.randrange(8)))
            if kind in (4, 5):
                return [value(depth + 1) for _ in range(self.rng.randrange(4))]
            return {self.rng.choice(FIELDS + CHAT_FIELDS): value(depth + 1) for _ in range(self.rng.randrange(4))}
        body = {self.rng.choice(FIELDS + CHAT_FIELDS): value() for _ in range(self.rng.randrange(1, 6))}
        return self._post(body, self.rng.choice(["/v1/completions", "/v1/chat/completions"]))

    def logit_bias(self):
        bias = self.rng.choice([{str(i): 1 for i in range(1025)}, {"abc": 1}, {"5": 1000}, {str(10**19): 1},
                                {str(self.rng.randrange(self.vocab)): self.rng.uniform(-100, 100)}])
        return self._post({"prompt": self._prompt(), "max_tokens": 2, "logit_bias": bias})


class Soak:
    """The clients, the counts and the samples."""

    def __init__(self, url: str, mix: Mix, total: int, sample_every: int, pids: dict[str, int]):
        self.url, self.mix, self.total, self.sample_every, self.pids = url, mix, total, sample_every, pids
        self.lock = threading.Lock()
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.server_errors: list[dict] = []
        self.unshaped: list[dict] = []
        self.samples: list[dict] = []
        self.done = threading.Event()

    def _take(self) -> bool:
        with self.lock:
            if self.sent >= self.total:
                return False
            self.sent += 1
            if self.sent % self.sample_every == 0:
                self.samples.append({"requests": self.sent, "t": time.monotonic(),
                                     **{name: rss_bytes(pid) for name, pid in self.pids.items()}})
                s = self.samples[-1]
                print(f"  {s['requests']:6d} requests: " + ", ".join(f"{n} {s[n] / 2**20:.0f} MiB" for n in self.pids),
                      flush=True)
            return True

    def client(self) -> None:
        session = requests.Session()
        while self._take():
            with self.lock:
                name, method, path, headers, body, drop = self.mix.next()
            try:
                resp = session.request(method, self.url + path, data=body, headers=headers, timeout=120, stream=drop)
                if drop and resp.status_code == 200:
                    next(resp.iter_lines(), None)
                    resp.close()
                    status, text = 200, ""
                else:
                    status, text = resp.status_code, resp.text
            except requests.RequestException as err:
                status, text = -1, str(err)
                session = requests.Session()
            with self.lock:
                self.statuses[status] = self.statuses.get(status, 0) + 1
                if status >= 500 or status < 0:
                    self.server_errors.append({"class": name, "status": status, "body": body[:300].decode(errors="replace"),
                                               "answer": text[:300]})
                elif status >= 400 and method != "HEAD" and not _openai_shaped(text):
                    self.unshaped.append({"class": name, "status": status, "answer": text[:300]})

    def greedy(self, want: list[int], counts: dict) -> None:
        while not self.done.is_set():
            try:
                got = requests.post(self.url + "/v1/completions", json=GREEDY, timeout=120).json()["choices"][0]["token_ids"]
                counts["same" if got == want else "differed"] += 1
            except (requests.RequestException, ValueError, KeyError):
                counts["failed"] += 1
            time.sleep(0.2)


def _openai_shaped(text: str) -> bool:
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and bool(err["message"])


def main() -> int:
    a = parse_args()
    if a.quick:
        a.requests, a.baseline = 3_000, 1_000
    work = scratch("moe-bench-hostile-soak-")
    app = StandaloneApp(work, a.num_cpus)
    try:
        app.wait_serving()
        info = model_info(app.url)
        status = app.status()
        pids = {"ingress": int(status["ingress"]["pid"])}
        proxy = listener_pid(app.port)
        if proxy is not None:
            pids["proxy"] = proxy
        want = requests.post(app.url + "/v1/completions", json=GREEDY, timeout=120).json()["choices"][0]["token_ids"]
        print(f"quickstart app serving at {app.url}; Ingress pid {pids['ingress']}, proxy pid {proxy}; "
              f"{a.requests} hostile requests from {a.clients} clients", flush=True)
        mix = Mix(random.Random(a.seed), int(info.get("vocab_size", 256)), int(info["max_model_len"]),
                  int(AppArgs.model_fields["max_request_bytes"].default))
        soak = Soak(app.url, mix, a.requests, a.sample_every, pids)
        soak.samples.append({"requests": 0, "t": time.monotonic(), **{n: rss_bytes(p) for n, p in pids.items()}})
        counts = {"same": 0, "differed": 0, "failed": 0}
        greedy = threading.Thread(target=soak.greedy, args=(want, counts), daemon=True)
        greedy.start()
        t0 = time.monotonic()
        clients = [threading.Thread(target=soak.client) for _ in range(a.clients)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        wall = time.monotonic() - t0
        soak.done.set()
        greedy.join(timeout=130)
        compiled = app.status()["ingress"].get("grammars")
    finally:
        app.stop()
    by_n = {s["requests"]: s for s in soak.samples}
    base, last = by_n[a.baseline], by_n[max(by_n)]
    figures = {f"hostile-soak-{name}-rss-growth" if name != "ingress" else "hostile-soak-rss-growth":
               round(last[name] / base[name], 3) for name in pids}
    figures.update({"hostile-soak-5xx": len(soak.server_errors), "hostile-soak-unshaped-refusals": len(soak.unshaped),
                    "hostile-soak-greedy-differed": counts["differed"], "hostile-soak-greedy-same": counts["same"],
                    "hostile-soak-requests-per-s": round(a.requests / wall, 1)})
    for name in pids:
        print(f"{name} RSS: {base[name] / 2**20:.0f} MiB after {a.baseline}, {last[name] / 2**20:.0f} MiB after "
              f"{last['requests']} (start {by_n[0][name] / 2**20:.0f})")
    print(f"answers by status: {dict(sorted(soak.statuses.items()))}; greedy {counts}")
    for e in soak.server_errors[:5] + soak.unshaped[:5]:
        print("  ", e)
    return report(a.out, {"requests": a.requests, "baseline": a.baseline, "clients": a.clients, "wall_s": round(wall, 1),
                          "statuses": soak.statuses, "samples": soak.samples, "server_errors": soak.server_errors[:50],
                          "unshaped": soak.unshaped[:50], "greedy": counts, "grammars": compiled}, figures)


if __name__ == "__main__":
    sys.exit(main())
