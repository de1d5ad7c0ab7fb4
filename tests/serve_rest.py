"""Deploy Serve configs through the dashboard REST API, as the operator's Ray backend does."""

from __future__ import annotations

import time

import requests




def deploy(head, apps: list[dict], timeout_s: float = 180.0) -> None:
    config = {"http_options": {"host": "127.0.0.1", "port": head.serve_http_port}, "applications": apps}
    resp = requests.put(head.dashboard_url + "/api/serve/applications/", json=config,
                        headers=head.auth_headers(), timeout=60)
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + timeout_s
    status = {}
    while time.monotonic() < deadline:
        status = requests.get(head.dashboard_url + "/api/serve/applications/", headers=head.auth_headers(),
                              timeout=30).json()
        states = {a["name"]: status.get("applications", {}).get(a["name"], {}).get("status") for a in apps}
        if all(s == "RUNNING" for s in states.values()):
            # a redeploy is RUNNING once every deployment is HEALTHY with the new config
            return
        if any(s == "DEPLOY_FAILED" for s in states.values()):
            raise AssertionError(f"deploy failed: {status}")
        time.sleep(0.5)
    raise AssertionError(f"apps not RUNNING after {timeout_s} s: {status}")


def delete_all(head) -> None:
    requests.delete(head.dashboard_url + "/api/serve/applications/", headers=head.auth_headers(), timeout=60)
