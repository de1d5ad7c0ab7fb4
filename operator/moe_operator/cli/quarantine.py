"""moectl quarantine: experts taken out of their routers' candidates (spec.routing.quarantine), or
put back with --lift; optionally waited for until the Ingress routes around them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from moe_operator.api import conditions as cond
from moe_workers.expert_ids import ExpertId, expert_key

from .access import edit_spec
from .console import app, err, fail, out


def with_quarantine(spec: dict, experts: list[str], lift: bool) -> list[str]:
    """The spec's routing.quarantine with `experts` added (or, lifting, removed), in expert order."""
    now = set((spec.get("routing") or {}).get("quarantine") or [])
    return sorted(now - set(experts) if lift else now | set(experts), key=expert_key)


def applied(doc: dict, wanted: list[str]) -> Optional[str]:
    """None while the operator has not applied `wanted`; "" once the Ingress routes by it; the
    reason when the object refused it (Ready=False at this generation)."""
    status = doc.get("status") or {}
    if status.get("observedGeneration") != doc["metadata"].get("generation"):
        return None
    ready = cond.get_condition(status.get("conditions") or [], cond.READY) or {}
    if ready.get("status") == "False" and ready.get("reason") == cond.INVALID_SPEC:
        return ready.get("message") or cond.INVALID_SPEC
    auto = set(status.get("autoQuarantined") or []) - set(wanted)  # spec.routing.autoQuarantine's, on top
    applied = [e for e in status.get("quarantinedExperts") or [] if e not in auto]
    return "" if sorted(applied, key=expert_key) == wanted else None


@app.command()
def quarantine(
    name: str = typer.Argument(..., help="MoEDeployment name."),
    experts: list[str] = typer.Argument(..., help="Expert ids LAYER.EXPERT, for example 3.12."),
    lift: bool = typer.Option(False, "--lift", help="Put the experts back among their routers' candidates."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the Ingress routes by the new set (or it is refused)."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds to wait with --wait."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Standalone mode: edit the manifest `moectl up` runs."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the quarantine that would be applied; change nothing."),
):
    """Contain experts: their routers leave them out (their tokens take their next choice), in place,
    without restarting replicas; --lift puts them back. Sets spec.routing.quarantine."""
    import time

    for e in experts:
        try:
            ExpertId.parse(e)
        except ValueError as error:
            fail(f"EXPERTS: {error}", 2)
    wanted: list[str] = []

    def change(spec: dict) -> dict:
        wanted[:] = with_quarantine(spec, experts, lift)
        return {"routing": {"quarantine": list(wanted)}}

    edited = edit_spec(name, namespace, kubeconfig, local, change, dry_run)
    if edited is None:
        return  # --dry-run: printed
    read, seen = edited
    what = f"{'lift of' if lift else 'quarantine of'} {', '.join(experts)} on {namespace}/{name}"
    if not wait:
        out.print(f"{what} requested; quarantined now: {', '.join(wanted) or 'none'}", soft_wrap=True)
        return
    deadline = time.monotonic() + timeout
    with err.status(f"{what}: waiting for the operator"):
        while time.monotonic() < deadline:
            doc = read()
            verdict = applied(doc, wanted) if seen(doc) else None
            if verdict:
                fail(f"{what} refused: {verdict}")
            if verdict == "":
                out.print(f"{what} applied: the Ingress leaves out {', '.join(wanted) or 'no expert'}", soft_wrap=True)
                return
            time.sleep(0.5)
    fail(f"{what} not applied within {timeout:.0f} s")
