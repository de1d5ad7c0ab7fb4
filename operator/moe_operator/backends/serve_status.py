"""What Ray Serve's application status says about why an app is not running (pure).

A replica whose constructor raises (a bad checkpoint file, the KV cache budget, out of memory, a
missing module) is retried by Serve and then reported in the deployment's message only: "The
deployment failed to start 3 times in a row. ... Error:\n<traceback>". `start_failure_message`
picks the exception out of it, so the condition says what to fix.

Serve reports a replica that its scheduler cannot place only in the deployment's message, after
RAY_SERVE_SLOW_STARTUP_WARNING_S (30 s by default): "... has N replicas that have taken more than
30s to be scheduled ... Resources required for each replica: {...}, total resources available:
{...}". The application stays DEPLOYING forever; this turns that into a reason the user can act on.
The same words come for a replica whose worker process is slow to start while the resources are
there (a loaded machine, a large import): then the figures show enough available, and the app
is only slow, not unschedulable.
"""

from __future__ import annotations

import json
import re

_NOT_PLACED = "to be scheduled"
_RESOURCES = "Resources required for each replica"
_FIGURES = re.compile(r"Resources required for each replica: (.*?), total resources available: (.*?)\. Use ")


def short_of_resources(message: str) -> bool:
    """Whether Ray's figures in `message` show a replica needing more of a resource than is
    available (placement-group bundles summed). Figures it cannot read count as short: Ray
    said it has not placed the replica."""
    m = _FIGURES.search(message)
    if not m:
        return True
    try:
        required, available = json.loads(m.group(1)), json.loads(m.group(2))
    except ValueError:
        return True
    need: dict[str, float] = {}
    for bundle in required if isinstance(required, list) else [required]:
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + float(v)
    return any(v > float(available.get(k, 0.0)) + 1e-9 for k, v in need.items())


def unschedulable(app: dict) -> list[tuple[str, str]]:
    """(deployment, Ray's message) for each deployment of `app` (one entry of GET
    /api/serve/applications/ `applications`) whose replicas Ray cannot place."""
    out = []
    for name, d in sorted((app.get("deployments") or {}).items()):
        message = d.get("message") or ""
        if d.get("status") != "HEALTHY" and _NOT_PLACED in message and _RESOURCES in message \
                and short_of_resources(message):
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


_START_FAILED = "failed to start"
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*)(?::\s*(.*))?$")
_EXCEPTION_NAMES = ("Error", "Exception", "Exit", "Interrupt", "Failure")


def exception_line(text: str) -> str:
    """The last exception of a traceback as `Name: message` (its module path dropped), or the
    last non-empty line when none is recognised."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        m = _EXCEPTION.match(line)
        if m and m.group(1).endswith(_EXCEPTION_NAMES):
            return m.group(1) + (f": {m.group(2)}" if m.group(2) else "")
    return lines[-1] if lines else ""


def start_failures(app: dict) -> list[tuple[str, str]]:
    """(deployment, the exception that stopped its replicas) for each deployment of `app` (one
    entry of GET /api/serve/applications/ `applications`, or KubeRay's serveDeploymentStatuses
    as {"deployments": ...}) whose replicas failed to start."""
    out = []
    for name, d in sorted((app.get("deployments") or {}).items()):
        message = d.get("message") or ""
        if d.get("status") != "HEALTHY" and _START_FAILED in message:
            out.append((name, exception_line(message.split("Error:", 1)[1] if "Error:" in message else message)))
    return out


def start_failure_message(app_name: str, app: dict) -> str | None:
    """One line naming each deployment that cannot start and why, or None."""
    found = start_failures(app)
    if not found:
        return None
    return (f"replicas of {app_name} fail in their constructor: "
            + "; ".join(f"{name}: {error}" for name, error in found))


def pinned(app: dict) -> dict[str, tuple[dict[str, str], dict[str, float]]]:
    """Deployment -> (the Ray node labels it must run on, what one replica needs: CPU, GPU) for
    each deployment of a rendered application (a Serve config entry) with a label selector."""
    out = {}
    for d in app.get("deployments") or []:
        opts = d.get("ray_actor_options") or {}
        if opts.get("label_selector"):
            out[d["name"]] = (dict(opts["label_selector"]),
                              {"CPU": float(opts.get("num_cpus") or 0), "GPU": float(opts.get("num_gpus") or 0)})
    return out


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def unplaceable_pins(app: dict, nodes: list[dict]) -> str | None:
    """One line naming each pinned deployment no live Ray node can take (none has its labels, or
    none of those is large enough for one replica), and the nodes there are; None when every pin
    has a node. `nodes`: Ray's node list (GET /api/v0/nodes: state, labels, resources_total)."""
    live = [n for n in nodes if n.get("state") == "ALIVE"]
    problems = []
    for name, (want, need) in sorted(pinned(app).items()):
        matching = [n for n in live if all((n.get("labels") or {}).get(k) == v for k, v in want.items())]
        if not matching:
            problems.append(f"{name} is pinned to Ray nodes labelled {_labels(want)}, and no live node has them")
        elif not any(all(float((n.get("resources_total") or {}).get(r, 0)) + 1e-9 >= v for r, v in need.items() if v)
                     for n in matching):
            problems.append(f"{name} is pinned to Ray nodes labelled {_labels(want)}, and none of the "
                            f"{len(matching)} with them has {', '.join(f'{v:g} {r}' for r, v in need.items() if v)}")
    if not problems:
        return None
    seen = sorted({_labels({k: v for k, v in (n.get("labels") or {}).items() if not k.startswith("ray.io/")})
                   or "(no labels)" for n in live})
    return "; ".join(problems) + f" (live nodes' labels: {'; '.join(seen) or 'none'}); the other groups are deployed"
