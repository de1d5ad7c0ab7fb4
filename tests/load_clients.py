"""Clients sending completions until stopped, every outcome counted: the zero-failed-requests
check of tests that change a serving app underneath its traffic."""

from __future__ import annotations

import threading

import requests


class Load:
    """Clients sending completions until stopped; every outcome counted."""

    def __init__(self, url: str, clients: int = 3):
        self.url, self.ok, self.failed, self.errors = url, 0, 0, []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = [(i * 31 + n * 7 + k) % 90 + 3 for k in range(6)]
            try:
                r = requests.post(self.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6}, timeout=60)
                choice = r.json()["choices"][0] if r.status_code == 200 else {}
                if choice.get("finish_reason") in ("length", "stop") and 0 < len(choice["token_ids"]) <= 6:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
            except requests.RequestException as err:
                self.failed += 1
                self.errors.append(repr(err))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
