"""What a RayService's status says about our application (pure; no cluster).

KubeRay (ray.io/v1, read as written by KubeRay 1.3 and later; checked against the 1.5.0 controller)
keeps two kinds of status:
- conditions: `Ready` (True once the serve Service has endpoints, whatever the application does
  afterwards), `UpgradeInProgress` (a new RayCluster is being prepared beside the active one),
  with terminal reasons `InitializingTimeout` and `ValidationFailed` on Ready;
- the Serve applications as the dashboard reports them, per cluster:
  `activeServiceStatus.applicationStatuses["<app>"]` (status RUNNING / DEPLOYING / DEPLOY_FAILED /
  UNHEALTHY / ..., message, and `serveDeploymentStatuses[<deployment>]` HEALTHY / UPDATING /
  UNHEALTHY) and the same under `pendingServiceStatus` while an upgrade runs. A new RayService's
  first cluster is pending too (no active cluster yet, `UpgradeInProgress` False with reason
  `Initializing`) until its application runs: that is a first deploy, not an upgrade.
Both belong to `status.observedGeneration`: a status older than the RayService we wrote says
nothing about what we asked for.

`service_state()` turns that into what the MoEDeployment's conditions say. Ready only when the
active application is RUNNING with every deployment HEALTHY, KubeRay's own Ready is True (the
Service has endpoints), no upgrade is pending, and the status is for the current generation.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_operator.api import conditions as cond

from .serve_status import start_failure_message, unschedulable_message

# KubeRay's Ready reasons after which it stops trying (until the RayService changes)
TERMINAL_REASONS = ("InitializingTimeout", "ValidationFailed")


@dataclass(frozen=True)
class ServiceState:
    ready: bool
    reason: str  # the MoEDeployment's Ready reason
    message: str
    progressing: bool = False  # Progressing=True with `reason` (deploying, upgrading, waiting for KubeRay)
    degraded: str = ""  # the unhealthy deployments, named, for Degraded=True
    terminal: bool = False  # KubeRay gave up: no point retrying until the spec changes


def _condition(status: dict, type_: str) -> dict | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def _app(service_status: dict | None, app: str) -> dict | None:
    return ((service_status or {}).get("applicationStatuses") or {}).get(app)


def healthy_deployments(rayservice: dict, app: str) -> set[str]:
    """The deployments of our application KubeRay reports HEALTHY on the active cluster."""
    active = _app((rayservice.get("status") or {}).get("activeServiceStatus"), app) or {}
    return {n for n, d in (active.get("serveDeploymentStatuses") or {}).items() if d.get("status") == "HEALTHY"}


def _unhealthy(app_status: dict) -> list[str]:
    deployments = app_status.get("serveDeploymentStatuses") or {}
    return [f"{name} {d.get('status')}" + (f": {d['message']}" if d.get("message") else "")
            for name, d in sorted(deployments.items()) if d.get("status") == "UNHEALTHY"]


def service_state(rayservice: dict, app: str) -> ServiceState:
    meta, status = rayservice.get("metadata") or {}, rayservice.get("status") or {}
    name = meta.get("name", "?")
    generation, observed = meta.get("generation") or 0, status.get("observedGeneration") or 0
    ready_cond = _condition(status, "Ready") or {}
    if ready_cond.get("status") == "False" and ready_cond.get("reason") in TERMINAL_REASONS:
        # terminal whatever the generation: KubeRay keeps it until the RayService changes
        return ServiceState(False, cond.DEPLOY_FAILED, f"KubeRay gave up on RayService {name} "
                            f"({ready_cond['reason']}): {ready_cond.get('message') or 'no message'}; "
                            "change the MoEDeployment to try again", terminal=True)
    if not status or observed < generation:
        return ServiceState(False, cond.WAITING_FOR_KUBERAY,
                            f"KubeRay has not observed generation {generation} of RayService {name} yet "
                            f"(its status is for generation {observed})", progressing=True)
    upgrade = _condition(status, "UpgradeInProgress") or {}
    pending = status.get("pendingServiceStatus") or {}
    active = _app(status.get("activeServiceStatus"), app)
    first = not (status.get("activeServiceStatus") or {}).get("rayClusterName")
    if upgrade.get("status") == "True" or pending.get("rayClusterName") or pending.get("applicationStatuses"):
        pending_app = _app(pending, app) or {}
        if pending_app.get("status") == "DEPLOY_FAILED":  # the new cluster cannot run it: not an upgrade
            unhealthy = _unhealthy(pending_app)
            start = start_failure_message(app, {"deployments": pending_app.get("serveDeploymentStatuses") or {}})
            return ServiceState(False, cond.REPLICA_START_FAILED if start else cond.DEPLOY_FAILED,
                                f"application {app} DEPLOY_FAILED on the new Ray cluster "
                                f"{pending.get('rayClusterName') or ''}".rstrip() +
                                f": {start or pending_app.get('message') or 'no message'}", degraded="; ".join(unhealthy))
        if first:  # KubeRay brings a RayService's first cluster up as its pending one, then promotes it
            return ServiceState(False, cond.DEPLOYING, f"KubeRay is starting the Ray cluster "
                                f"{pending.get('rayClusterName') or ''} of RayService {name}".replace("  ", " ") +
                                (f"; application {pending_app['status']}" if pending_app.get("status") else "") +
                                (f" ({ready_cond.get('reason')}: {ready_cond.get('message')})"
                                 if ready_cond.get("reason") else ""), progressing=True)
        return ServiceState(False, cond.UPGRADING, f"KubeRay is moving RayService {name} to a new Ray cluster "
                            f"{pending.get('rayClusterName') or ''}".rstrip() +
                            (f"; pending application {pending_app['status']}" if pending_app.get("status") else "") +
                            (f" ({upgrade['message']})" if upgrade.get("message") else ""), progressing=True)
    if active is None:
        return ServiceState(False, cond.DEPLOYING, f"RayService {name}: application {app} not reported yet"
                            + (f" ({ready_cond['reason']}: {ready_cond.get('message')})" if ready_cond.get("reason") else ""),
                            progressing=True)
    state, message = active.get("status") or "", active.get("message") or ""
    unhealthy = _unhealthy(active)
    if state == "DEPLOY_FAILED":
        start = start_failure_message(app, {"deployments": active.get("serveDeploymentStatuses") or {}})
        return ServiceState(False, cond.REPLICA_START_FAILED if start else cond.DEPLOY_FAILED,
                            f"application {app} DEPLOY_FAILED: {start or message or 'no message'}",
                            degraded="; ".join(unhealthy))
    if state == "UNHEALTHY" or unhealthy:
        return ServiceState(False, cond.UNHEALTHY, f"application {app} {state}"
                            + (f": {'; '.join(unhealthy)}" if unhealthy else f": {message or 'no message'}"),
                            degraded="; ".join(unhealthy) or f"application {app} {state}")
    stuck = unschedulable_message(app, {"deployments": active.get("serveDeploymentStatuses") or {}})
    if stuck:  # KubeRay's autoscaler may still add a node: reported, and looked at again
        return ServiceState(False, cond.UNSCHEDULABLE, stuck, progressing=True)
    updating = sorted(n for n, d in (active.get("serveDeploymentStatuses") or {}).items()
                      if d.get("status") != "HEALTHY")
    if state != "RUNNING" or updating:
        return ServiceState(False, cond.DEPLOYING, f"application {app} {state or 'has no status'}"
                            + (f", deployments not healthy yet: {', '.join(updating)}" if updating else "")
                            + (f": {message}" if message else ""), progressing=True)
    if ready_cond.get("status") != "True":
        return ServiceState(False, cond.NO_SERVE_ENDPOINTS, f"application {app} RUNNING but RayService {name} is not "
                            f"Ready ({ready_cond.get('reason') or 'no Ready condition'}: "
                            f"{ready_cond.get('message') or 'no message'})", progressing=True)
    return ServiceState(True, cond.SERVING, f"application {app} RUNNING, every deployment HEALTHY")
