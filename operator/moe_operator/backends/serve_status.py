"""What Ray Serve's application status says about why an app is not running (pure).

Serve reports a replica that its scheduler cannot place only in the deployment's message, after
RAY_SERVE_SLOW_STARTUP_WARNING_S (30 s by default): "... has N replicas that have taken more than
30s to be scheduled ... Resources required for each replica: {...}, total resources available:
{...}". The application stays DEPLOYING forever; this turns that into a reason the user can act on.
"""

from __future__ import annotations

_NOT_PLACED = "to be scheduled"
_RESOURCES = "Resources required for each replica"


def unschedulable(app: dict) -> list[tuple[str, str]]:
    """(deployment, Ray's message) for each deployment of `app` (one entry of GET
    /api/serve/applications/ `applications`) whose replicas Ray cannot place."""
    out = []
    for name, d in sorted((app.get("deployments") or {}).items()):
        message = d.get("message") or ""
        if d.get("status") != "HEALTHY" and _NOT_PLACED in message and _RESOURCES in message:
            out.append((name, message))
    return out


def unschedulable_message(app_name: str, app: dict) -> str | None:
    """One line naming what Ray cannot place and what it has, or None."""
    found = unschedulable(app)
    if not found:
        return None
    parts = []
    for name, message in found:
        resources = message[message.index(_RESOURCES):].split(". Use `ray status`")[0]
        parts.append(f"{name}: {resources}")
    return (f"Ray cannot place every replica of {app_name}: " + "; ".join(parts)
            + " (lower numCpus/numGpus, fewer groups or replicas, or add Ray nodes)")
