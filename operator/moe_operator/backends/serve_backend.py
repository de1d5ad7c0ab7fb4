"""What the reconcile pass needs of a Ray Serve backend (a `typing.Protocol`).

Two implement it: `ray_rest.RayServeClient` (Ray's dashboard REST API, the real one) and
`render_only.RenderOnlyClient` (the Serve config kept in a file, for benchmarking the control
plane and for inspecting what would be applied). The pass (`moe_operator.reconcile`), the kopf
handlers and standalone mode take a `ServeBackend`; `tests/unit/test_serve_backend.py` checks
that both implementations have every member with the same parameters.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable


@runtime_checkable
class ServeBackend(Protocol):
    """One Ray cluster's Serve applications, as the dashboard's `/api/serve/applications/` has them."""

    # held across a read-merge-write of the cluster's whole Serve config; every client of one
    # cluster shares it (ray_rest.RayClients)
    write_lock: threading.Lock

    @property
    def dashboard_url(self) -> str:
        """Where the cluster is (status.rayAddress records it)."""
        ...

    def get(self) -> dict:
        """Serve's status: {"applications": {name: {"status", "message", "deployed_app_config",
        "deployments", ...}}}."""
        ...

    def put(self, config: dict) -> None:
        """Replace the cluster's whole Serve config (every application)."""
        ...

    def delete_all(self) -> None:
        """Remove every application (the last one's removal: Serve takes no empty config)."""
        ...

    def wait_running(self, names: list[str], timeout_s: float = 300.0) -> dict:
        """Serve's status once every named application is RUNNING; raises when one failed to
        deploy, cannot be scheduled, or the time is up."""
        ...

    def wait_gone(self, name: str, timeout_s: float = 120.0) -> None:
        """Until `name` is no longer listed."""
        ...

    def nodes(self) -> list[dict] | None:
        """The cluster's Ray nodes (state, labels, resources_total); None: this backend cannot say."""
        ...
