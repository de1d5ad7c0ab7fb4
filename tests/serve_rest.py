"""Deploy Serve configs on the test Ray head through the operator's REST client."""

from __future__ import annotations

from moe_operator.backends.ray_rest import RayServeClient
from moe_operator.reconcile import http_options


def client(head) -> RayServeClient:
    return RayServeClient(head.dashboard_url, head.token)


def deploy(head, apps: list[dict], timeout_s: float = 180.0) -> None:
    c = client(head)
    c.put({"http_options": http_options(head.serve_http_port), "applications": apps})
    c.wait_running([a["name"] for a in apps], timeout_s)


def delete_all(head) -> None:
    client(head).delete_all()
