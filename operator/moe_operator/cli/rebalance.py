"""moectl rebalance: ask the autoscaler for a rebalance now, optionally waited for."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
import yaml

from moe_workers.rfc3339 import format_rfc3339

from .access import fetch_local, kube_call, kube_objects, object_args, read_object
from .console import app, err, fail, out


@app.command()
def rebalance(
    name: str = typer.Argument(..., help="MoEDeployment name."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the operator has decided, and a rebalance it "
                              "started serves (make-before-break: loaded, switched, drained)."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait with --wait."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Standalone mode: ask the `moectl up` running this object."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the request that would be applied and what the "
                                 "autoscaler sees now; change nothing."),
):
    """Ask for a rebalance now (skips the stabilization window and cooldown, in any autoscaling mode;
    happens only when the planner finds a better placement)."""
    import time
    import uuid

    from moe_operator.names import REBALANCE_ANNOTATION
    from moe_operator.standalone.runner import default_state_dir, rebalance_request_path

    request = f"{format_rfc3339()}-{uuid.uuid4().hex[:6]}"
    patch = {"metadata": {"annotations": {REBALANCE_ANNOTATION: request}}}
    if local:
        read = lambda: fetch_local(name, namespace, False)[0]  # noqa: E731
    else:
        api = kube_objects(kubeconfig)
        read = lambda: read_object(api, namespace, name)  # noqa: E731
    doc = read()
    auto = (doc.get("status") or {}).get("autoscaling") or {}
    if dry_run:
        sys.stdout.write(yaml.safe_dump(patch, sort_keys=False))
        err.print(f"imbalance now {(doc.get('status') or {}).get('imbalance', 'unknown')}; autoscaler: "
                  f"{auto.get('message') or 'no reading yet'}", markup=False, highlight=False)
        return
    if local:
        path = rebalance_request_path(default_state_dir(), namespace, name)
        path.write_text(request + "\n")
    else:
        with kube_call(namespace, name):
            api.patch_namespaced_custom_object(*object_args(namespace, name), patch, _request_timeout=30)
    if not wait:
        out.print(f"rebalance of {namespace}/{name} requested ({request})", soft_wrap=True)
        return
    deadline = time.monotonic() + timeout
    with err.status(f"rebalance of {namespace}/{name}: waiting for the operator to read load") as spinner:
        while time.monotonic() < deadline:
            auto = (read().get("status") or {}).get("autoscaling") or {}
            if auto.get("lastRequest") == request:
                if auto.get("target") is None and auto.get("lastDecision") == "Rebalance" and \
                        str(auto.get("reason", "")).startswith(f"requested ({request})"):
                    out.print(f"rebalanced {namespace}/{name}: imbalance {auto.get('imbalanceBefore', 0):.2f} -> "
                              f"expected {auto.get('imbalanceAfter', 0):.2f}, {auto.get('movedCopies', 0)} copies moved "
                              f"({auto.get('bytesMoved', 0) / 2**20:.1f} MiB)", soft_wrap=True)
                    return
                if auto.get("target") is None:
                    out.print(f"no rebalance: {auto.get('message', '')}", soft_wrap=True)
                    return
                spinner.update(f"rebalance of {namespace}/{name}: {auto.get('phase', 'Loading')}")
            time.sleep(0.5)
    fail(f"rebalance of {namespace}/{name} did not finish within {timeout:.0f} s")
