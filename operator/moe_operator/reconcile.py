"""One reconcile pass, shared by the kopf operator and standalone mode.

Everything is computed from observed state: the spec as it is now and the application as the Ray
cluster reports it (its placement is read back from the deployed Ingress user_config), so a
restarted operator converges to the same result and never deploys twice.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import yaml

from moe_operator.api import conditions as cond
from moe_operator.api.models import GroupStatus, MoEDeploymentSpec
from moe_operator.api.semantics import validate_semantics
from moe_operator.api.status import FIELDS as STATUS_FIELDS, checked, dump
from moe_operator.api.validation import SpecError, parse_spec
from moe_operator.backends.ray_rest import RayServeError, ReplicaStartFailed, Unschedulable
from moe_operator.backends.serve_backend import ServeBackend
from moe_operator.backends.serve_status import pinned, unplaceable_pins
from moe_operator.metrics import RAY_APPLY_SECONDS
from moe_operator.observe import fetch_app_status, summarise, swap_transitions
from moe_operator.autoscaling import transition
from moe_operator.planner.initial import current_placement, placement_problem
from moe_operator.names import app_name, serve_service, worker_selector
from moe_operator.render.serve_app import merge_applications, render_application
from moe_operator.settings import Settings
from moe_workers.serve.config import INGRESS
from moe_workers.rfc3339 import parse_rfc3339

if TYPE_CHECKING:
    from moe_operator.backends.kuberay import KubeRayClient


@dataclass
class Result:
    """What a pass observed and did: the status to write, an event to post, when to look again."""

    status: dict
    event: tuple[str, str, str] | None = None  # (type, reason, message)
    retry_after_s: float | None = None
    ready: bool = False
    placement: dict[str, list[str]] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # hot-swaps and rebalances that reached an outcome


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


def deployed_placement(cluster: dict, name: str) -> dict[str, list[str]] | None:
    """The placement the cluster is serving for application `name`, from its deployed config."""
    app = cluster.get("applications", {}).get(name) or {}
    return ingress_placement(app.get("deployed_app_config") or {})


def deployed_shards(cluster: dict, name: str) -> dict[str, list[str]] | None:
    app = cluster.get("applications", {}).get(name) or {}
    return shard_experts(app.get("deployed_app_config") or {})


def placement_step(facts, spec: MoEDeploymentSpec, status: dict, ingress_now: dict | None, shards_now: dict | None,
                   reports, now: float) -> transition.Step:
    """Where routing and hosting go this pass: the deployed placement kept (or re-planned when the
    model or the group count changed), and a target in status.autoscaling applied make-before-break.
    `reports()` gives the replicas' own reports, read only while a target waits to be switched to."""
    base = current_placement(facts.layers, facts.num_experts, spec.experts.groups, ingress_now)
    kept = ingress_now is not None and base == ingress_now
    auto = status.get("autoscaling") or {}
    target = auto.get("target")
    if target is not None and placement_problem(target, facts.layers, facts.num_experts, spec.experts.groups):
        target = None  # the spec changed under it (groups, model): the next decision plans afresh
    shards = shards_now if kept else None
    waiting = target is not None and not transition.same_placement(target, base)
    return transition.next_step(base, shards, target, reports() if waiting else None,
                                spec.experts.replicas_per_group, parse_rfc3339(auto.get("switchedAt")), now)


def record_step(status: dict, step: transition.Step, ingress_before: dict | None) -> list[tuple[str, str, str]]:
    """status.autoscaling after a step was applied; the event when a rebalance completes."""
    auto = dict(status.get("autoscaling") or {})
    if not auto and step.phase == transition.STEADY:
        return []
    events = []
    if step.phase == transition.SWITCHING and ingress_before is not None and not transition.same_placement(step.ingress, ingress_before):
        auto["switchedAt"] = cond.now_rfc3339()
    if step.done:
        if auto.get("target") is not None:
            events.append(("Normal", "Rebalanced", f"new placement serving; {step.message}; imbalance before "
                           f"{auto.get('imbalanceBefore') or 0:.2f}, expected after {auto.get('imbalanceAfter') or 0:.2f}"))
        auto.pop("target", None)
        auto.pop("switchedAt", None)
        auto["phase"] = transition.STEADY
    else:
        auto["phase"] = step.phase
    status["autoscaling"] = auto
    return events


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


# what planning and rendering raise on a spec the parser let through: the user's to fix, so
# InvalidSpec with the message, never a crashed reconcile (pydantic's errors are ValueErrors)
UNRENDERABLE = (ValueError, TypeError, ArithmeticError)


