"""ray.mode Existing (and standalone `moectl up`): the application on a Ray cluster whose Serve
config is read and written whole through a `ServeBackend` client (Ray's dashboard REST API, or the
render-only file). A `Backend` (backends/serve_backend.py).

The Serve REST PUT replaces every application of the cluster, so a write is a read-merge-write
under the client's write lock, and made only when the cluster does not already run our config
(a steady pass makes no PUT).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from moe_operator.api import conditions as cond
from moe_operator.api.models import GroupStatus, MoEDeploymentSpec
from moe_operator.api.status import dump
from moe_operator.backends.ray_rest import RayServeError
from moe_operator.backends.serve_backend import AppState, BackendError, ObjectRef, ServeBackend
from moe_operator.backends.serve_status import pinned, start_failure_message, unplaceable_pins, unschedulable_message
from moe_operator.metrics import RAY_APPLY_SECONDS
from moe_operator.names import app_name
from moe_operator.render.serve_app import merge_applications
from moe_workers.rfc3339 import parse_rfc3339

START_RETRY_S = (30, 300)  # a spec whose replicas cannot start: the first retry, the longest wait
DEPLOYING_RETRY_S = 2  # Serve is still deploying what was applied: look again this soon
UNSCHEDULABLE_RETRY_S, FAILED_RETRY_S = 15, 30  # the cluster may grow or the spec change; a deploy failed


def http_options(port: int, host: str = "127.0.0.1") -> dict:
    """Serve's proxy address. Loopback unless the operator is told otherwise (MOE_SERVE_HTTP_HOST):
    a Ray cluster in Pods needs 0.0.0.0 for its Service to reach the proxy. Serve takes it when it
    starts on a cluster and keeps it while it runs."""
    return {"host": host, "port": port}


def same_config(deployed: dict | None, ours: dict) -> bool:
    """Whether the cluster's deployed config of an application is the one we render. Ray reports
    it as it was submitted (only the fields set), so equality is the test; numbers compare by value
    (Ray may turn 1 into 1.0)."""
    return deployed is not None and deployed == ours


def pin_check(client: ServeBackend, ours: dict) -> str | None:
    """What stops a pinned deployment of `ours` from being placed (no live Ray node with its
    labels, or none large enough), or None; asked of Ray only when something is pinned."""
    if not pinned(ours):
        return None
    try:
        nodes = client.nodes()
    except (RayServeError, OSError):
        return None  # Serve's own report (after its slow-start warning) still says so
    return unplaceable_pins(ours, nodes) if nodes else None  # none listed yet: Ray is starting


def apply_application(client: ServeBackend, ours: dict, port: int, attempts: int = 3,
                      host: str = "127.0.0.1") -> dict:
    """Read-merge-write under the client's write lock (one writer at a time per Ray cluster in
    this process: the Serve REST PUT replaces the whole config, so two concurrent read-merge-writes
    would drop each other's application; clients of one cluster share it), then Serve's status,
    read once (nobody waits here for the app to run); if another writer (another process) replaced
    the config meanwhile and ours is gone, write again. When the cluster already has our config,
    nothing is written (a steady pass, and every pass while it deploys, makes no PUT)."""
    for _ in range(attempts):
        with client.write_lock:
            current = client.get()
            mine = current.get("applications", {}).get(ours["name"]) or {}
            if same_config(mine.get("deployed_app_config"), ours):
                return current  # the cluster has exactly this: nothing to write
            apps = [a["deployed_app_config"] for a in current.get("applications", {}).values()
                    if a.get("deployed_app_config")]
            client.put({"http_options": http_options(port, host), "applications": merge_applications(apps, ours)})
        cluster = client.get()
        if (cluster.get("applications", {}).get(ours["name"]) or {}).get("deployed_app_config") is not None:
            return cluster
    raise RayServeError(f"application {ours['name']} was replaced by another writer {attempts} times in a row")


def request_removal(client: ServeBackend, name: str, port: int, host: str = "127.0.0.1") -> bool:
    """Ask Serve to delete our application, keeping everyone else's, without waiting: True once Ray
    no longer lists it (nothing left to do), False while it does (asked now, or being deleted)."""
    with client.write_lock:
        apps = client.get().get("applications", {})
        if name not in apps:
            return True
        if apps[name].get("status") == "DELETING":
            return False  # asked before; Serve is at it
        others = [a["deployed_app_config"] for n, a in apps.items() if n != name and a.get("deployed_app_config")]
        if others:
            client.put({"http_options": http_options(port, host), "applications": others})
        else:
            client.delete_all()
    return False


def remove_application(client: ServeBackend, name: str, port: int, wait_s: float = 120.0,
                       host: str = "127.0.0.1") -> bool:
    """Delete our application, keep everyone else's, and wait until Ray no longer lists it (for
    standalone's teardown and tests; the operator asks once a pass, `request_removal`). False when
    it was not there."""
    if name not in client.get().get("applications", {}):
        return False
    request_removal(client, name, port, host)
    client.wait_gone(name, wait_s)
    return True


def start_retry_s(conditions: list[dict], now: float) -> int:
    """How long to wait before deploying a spec whose replicas failed to start again: 30 s the
    first time, then as long as Ready has been False (so the waits about double), at most 300 s."""
    first, longest = START_RETRY_S
    ready = next((c for c in conditions if c.get("type") == cond.READY), None)
    if not ready or ready.get("reason") != cond.REPLICA_START_FAILED:
        return first
    since = parse_rfc3339(ready.get("lastTransitionTime"))
    return first if since is None else int(min(longest, max(first, now - since)))


def app_state(cluster: dict, name: str, conditions: list[dict], now: float) -> AppState:
    """Where application `name` stands in Serve's status, read once (pure): RUNNING serves; replicas
    that raise in their constructor, a failed deploy, replicas Ray cannot place or an UNHEALTHY app
    are Ready=False with a Warning and a retry; anything else (DEPLOYING, NOT_STARTED) is still
    under way: Progressing, looked at again in DEPLOYING_RETRY_S (Ready stays True when it was: the
    old replicas serve until the new ones do)."""
    app = cluster.get("applications", {}).get(name) or {}
    status = app.get("status") or "NOT_STARTED"
    if status == "RUNNING":
        return AppState(True, observed=cluster)
    if status == "DEPLOY_FAILED":
        start = start_failure_message(name, app)
        if start:  # the same spec fails the same way: back off (a spec change retries at once)
            delay = start_retry_s(conditions, now)
            return AppState(False, cond.REPLICA_START_FAILED, f"{start}; retrying in {delay} s", retry_s=delay,
                            warning=True, observed=cluster)
        return AppState(False, cond.DEPLOY_FAILED, f"deploy failed: { {name: app.get('message', '')} }",
                        retry_s=FAILED_RETRY_S, warning=True, observed=cluster)
    stuck = unschedulable_message(name, app)
    if stuck:  # the cluster may grow (autoscaler) or the spec change: look again soon
        return AppState(False, cond.UNSCHEDULABLE, stuck, retry_s=UNSCHEDULABLE_RETRY_S, warning=True, observed=cluster)
    if status == "UNHEALTHY":
        return AppState(False, cond.UNHEALTHY, f"application {name} is UNHEALTHY: {app.get('message') or 'no message'}",
                        retry_s=FAILED_RETRY_S, warning=True, observed=cluster)
    message = f"application {name} is {status}" + (f": {app['message']}" if app.get("message") else "")
    # an app that served keeps serving while Serve rolls a change out in place: Ready stays, Progressing says so
    serving = cond.is_true(conditions, cond.READY)
    return AppState(serving, cond.DEPLOYING, message, progress=message, retry_s=DEPLOYING_RETRY_S, observed=cluster)


def keys_fingerprint(digests: list[str] | None) -> str | None:
    """A short fingerprint of the API keys in force (of their digests: it reveals no key), so a
    changed Secret is noticed between reconcile passes."""
    if not digests:
        return None
    return hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()[:16]


def moved(status: dict, mode: str, address: str | None = None) -> str | None:
    """Why a pass must not deploy (the message of an InvalidSpec): the application serves on
    another Ray cluster, or the other ray.mode, than the spec now names. Moving a served object is
    not supported: the old application would be left behind. None when the pass may go on.
    `address`: the dashboard the pass would use (ray.mode Existing)."""
    old, rayservice = status.get("rayAddress"), status.get("rayService")
    if mode == "Existing" and rayservice:
        return (f"spec.ray.mode: the application runs in the RayService {rayservice}; changing the mode of a served "
                "object is not supported: set mode KubeRay again, or delete the object (which removes the RayService) "
                "and create it anew")
    if mode == "Existing" and old and address and old.rstrip("/") != address.rstrip("/"):
        return (f"spec.ray.address: the application serves on the Ray cluster {old}; moving it to {address} is not "
                "supported: set the address back (or the operator's MOE_RAY_ADDRESS, when the spec names none), or "
                "delete the object (which removes the application there) and create it anew")
    if mode == "KubeRay" and old:
        return (f"spec.ray.mode: the application serves on the Ray cluster {old}; changing the mode of a served "
                "object is not supported: set mode Existing again, or delete the object (which removes the "
                "application there) and create it anew")
    return None


def observed_groups(cluster: dict, app: str, placement: dict[str, list[str]], desired: int,
                    previous: list[dict] | None = None) -> list[dict]:
    """Per shard group as Ray reports it: target replicas, RUNNING replicas, experts placed.
    (A backend that reports no deployments, like render-only, is taken at its word: desired.)"""
    deployments = (cluster.get("applications", {}).get(app) or {}).get("deployments") or {}
    groups = []
    for g, experts in sorted(placement.items()):
        d = deployments.get(g)
        replicas = d.get("target_num_replicas", desired) if d else desired
        ready = sum(1 for r in d.get("replicas", []) if r.get("state") == "RUNNING") if d else desired
        # the autoscaler's load, kept until it measures again
        load = next((p.get("load") for p in previous or [] if p.get("name") == g), None)
        groups.append(dump(GroupStatus(name=g, replicas=replicas, ready_replicas=ready, experts=len(experts),
                                       load=load)))
    return groups


@dataclass
class RestBackend:
    """One pass' view of a Ray cluster through `client`. `api_key_digests`: the keys in force (rendered into the Ingress)."""

    client: ServeBackend
    http_port: int = 8000
    http_host: str = "127.0.0.1"
    endpoint_host: str = "127.0.0.1"
    api_key_digests: list[str] | None = None
    mode: str = "Existing"

    def refusal(self, status: dict, obj: ObjectRef) -> str | None:
        return moved(status, self.mode, self.client.dashboard_url)

    def base_url(self, obj: ObjectRef, spec: MoEDeploymentSpec) -> str:
        return f"http://{self.endpoint_host}:{self.http_port}{spec.ingress.route_prefix.rstrip('/')}"

    def observe(self, obj: ObjectRef) -> dict | None:
        try:
            cluster = self.client.get()
        except (RayServeError, OSError) as err:
            raise BackendError(cond.RAY_UNREACHABLE, f"Ray dashboard {self.client.dashboard_url}: {err}", 10)
        return (cluster.get("applications", {}).get(app_name(obj.namespace, obj.name)) or {}).get("deployed_app_config")

    def apply(self, obj: ObjectRef, spec: MoEDeploymentSpec, app: dict, conditions: list[dict]) -> AppState:
        """Write the config when the cluster does not run it, then read where it stands; never
        waits for Serve (the next pass, DEPLOYING_RETRY_S later, looks again)."""
        pin_problem = pin_check(self.client, app)
        try:
            with RAY_APPLY_SECONDS.time():
                cluster = apply_application(self.client, app, self.http_port, host=self.http_host)
        except ValueError as err:  # route prefix clash and the like: the user must change the spec
            raise BackendError(cond.INVALID_SPEC, str(err))
        except (RayServeError, OSError) as err:
            raise BackendError(cond.DEPLOY_FAILED, str(err), FAILED_RETRY_S)
        state = app_state(cluster, app["name"], conditions, time.time())
        if pin_problem is not None and (not state.ready or state.progress):  # a group no node can take: the others deploy
            return AppState(False, cond.UNSCHEDULABLE, pin_problem, retry_s=UNSCHEDULABLE_RETRY_S, warning=True,
                            observed=cluster)
        return state

    def record(self, status: dict, obj: ObjectRef) -> None:
        status["rayAddress"] = self.client.dashboard_url
        if self.api_key_digests:
            status["apiKeys"] = {"count": len(self.api_key_digests), "fingerprint": keys_fingerprint(self.api_key_digests)}
        else:
            status.pop("apiKeys", None)
        status.pop("selector", None)  # the replicas are Ray actors in Pods we do not own: no Pod label to select

    def groups(self, state: AppState, app: str, shards: dict[str, list[str]], desired: int,
               previous: list[dict] | None) -> list[dict]:
        return observed_groups(state.observed or {}, app, shards, desired, previous)

    def degraded(self, state: AppState, groups: list[dict]) -> tuple[bool, str, str]:
        short = [g for g in groups if g["readyReplicas"] < g["replicas"]]
        if short:
            return True, cond.REPLICAS_NOT_READY, ", ".join(
                f"{g['name']}: {g['readyReplicas']}/{g['replicas']} ready" for g in short)
        return False, cond.ALL_REPLICAS_READY, f"every replica of {len(groups)} groups is running"

    def serving_message(self, endpoint: str, obj: ObjectRef) -> str:
        return f"serving at {endpoint}"

    def delete(self, obj: ObjectRef) -> bool:
        app = app_name(obj.namespace, obj.name)
        try:
            return request_removal(self.client, app, self.http_port, host=self.http_host)
        except (RayServeError, OSError) as err:  # keep the finalizer until Ray confirms the app is gone
            raise BackendError(cond.DEPLOY_FAILED, f"removing {app}: {err}", 10)
