"""One autoscaling pass (pure): smoothed load -> signals -> planner -> policy -> what to write.

The caller (the kopf timer, or standalone mode) reads the metrics source into a LoadWindow and
applies the Pass: status fields, an Event, and for mode Auto either a target placement in
status (the reconcile pass then applies it make-before-break) or a new replica count in the spec
(the same field the scale subresource writes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_operator.api import conditions as cond
from moe_operator.api.models import MoEDeploymentSpec
from moe_operator.api.status import checked
from moe_operator.autoscaling import policy
from moe_operator.autoscaling.signals import (coefficient_of_variation, expert_load, group_load, layer_imbalance,
                                              mean_imbalance)
from moe_operator.planner.rebalance import plan
from moe_workers.rfc3339 import format_rfc3339, parse_rfc3339


@dataclass
class Pass:
    autoscaling: dict  # status.autoscaling as it should be now
    status: dict = field(default_factory=dict)  # other status fields (imbalance, groups' load)
    event: tuple[str, str, str] | None = None
    replicas_per_group: int | None = None  # write into spec.experts.replicasPerGroup
    decision: policy.Decision | None = None


def _rfc(t: float | None) -> str | None:
    return None if t is None else format_rfc3339(t)


def autoscale(spec: MoEDeploymentSpec, status: dict, placement: dict[str, list[str]],
              rates: dict[tuple[str, str], float], now: float, expert_bytes: int,
              replicas_running: int, request: str | None = None,
              co_selection: dict[tuple[str, str], float] | None = None) -> Pass:
    """`rates`: smoothed expert-tokens/s per (group, expert) over the window; `placement`: what the
    ingress routes by now; `request`: the rebalance annotation's value (moectl rebalance). The
    status it writes is checked against the CRD's schema (api/status.py)."""
    out = _autoscale(spec, status, placement, rates, now, expert_bytes, replicas_running, request, co_selection)
    checked({**out.status, "autoscaling": out.autoscaling})
    return out


def _autoscale(spec: MoEDeploymentSpec, status: dict, placement: dict[str, list[str]],
               rates: dict[tuple[str, str], float], now: float, expert_bytes: int, replicas_running: int,
               request: str | None, co_selection: dict[tuple[str, str], float] | None) -> Pass:
    a = spec.autoscaling
    auto = dict(status.get("autoscaling") or {})
    groups = sorted(placement)
    loads = group_load(rates, groups)
    loads = {g: v for g, v in loads.items() if g in placement}  # a group that is gone no longer counts
    per_layer = layer_imbalance({k: v for k, v in rates.items() if k[0] in placement}, groups)
    imb = mean_imbalance(per_layer)
    out = Pass(auto, {"imbalance": round(imb, 3)})
    worst = max(per_layer, key=lambda layer: (per_layer[layer], -layer), default=None)
    out.status["worstLayer"] = None if worst is None else {"layer": worst, "imbalance": round(per_layer[worst], 3)}
    out.status["groups"] = [{**g, "load": round(loads.get(g["name"], 0.0), 2)} for g in status.get("groups") or []]
    auto["coefficientOfVariation"] = round(coefficient_of_variation(loads), 3)
    auto["tokensPerSecond"] = round(sum(loads.values()), 2)
    requested = request is not None and request != auto.get("lastRequest")
    if auto.get("target") is not None:
        out.decision = policy.Decision(policy.NONE, "a placement change is still being applied", False)
        auto["message"] = out.decision.reason
        return out  # one change at a time; the window keeps filling meanwhile
    if a.mode == "Off" and not requested:
        for k in ("aboveSince", "recommended"):
            auto.pop(k, None)
        return out

    proposal = plan(expert_load(rates), placement, expert_bytes, a.redundant_expert_slots,
                    co_selection=co_selection, max_moves=a.max_moves_per_step)
    auto["slotsPerGroup"] = proposal.slots_per_group
    # the planner's per-layer imbalance is on its even-split load model; compare like with like
    expected = proposal.imbalance
    signals = policy.Signals(imb, max(loads.values(), default=0.0), replicas_running,
                             spec.experts.replicas_per_group, expected)
    state = policy.PolicyState(parse_rfc3339(auto.get("aboveSince")), parse_rfc3339(auto.get("lastApplied")),
                               auto.get("lastSetReplicas"))
    if requested:
        auto["lastRequest"] = request
        if proposal.moved_copies and expected < imb * 0.98:
            decision = policy.Decision(policy.REBALANCE, f"requested ({request}): imbalance {imb:.2f}", True,
                                       imbalance_before=imb, imbalance_after=expected)
            state = policy.PolicyState(None, now, state.last_set_replicas)
        else:
            decision = policy.Decision(policy.NONE, f"requested ({request}): no placement does better than "
                                       f"imbalance {imb:.2f}", False, imbalance_before=imb, imbalance_after=expected)
    else:
        decision, state = policy.decide(a, signals, state, now)
    out.decision = decision
    auto["aboveSince"], auto["lastApplied"] = _rfc(state.above_since), _rfc(state.last_applied)
    if state.last_set_replicas is not None:
        auto["lastSetReplicas"] = state.last_set_replicas
    auto = {k: v for k, v in auto.items() if v is not None}
    out.autoscaling = auto
    auto["message"] = decision.reason  # live: why nothing happens now, or what does
    if decision.kind == policy.NONE and not requested:
        return out
    auto.update(lastDecision=decision.kind, reason=decision.reason, time=_rfc(now),
                imbalanceBefore=round(imb, 3))
    if decision.imbalance_after is not None:
        auto["imbalanceAfter"] = round(decision.imbalance_after, 3)
    if decision.kind == policy.REBALANCE:
        auto.update(movedCopies=proposal.moved_copies, bytesMoved=proposal.bytes_moved)
        if decision.apply:
            auto["target"] = proposal.placement
            auto["phase"] = "Loading"
            auto.pop("recommended", None)
            out.event = (cond.NORMAL, cond.REBALANCE_STARTED,
                         f"{decision.reason}; moving {proposal.moved_copies} expert copies "
                         f"({proposal.bytes_moved / 2**20:.1f} MiB), expected imbalance {expected:.2f}")
        elif auto.get("recommended") != proposal.placement:  # one event per new recommendation
            auto["recommended"] = proposal.placement
            out.event = (cond.NORMAL, cond.REBALANCE_RECOMMENDED, f"{decision.reason}; a rebalance would move "
                         f"{proposal.moved_copies} copies for imbalance {expected:.2f}")
    elif decision.kind in (policy.SCALE_UP, policy.SCALE_DOWN):
        if decision.apply:
            out.replicas_per_group = decision.replicas_per_group
        out.event = (cond.NORMAL, decision.kind if decision.apply else f"{decision.kind}Recommended", decision.reason)
    elif requested:
        out.event = (cond.NORMAL, cond.REBALANCE_NOT_NEEDED, decision.reason)
    return out