START_RETRY_S = (30, 300)  # a spec whose replicas cannot start: the first retry, the longest wait


def start_retry_s(conditions: list[dict], now: float) -> int:
    """How long to wait before deploying a spec whose replicas failed to start again: 30 s the
    first time, then as long as Ready has been False (so the waits about double), at most 300 s."""
    first, longest = START_RETRY_S
    ready = next((c for c in conditions if c.get("type") == cond.READY), None)
    if not ready or ready.get("reason") != cond.REPLICA_START_FAILED:
        return first
    since = parse_rfc3339(ready.get("lastTransitionTime"))
    return first if since is None else int(min(longest, max(first, now - since)))


class _Outcome:
    """Builds a pass's Result: Ready/Progressing written through the pure condition helper."""

    def __init__(self, status: dict, generation: int):
        # what the CRD keeps, as the apiserver would prune it (a status file an older version wrote
        # may hold a field since removed); what the pass adds is checked when it returns
        self.status = {k: v for k, v in (status or {}).items() if k in STATUS_FIELDS}
        self.generation = generation

    @property
    def conditions(self) -> list[dict]:
        return self.status.get("conditions", [])

    def set(self, type_: str, ok: bool, reason: str, message: str) -> None:
        self.status["conditions"] = cond.set_condition(self.conditions, type_, ok, reason, message, self.generation)

    def __call__(self, ok: bool, reason: str, message: str, event_type: str = "Normal", retry: float | None = None,
                 placement=None) -> Result:
        g = self.generation
        self.set(cond.READY, ok, reason, message)
        self.set(cond.PROGRESSING, False, reason if not ok else cond.RECONCILED,
                 message if not ok else f"generation {g} applied")
        self.status["observedGeneration"] = g
        return Result(checked(self.status), (event_type, reason, message), retry, ok, placement or {})

    def serving(self, message: str, step: transition.Step, events: list[tuple[str, str, str]]) -> Result:
        """Ready (Serving), and Progressing (Rebalancing) while the placement step is not done,
        retried when the step says."""
        res = self(True, cond.SERVING, message, placement=step.ingress)
        if not step.done:
            self.set(cond.PROGRESSING, True, cond.REBALANCING, f"{step.phase}: {step.message}")
            res.retry_after_s = step.retry_after_s
        res.events = events
        return res


def _validated(raw_spec, spec, allowed_roots, result: _Outcome):
    """(spec, facts, None) or (None, None, a failed Result)."""
    if spec is None:
        try:
            spec = parse_spec(raw_spec)
        except SpecError as err:
            return None, None, result(False, cond.INVALID_SPEC, str(err), "Warning")
    facts, problems, reason = validate_semantics(spec, allowed_roots)
    if problems:
        return None, None, result(False, reason or cond.INVALID_SPEC, "; ".join(problems), "Warning")
    return spec, facts, None


def unconfigured(status: dict, generation: int, reason: str, message: str, retry: float | None) -> Result:
    """The pass could not start: something it needs from outside the spec (a Secret, the Ray
    address) is missing or unreadable. Ready=False with the reason, a Warning Event."""
    return _Outcome(status, generation)(False, reason, message, "Warning", retry=retry)


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


def never_deployed(status: dict | None) -> bool:
    """True when this object never had a Serve application: it was never served (no endpoint)
    and it stopped before any Serve config was written (an invalid spec, or a Ray dashboard that
    never answered). Deleting such an object needs nothing from Ray, which may never answer."""
    status = status or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == cond.READY), {})
    return not status.get("endpoint") and ready.get("reason") in (cond.INVALID_SPEC, cond.RAY_UNREACHABLE,
                                                                   cond.RAY_NOT_CONFIGURED, cond.SECRET_UNAVAILABLE)


@dataclass(frozen=True)
class ObjectRef:
    """The MoEDeployment a pass is for."""

    namespace: str
    name: str
    generation: int = 0
    uid: str = ""  # the RayService's owner reference needs it (ray.mode KubeRay)


