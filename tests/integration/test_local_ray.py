"""The local Ray head used by standalone mode and the tests: loopback, dashboard, token auth."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import psutil
import pytest

from moe_operator.standalone.local_ray import LocalRayHead, live_group_members

pytestmark = pytest.mark.ray


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_dashboard_requires_token(ray_head: LocalRayHead):
    status, _ = _get(ray_head.dashboard_url + "/api/serve/applications/")
    assert status in (401, 403)
    status, body = _get(ray_head.dashboard_url + "/api/serve/applications/", ray_head.auth_headers())
    assert status == 200
    assert "applications" in json.loads(body)


def test_dashboard_listens_on_loopback_only(ray_head: LocalRayHead):
    # The dashboard carries the Serve REST API we deploy through. (Ray 2.60's GCS binds every
    # interface whatever --node-ip-address says; see docs/security.md.)
    ports = {ray_head.dashboard_port}
    listening = [c for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port in ports]
    assert {c.laddr.port for c in listening} == ports
    for conn in listening:
        assert conn.laddr.ip == "127.0.0.1", conn


def test_stop_kills_what_it_started(tmp_path):
    head = LocalRayHead(work_dir=tmp_path, num_cpus=1).start()
    pgid = head.process.pid
    assert live_group_members(pgid), "the head should have processes while running"
    head.stop()
    assert live_group_members(pgid) == []
    status = None
    try:
        status, _ = _get(head.dashboard_url + "/api/version", head.auth_headers())
    except (urllib.error.URLError, OSError):
        pass
    assert status is None
