"""ray.mode KubeRay: the MoEDeployment owns a RayService whose serveConfigV2 is the rendered app.
A `Backend` (backends/serve_backend.py). Ready follows the application's own state in the
RayService's status, for the generation we wrote (backends/kuberay_status.py); the RayService is
written only when it changes, and apply never waits: the next pass reads KubeRay's progress."""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from moe_operator.api import conditions as cond
from moe_operator.api.models import GroupStatus, MoEDeploymentSpec
from moe_operator.api.status import dump
from moe_operator.backends.kuberay import KubeRayClient, KubeRayError
from moe_operator.backends.kuberay_status import healthy_deployments, service_state
from moe_operator.backends.rest_backend import moved
from moe_operator.backends.serve_backend import AppState, BackendError, ObjectRef, ingress_placement
from moe_operator.names import serve_service, worker_selector
from moe_operator.render.rayservice import SERVE_PORT, name_problem, render_rayservice

# what planning and rendering raise on a spec the parser let through (pydantic's errors are ValueErrors)
UNRENDERABLE = (ValueError, TypeError, ArithmeticError)
STARTING_RETRY_S, FAILING_RETRY_S = 5, 30  # KubeRay still working on it; KubeRay reports a failure


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


@dataclass
class KubeRayBackend:
    kuberay: KubeRayClient
    mode: str = "KubeRay"
    api_key_digests: list[str] | None = None  # (the RayService's app is rendered without keys)

    def refusal(self, status: dict, obj: ObjectRef) -> str | None:
        return moved(status, self.mode) or name_problem(obj.name)

    def base_url(self, obj: ObjectRef, spec: MoEDeploymentSpec) -> str:
        return f"http://{serve_service(obj.namespace, obj.name)}:{SERVE_PORT}{spec.ingress.route_prefix.rstrip('/')}"

    def observe(self, obj: ObjectRef) -> dict | None:
        try:
            return app_from_rayservice(self.kuberay.get(obj.namespace, obj.name)) or None
        except KubeRayError as err:
            raise BackendError(cond.DEPLOY_FAILED, str(err), FAILING_RETRY_S)

    def apply(self, obj: ObjectRef, spec: MoEDeploymentSpec, app: dict, conditions: list[dict]) -> AppState:
        try:
            rayservice = render_rayservice(obj.namespace, obj.name, obj.uid, spec, app, SERVE_PORT)
        except UNRENDERABLE as err:
            raise BackendError(cond.INVALID_SPEC, f"cannot plan or render this spec: {err}")
        try:
            observed = self.kuberay.apply(rayservice)
        except KubeRayError as err:
            raise BackendError(cond.DEPLOY_FAILED, str(err), FAILING_RETRY_S)
        s = service_state(observed, app["name"])
        if s.ready:
            return AppState(True, degraded=s.degraded, observed=(observed, True))
        warn = s.reason in (cond.DEPLOY_FAILED, cond.REPLICA_START_FAILED, cond.UNHEALTHY)
        return AppState(False, s.reason, f"RayService {obj.namespace}/{obj.name}: {s.message}",
                        progress=s.message if s.progressing else "", degraded=s.degraded,
                        retry_s=None if s.terminal else (FAILING_RETRY_S if warn else STARTING_RETRY_S), warning=warn,
                        observed=(observed, bool(s.degraded)))

    def record(self, status: dict, obj: ObjectRef) -> None:
        status["rayService"] = obj.name
        status["selector"] = worker_selector(obj.name)  # KubeRay's worker Pods

    def groups(self, state: AppState, app: str, shards: dict[str, list[str]], desired: int,
               previous: list[dict] | None) -> list[dict]:
        observed, reported = state.observed  # the app's deployments are reported once it runs (or some fail)
        healthy = healthy_deployments(observed, app) if reported else set()
        return [dump(GroupStatus(name=g, replicas=desired, ready_replicas=desired if g in healthy else 0,
                                 experts=len(experts))) for g, experts in sorted(shards.items())]

    def degraded(self, state: AppState, groups: list[dict]) -> tuple[bool, str, str]:
        if state.degraded:
            return True, cond.DEPLOYMENT_UNHEALTHY, state.degraded
        return False, cond.ALL_REPLICAS_READY, "no deployment reported unhealthy"

    def serving_message(self, endpoint: str, obj: ObjectRef) -> str:
        return f"serving at {endpoint} (RayService {obj.name})"

    def delete(self, obj: ObjectRef) -> bool:
        # the owner reference lets the garbage collector do this too; deleting it here means the
        # finalizer is only released once the RayService is gone: KubeRay's own finalizer holds it
        # (deletionTimestamp set) until its Ray cluster is down, and each ask meanwhile is a no-op
        try:
            return not self.kuberay.delete_owned(obj.namespace, obj.name, obj.uid)
        except KubeRayError as err:
            raise BackendError(cond.DEPLOY_FAILED, str(err), 10)
