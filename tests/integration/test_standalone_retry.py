"""The standalone runner (`moectl up`) retries a pass that failed for a passing reason without
waiting for the manifest to change: here the Ray dashboard is really unreachable at first (its
address is a loopback port with nothing behind it), then becomes reachable (a TCP relay to the
session's real Ray head opens on that port)."""

from __future__ import annotations

import socket
import threading

import pytest
import requests
import yaml

from checkpoints import make_mixtral
from moe_operator.backends.ray_rest import RayServeClient
from moe_operator.standalone.local_ray import free_port
from moe_operator.standalone.runner import StandaloneRunner
from waiting import wait_for

pytestmark = pytest.mark.ray


class TcpRelay:
    """Forwards every connection to 127.0.0.1:`listen_port` to `target` (a real server)."""

    def __init__(self, listen_port: int, target: tuple[str, int]):
        self.target = target
        self.server = socket.create_server(("127.0.0.1", listen_port))
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.server.close()


def test_a_pass_that_failed_on_an_unreachable_dashboard_is_retried_without_a_file_change(ray_head, tmp_path):
    make_mixtral(tmp_path / "models" / "tiny")
    manifest = {
        "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "retry"},
        "spec": {"model": {"path": "models/tiny"},
                 "ingress": {"numCpus": 0.1, "kvCacheBudget": "16Mi", "routePrefix": "/retry"},
                 "experts": {"groups": 2, "numCpus": 0.1,
                             "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}},
    }
    f = tmp_path / "retry.yaml"
    f.write_text(yaml.safe_dump(manifest))
    port = free_port()  # nothing listens here yet: connection refused
    logs: list[str] = []
    runner = StandaloneRunner(f, RayServeClient(f"http://127.0.0.1:{port}", ray_head.token),
                              ray_head.serve_http_port, [str(tmp_path)], state_dir=tmp_path / "state",
                              log=logs.append)
    stop = threading.Event()
    watcher = threading.Thread(target=runner.watch, args=(stop.is_set,), kwargs={"poll_s": 0.2}, daemon=True)
    watcher.start()
    relay = None
    try:
        wait_for(lambda: any(line.startswith("retrying in") for line in logs), 60, "the first pass to fail")
        ready = next(c for c in runner.status["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "RayUnreachable"), ready
        assert f"127.0.0.1:{port}" in ready["message"]
        passes_before = runner.generation

        relay = TcpRelay(port, ("127.0.0.1", ray_head.dashboard_port))
        wait_for(lambda: any("is serving at" in line for line in logs), 240, "the retried pass to deploy")
        assert runner.generation == passes_before  # a retry, not a new generation: the file never changed
        endpoint = runner.status["endpoint"]
        assert endpoint == f"http://127.0.0.1:{ray_head.serve_http_port}/retry/v1"
        out = requests.post(endpoint + "/completions", json={"prompt": [1, 2, 3], "max_tokens": 3,
                                                               "temperature": 0}, timeout=120)
        assert out.status_code == 200, out.text
        assert len(out.json()["choices"][0]["token_ids"]) == 3
    finally:
        stop.set()
        watcher.join(timeout=30)
        if relay is not None:
            runner.teardown()
            relay.close()
