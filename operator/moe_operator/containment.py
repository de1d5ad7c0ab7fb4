"""Automatic quarantine on a routing anomaly (spec.routing.autoQuarantine; pure).

The Ingress' detector names a surging expert (status.routingAnomalies, kind surge); with
autoQuarantine on, the whole pass adds it to the quarantine it renders, on top of the user's
spec.routing.quarantine, and keeps it in status.autoQuarantined. Never past the user's own rule:
the spec's quarantine plus the automatic one must pass `semantics.check_quarantine`
(maxQuarantinedShare of a layer, top-k candidates left, a group-limited router's groups); an expert
that would break it keeps serving and is listed in status.autoQuarantineRefused (so the loop does
not run the whole pass again for it every turn).

Lifting: an automatic quarantine stays while autoQuarantine is on, whether the surge goes on or
not (the expert gets no tokens once quarantined, so the surge always "ends": lifting it then would
let the same traffic surge it again). It is lifted by turning autoQuarantine off, or by putting the
expert in spec.routing.quarantine (it is then the user's: `moectl quarantine NAME L.E --lift`).
"""

from __future__ import annotations

from moe_operator.api.models import MoEDeploymentSpec
from moe_operator.api.semantics import check_quarantine
from moe_workers.expert_ids import expert_key

SURGE = "surge"


def surging(status: dict) -> list[str]:
    """The experts the detector says surge now (status.routingAnomalies)."""
    return sorted({r["expert"] for r in status.get("routingAnomalies") or [] if r.get("kind") == SURGE}, key=expert_key)


def pending(spec: dict, status: dict) -> bool:
    """Whether a surging expert waits for the whole pass to decide on it (the raw spec, as the
    loop has it): autoQuarantine on and an expert neither quarantined nor refused yet."""
    routing = spec.get("routing") or {}
    if not routing.get("autoQuarantine"):
        return bool(status.get("autoQuarantined"))  # turned off: the pass lifts them
    decided = set(routing.get("quarantine") or []) | set(status.get("autoQuarantined") or []) \
        | set(status.get("autoQuarantineRefused") or [])
    return any(e not in decided for e in surging(status))


def auto_quarantine(spec: MoEDeploymentSpec, facts, status: dict) -> tuple[list[str], list[str]]:
    """(experts quarantined automatically, surging experts refused): the previous automatic ones
    kept, each new surging expert added while the spec's quarantine plus these passes
    check_quarantine. Both empty with autoQuarantine off."""
    routing = spec.routing
    if not routing.auto_quarantine:
        return [], []
    user = list(routing.quarantine)
    chosen: list[str] = []
    refused: list[str] = []
    wanted = [e for e in status.get("autoQuarantined") or [] if e not in user]
    wanted += [e for e in surging(status) if e not in user and e not in wanted]
    for eid in wanted:
        trial = spec.model_copy(update={"routing": routing.model_copy(update={"quarantine": user + chosen + [eid]})})
        reason, _, _ = check_quarantine(trial, [], facts)
        (refused if reason else chosen).append(eid)
    return sorted(chosen, key=expert_key), sorted(refused, key=expert_key)
