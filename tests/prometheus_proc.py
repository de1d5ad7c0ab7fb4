"""A real Prometheus server (Debian's package, installed by scripts/testenv) scraping given
targets on loopback, for the autoscaler's PromQL source."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import requests
import yaml

from moe_operator.standalone.local_ray import free_port


class Prometheus:
    def __init__(self, binary: Path, work_dir: Path, metrics_urls: list[str], interval_s: int = 5):
        """Scrapes every `interval_s`, each scrape allowed as long (a test session's Ray exports
        MBs of series by its end: a 1 s scrape timed out on a loaded machine and saw nothing)."""
        self.binary, self.work_dir = binary, work_dir
        self.port = free_port()
        targets = [urlparse(u) for u in metrics_urls]
        config = {"global": {"scrape_interval": f"{interval_s}s", "scrape_timeout": f"{interval_s}s",
                             "evaluation_interval": f"{interval_s}s"},
                  "scrape_configs": [{"job_name": "ray", "metrics_path": targets[0].path or "/metrics",
                                      "static_configs": [{"targets": [t.netloc for t in targets]}]}]}
        work_dir.mkdir(parents=True, exist_ok=True)
        (work_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> "Prometheus":
        log = open(self.work_dir / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [str(self.binary), f"--config.file={self.work_dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.work_dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.work_dir / "prometheus.log").read_text()[-2000:]
            try:
                if requests.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise AssertionError("prometheus did not become ready: " + (self.work_dir / "prometheus.log").read_text()[-2000:])

    def query(self, promql: str) -> list[dict]:
        body = requests.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