def reconcile(obj: ObjectRef, raw_spec: dict | None, status: dict, client: ServeBackend, settings: Settings, *,
              spec: MoEDeploymentSpec | None = None, fetch=fetch_app_status, wait_s: float = 600.0,
              api_key_digests: list[str] | None = None) -> Result:
    """ray.mode Existing (and standalone): the application on a Ray cluster through its REST API.
    `spec`: the parsed spec when the caller has it; `fetch`: how the app's status is read;
    `wait_s`: how long a written config may take to run; `api_key_digests`: the keys in force."""
    namespace, name, allowed_roots = obj.namespace, obj.name, list(settings.allowed_roots)
    http_port = settings.serve_http_port
    result = _Outcome(status, obj.generation)
    status = result.status
    spec, facts, failed = _validated(raw_spec, spec, allowed_roots, result)
    if failed:
        return failed
    app = app_name(namespace, name)
    elsewhere = moved(status, "Existing", client.dashboard_url)
    if elsewhere:
        return result(False, cond.INVALID_SPEC, elsewhere, "Warning")
    try:
        cluster = client.get()
    except (RayServeError, OSError) as err:
        return result(False, cond.RAY_UNREACHABLE, f"Ray dashboard {client.dashboard_url}: {err}", "Warning", retry=10)
    ingress_now, shards_now = deployed_placement(cluster, app), deployed_shards(cluster, app)
    base_url = f"http://{settings.endpoint_host}:{http_port}{spec.ingress.route_prefix.rstrip('/')}"
    try:
        step = placement_step(facts, spec, status, ingress_now, shards_now,
                              lambda: (fetch(base_url) or {}).get("replicas"), time.time())
        ours = render_application(namespace, name, spec, step.ingress, allowed_roots, shard_experts=step.shards,
                                  api_key_digests=api_key_digests)
    except UNRENDERABLE as err:
        return result(False, cond.INVALID_SPEC, f"cannot plan or render this spec: {err}", "Warning")
    pin_problem = pin_check(client, ours)
    try:
        with RAY_APPLY_SECONDS.time():  # a group no node can take: the others deploy, nobody waits for it
            cluster = apply_application(client, ours, http_port, wait_s, host=settings.serve_http_host,
                                        wait=pin_problem is None)
    except ValueError as err:  # route prefix clash and the like: the user must change the spec
        return result(False, cond.INVALID_SPEC, str(err), "Warning")
    except Unschedulable as err:  # the cluster may grow (autoscaler) or the spec change: look again soon
        return result(False, cond.UNSCHEDULABLE, str(err), "Warning", retry=15)
    except ReplicaStartFailed as err:  # the same spec fails the same way: back off (a spec change retries at once)
        delay = start_retry_s(result.conditions, time.time())
        return result(False, cond.REPLICA_START_FAILED, f"{err}; retrying in {delay} s", "Warning", retry=delay)
    except (RayServeError, OSError) as err:
        return result(False, cond.DEPLOY_FAILED, str(err), "Warning", retry=30)
    if pin_problem is not None:  # the cluster may gain such a node, or the spec change: look again soon
        return result(False, cond.UNSCHEDULABLE, pin_problem, "Warning", retry=15)
    status["endpoint"] = base_url + "/v1"
    status["rayAddress"] = client.dashboard_url
    if api_key_digests:
        status["apiKeys"] = {"count": len(api_key_digests), "fingerprint": keys_fingerprint(api_key_digests)}
    else:
        status.pop("apiKeys", None)
    events = record_step(status, step, ingress_now)
    live, swap_events = observe_live(spec, status, fetch)
    status.update(live)
    status["groups"] = observed_groups(cluster, app, step.shards, spec.experts.replicas_per_group, status.get("groups"))
    status["replicas"] = min((g["readyReplicas"] for g in status["groups"]), default=0)
    status.pop("selector", None)  # the replicas are Ray actors in Pods we do not own: no Pod label to select
    short = [g for g in status["groups"] if g["readyReplicas"] < g["replicas"]]
    result.set(cond.DEGRADED, bool(short), cond.REPLICAS_NOT_READY if short else cond.ALL_REPLICAS_READY,
               ", ".join(f"{g['name']}: {g['readyReplicas']}/{g['replicas']} ready" for g in short)
               or f"every replica of {len(status['groups'])} groups is running")
    return result.serving(f"serving at {status['endpoint']}", step, swap_events + events)


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


def observe_live(spec: MoEDeploymentSpec, status: dict, fetch=fetch_app_status) -> tuple[dict, list[tuple[str, str, str]]]:
    """Status fields from the running app's own report (tiers, overridden experts, hot-swaps)
    and the events for swaps that reached an outcome. ({}, []) when the app cannot be read now."""
    endpoint = status.get("endpoint")
    if not endpoint:
        return {}, []
    report = fetch(endpoint.removesuffix("/v1"))
    if report is None:
        return {}, []
    fields = checked(summarise(spec, report, status))
    return fields, swap_transitions(status.get("lastSwaps") or [], fields["lastSwaps"])


