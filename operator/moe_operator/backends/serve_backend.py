"""The interfaces the reconcile pass is written against (`typing.Protocol`s).

`Backend`: where an application is served, as the one pass (`moe_operator.reconcile.run_pass`) sees
it: `observe` what is deployed, `apply` what was rendered and say where it stands (never waiting for it
to run: the pass returns in progress with a short retry, and the next one observes), `groups` as
the backend reports them, `delete` (asked again each pass until the application is gone). Two implement it:
`rest_backend.RestBackend` (ray.mode Existing and standalone: a Ray cluster's Serve REST API, through
a `ServeBackend` client) and `kuberay_backend.KubeRayBackend` (ray.mode KubeRay: a RayService);
`tests/unit/test_backend_conformance.py` runs the same cases against both.

`ServeBackend`: one Ray cluster's Serve config, as the REST backend reads and writes it. Two implement it: `ray_rest.RayServeClient` (Ray's dashboard REST API, the real one) and
`render_only.RenderOnlyClient` (the Serve config kept in a file, for benchmarking the control
plane and for inspecting what would be applied). The pass (`moe_operator.reconcile`), the kopf
handlers and standalone mode take a `ServeBackend`; `tests/unit/test_serve_backend.py` checks
that both implementations have every member with the same parameters.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from moe_workers.serve.config import INGRESS

if TYPE_CHECKING:
    from moe_operator.api.models import MoEDeploymentSpec


@dataclass(frozen=True)
class ObjectRef:
    """The MoEDeployment a pass is for."""

    namespace: str
    name: str
    generation: int = 0
    uid: str = ""  # the RayService's owner reference needs it (ray.mode KubeRay)


class BackendError(Exception):
    """A pass stops here: Ready=False with `reason` and the message, a Warning Event, looked at again
    after `retry_s` (None: not until the spec changes)."""

    def __init__(self, reason: str, message: str, retry_s: float | None = None):
        super().__init__(message)
        self.reason, self.retry_s = reason, retry_s


@dataclass(frozen=True)
class AppState:
    """What a backend says of our application after `apply` (pure data).
    ready: it serves (what was applied, or, with `progress`, the previous version while the new one
    rolls out). Otherwise `reason` / `message` for Ready=False. `progress` (non-empty:
    Progressing=True with `reason` and it), `retry_s` (None: terminal, until the spec changes) and
    whether the Event is a Warning. `degraded`: the deployments reported unhealthy, named."""

    ready: bool
    reason: str = ""
    message: str = ""
    progress: str = ""
    degraded: str = ""
    retry_s: float | None = None
    warning: bool = False
    observed: Any = None  # what the backend read back (Serve's status, the RayService), for `groups`


def ingress_placement(app_config: dict) -> dict[str, list[str]] | None:
    """The placement in one application config's Ingress user_config."""
    for d in app_config.get("deployments") or []:
        if d.get("name") == INGRESS:
            return (d.get("user_config") or {}).get("placement")
    return None


def shard_experts(app_config: dict) -> dict[str, list[str]] | None:
    """What each shard group hosts in one application config (None when it has no shards)."""
    out = {d["name"]: list((d.get("user_config") or {}).get("experts") or [])
           for d in app_config.get("deployments") or [] if d.get("name") != INGRESS}
    return out or None


class Backend(Protocol):
    """Where one MoEDeployment's application runs. Every method may raise `BackendError`."""

    mode: str  # spec.ray.mode it serves: "Existing" (also standalone) or "KubeRay"
    api_key_digests: list[str] | None  # rendered into the app (None: none, or this backend passes none)

    def refusal(self, status: dict, obj: ObjectRef) -> str | None:
        """Why this object must not be deployed here (it serves elsewhere, a name KubeRay cannot
        take): the InvalidSpec message; None when the pass may go on."""
        ...

    def base_url(self, obj: ObjectRef, spec: "MoEDeploymentSpec") -> str:
        """The app's HTTP root as clients reach it (status.endpoint is this + /v1)."""
        ...

    def observe(self, obj: ObjectRef) -> dict | None:
        """Our application's config as deployed (None: nothing deployed)."""
        ...

    def apply(self, obj: ObjectRef, spec: "MoEDeploymentSpec", app: dict, conditions: list[dict]) -> AppState:
        """Write `app` when it differs from what is deployed (a steady pass writes nothing) and say
        where it stands. `conditions`: the object's before the pass (a back-off reads Ready's age)."""
        ...

    def record(self, status: dict, obj: ObjectRef) -> None:
        """The backend's own status fields (rayAddress, rayService, apiKeys, selector), in place."""
        ...

    def groups(self, state: AppState, app: str, shards: dict[str, list[str]], desired: int,
               previous: list[dict] | None) -> list[dict]:
        """status.groups: per shard group its replicas, ready replicas and experts, as reported."""
        ...

    def degraded(self, state: AppState, groups: list[dict]) -> tuple[bool, str, str]:
        """The Degraded condition: (status, reason, message)."""
        ...

    def serving_message(self, endpoint: str, obj: ObjectRef) -> str:
        """Ready's message once the app serves."""
        ...

    def delete(self, obj: ObjectRef) -> bool:
        """Ask for the application's removal (others' stay), without waiting: True once nothing of
        ours is left, False while the removal is under way (the finalizer asks again)."""
        ...


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

    def wait_gone(self, name: str, timeout_s: float = 120.0) -> None:
        """Until `name` is no longer listed."""
        ...

    def nodes(self) -> list[dict] | None:
        """The cluster's Ray nodes (state, labels, resources_total); None: this backend cannot say."""
        ...
