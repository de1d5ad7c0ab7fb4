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
from moe_operator.backends.ray_rest import RayServeError, ReplicaStartFailed, Unschedulable
from moe_operator.backends.serve_backend import AppState, BackendError, ObjectRef, ServeBackend
from moe_operator.backends.serve_status import pinned, unplaceable_pins
from moe_operator.metrics import RAY_APPLY_SECONDS
from moe_operator.names import app_name
from moe_operator.render.serve_app import merge_applications
from moe_workers.rfc3339 import parse_rfc3339

START_RETRY_S = (30, 300)  # a spec whose replicas cannot start: the first retry, the longest wait


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


def apply_application(client: ServeBackend, ours: dict, port: int, wait_s: float, attempts: int = 3,
                      host: str = "127.0.0.1", wait: bool = True) -> dict:
    """Read-merge-write under the client's write lock (one writer at a time per Ray cluster in
    this process: the Serve REST PUT replaces the whole config, so two concurrent read-merge-writes
    would drop each other's application; clients of one cluster share it), then wait outside it;
    if another writer (another process) replaced the config meanwhile and ours is gone, write
    again. When the cluster already runs our config, nothing is written (a steady pass makes no
    PUT)."""
    for _ in range(attempts):
        with client.write_lock:
            current = client.get()
            mine = current.get("applications", {}).get(ours["name"]) or {}
            if same_config(mine.get("deployed_app_config"), ours):
                if mine.get("status") == "RUNNING":
                    return current  # the cluster runs exactly this: nothing to write, nothing to wait for
            else:
                apps = [a["deployed_app_config"] for a in current.get("applications", {}).values()
                        if a.get("deployed_app_config")]
                client.put({"http_options": http_options(port, host), "applications": merge_applications(apps, ours)})
        if wait:
            client.wait_running([ours["name"]], timeout_s=wait_s)
        cluster = client.get()
        if (cluster.get("applications", {}).get(ours["name"]) or {}).get("deployed_app_config") is not None:
            return cluster
    raise RayServeError(f"application {ours['name']} was replaced by another writer {attempts} times in a row")


def remove_application(client: ServeBackend, name: str, port: int, wait_s: float = 120.0,
                       host: str = "127.0.0.1") -> bool:
    """Delete our application, keep everyone else's, and wait until Ray no longer lists it.
    False when it was not there."""
    with client.write_lock:
        apps = client.get().get("applications", {})
        if name not in apps:
            return False
        others = [a["deployed_app_config"] for n, a in apps.items() if n != name and a.get("deployed_app_config")]
        if others:
            client.put({"http_options": http_options(port, host), "applications": others})
        else:
            client.delete_all()
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
    """One pass' view of a Ray cluster through `client`. `wait_s`: how long a written config may
    take to run; `api_key_digests`: the keys in force (rendered into the Ingress)."""

    client: ServeBackend
    http_port: int = 8000
    http_host: str = "127.0.0.1"
    endpoint_host: str = "127.0.0.1"
    wait_s: float = 600.0
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
        pin_problem = pin_check(self.client, app)
        try:
            with RAY_APPLY_SECONDS.time():  # a group no node can take: the others deploy, nobody waits for it
                cluster = apply_application(self.client, app, self.http_port, self.wait_s, host=self.http_host,
                                            wait=pin_problem is None)
        except ValueError as err:  # route prefix clash and the like: the user must change the spec
            raise BackendError(cond.INVALID_SPEC, str(err))
        except Unschedulable as err:  # the cluster may grow (autoscaler) or the spec change: look again soon
            raise BackendError(cond.UNSCHEDULABLE, str(err), 15)
        except ReplicaStartFailed as err:  # the same spec fails the same way: back off (a spec change retries at once)
            delay = start_retry_s(conditions, time.time())
            raise BackendError(cond.REPLICA_START_FAILED, f"{err}; retrying in {delay} s", delay)
        except (RayServeError, OSError) as err:
            raise BackendError(cond.DEPLOY_FAILED, str(err), 30)
        if pin_problem is not None:  # the cluster may gain such a node, or the spec change: look again soon
            raise BackendError(cond.UNSCHEDULABLE, pin_problem, 15)
        return AppState(True, observed=cluster)

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
            return remove_application(self.client, app, self.http_port, host=self.http_host)
        except (RayServeError, OSError) as err:  # keep the finalizer until Ray confirms the app is gone
            raise BackendError(cond.DEPLOY_FAILED, f"removing {app}: {err}", 10)