def app_from_rayservice(rayservice: dict | None) -> dict:
    """Our application's config in a RayService's serveConfigV2 ({} when there is none)."""
    if not rayservice:
        return {}
    try:
        config = yaml.safe_load((rayservice.get("spec") or {}).get("serveConfigV2") or "") or {}
    except yaml.YAMLError:
        return {}
    return next((a for a in config.get("applications") or [] if ingress_placement(a) is not None), {})


def placement_from_rayservice(rayservice: dict | None) -> dict[str, list[str]] | None:
    """The placement a RayService's serveConfigV2 carries (observed state for re-planning)."""
    return ingress_placement(app_from_rayservice(rayservice))


def reconcile_kuberay(obj: ObjectRef, raw_spec: dict | None, status: dict, kuberay: "KubeRayClient",
                      settings: Settings, *, spec: MoEDeploymentSpec | None = None, fetch=fetch_app_status) -> Result:
    """ray.mode KubeRay: own a RayService whose serveConfigV2 is the rendered app. Ready follows
    the application's own state in the RayService's status, for the generation we wrote
    (moe_operator.backends.kuberay_status); the RayService is written only when it changes."""
    from moe_operator.backends.kuberay import KubeRayError
    from moe_operator.backends.kuberay_status import healthy_deployments, service_state
    from moe_operator.render.rayservice import SERVE_PORT, name_problem, render_rayservice

    namespace, name, uid, allowed_roots = obj.namespace, obj.name, obj.uid, list(settings.allowed_roots)
    http_port, generation = SERVE_PORT, obj.generation
    result = _Outcome(status, generation)
    status = result.status
    spec, facts, failed = _validated(raw_spec, spec, allowed_roots, result)
    if failed:
        return failed
    elsewhere = moved(status, "KubeRay")
    if elsewhere:
        return result(False, cond.INVALID_SPEC, elsewhere, "Warning")
    problem = name_problem(name)
    if problem:
        return result(False, cond.INVALID_SPEC, problem, "Warning")
    prefix = spec.ingress.route_prefix.rstrip("/")
    base_url = f"http://{serve_service(namespace, name)}:{http_port}{prefix}"
    try:
        deployed = app_from_rayservice(kuberay.get(namespace, name))
        ingress_now = ingress_placement(deployed) if deployed else None
        step = placement_step(facts, spec, status, ingress_now, shard_experts(deployed) if deployed else None,
                              lambda: (fetch(base_url) or {}).get("replicas"), time.time())
        app = render_application(namespace, name, spec, step.ingress, allowed_roots, shard_experts=step.shards)
        observed = kuberay.apply(render_rayservice(namespace, name, uid, spec, app, http_port))
    except KubeRayError as err:
        return result(False, cond.DEPLOY_FAILED, str(err), "Warning", retry=30)
    except UNRENDERABLE as err:
        return result(False, cond.INVALID_SPEC, f"cannot plan or render this spec: {err}", "Warning")
    status["endpoint"] = base_url + "/v1"
    status["rayService"] = name
    state = service_state(observed, app["name"])
    healthy = healthy_deployments(observed, app["name"]) if state.ready or state.degraded else set()
    desired = spec.experts.replicas_per_group
    status["groups"] = [dump(GroupStatus(name=g, replicas=desired, ready_replicas=desired if g in healthy else 0,
                                         experts=len(experts))) for g, experts in sorted(step.shards.items())]
    status["replicas"] = min((g["readyReplicas"] for g in status["groups"]), default=0)
    status["selector"] = worker_selector(name)  # KubeRay's worker Pods
    result.set(cond.DEGRADED, bool(state.degraded), cond.DEPLOYMENT_UNHEALTHY if state.degraded else cond.ALL_REPLICAS_READY,
               state.degraded or "no deployment reported unhealthy")
    if not state.ready:
        warn = state.reason in (cond.DEPLOY_FAILED, cond.REPLICA_START_FAILED, cond.UNHEALTHY)
        res = result(False, state.reason, f"RayService {namespace}/{name}: {state.message}",
                     "Warning" if warn else "Normal", retry=None if state.terminal else (30 if warn else 5),
                     placement=step.ingress)
        if state.progressing:
            result.set(cond.PROGRESSING, True, state.reason, state.message)
        return res
    events = record_step(status, step, ingress_now)
    live, swap_events = observe_live(spec, status, fetch)
    status.update(live)
    return result.serving(f"serving at {status['endpoint']} (RayService {name})", step, swap_events + events)
