"""One reconcile pass, shared by the kopf operator and standalone mode.

Everything is computed from observed state: the spec as it is now and the application as the Ray
cluster reports it (its placement is read back from the deployed Ingress user_config), so a
restarted operator converges to the same result and never deploys twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moe_operator.api import conditions as cond
from moe_operator.api.models import MoEDeploymentSpec
from moe_operator.api.semantics import validate_semantics
from moe_operator.api.status import FIELDS as STATUS_FIELDS, build, checked
from moe_operator.api.validation import SpecError, parse_spec
from moe_operator.backends.kuberay_backend import (  # noqa: F401 (re-exported)
    UNRENDERABLE, KubeRayBackend, app_from_rayservice, placement_from_rayservice)
from moe_operator.backends.rest_backend import (  # noqa: F401 (re-exported)
    RestBackend, apply_application, http_options, keys_fingerprint, moved, observed_groups, remove_application,
    request_removal, same_config, start_retry_s)
from moe_operator.backends.serve_backend import (  # noqa: F401 (re-exported)
    Backend, BackendError, ObjectRef, ServeBackend, ingress_placement, shard_experts)
from moe_operator.observe import anomaly_events, fetch_app_status, summarise, swap_transitions
from moe_operator.autoscaling import transition
from moe_operator.containment import auto_quarantine
from moe_operator.planner.initial import current_placement, placement_problem
from moe_operator.names import app_name
from moe_operator.render.serve_app import render_application
from moe_operator.settings import Settings
from moe_workers.expert_ids import expert_key
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


def deployed_placement(cluster: dict, name: str) -> dict[str, list[str]] | None:
    """The placement the cluster is serving for application `name`, from its deployed config."""
    app = cluster.get("applications", {}).get(name) or {}
    return ingress_placement(app.get("deployed_app_config") or {})


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
            events.append((cond.NORMAL, cond.REBALANCED, f"new placement serving; {step.message}; imbalance before "
                           f"{auto.get('imbalanceBefore') or 0:.2f}, expected after {auto.get('imbalanceAfter') or 0:.2f}"))
        auto.pop("target", None)
        auto.pop("switchedAt", None)
        auto["phase"] = transition.STEADY
    else:
        auto["phase"] = step.phase
    status["autoscaling"] = auto
    return events


class _Outcome:
    """Builds a pass's Result: Ready/Progressing written through the pure condition helper, the
    fields the pass found gathered in `status` (its own copy), and the status built from the typed
    model once, when the pass returns (`api/status.build`)."""

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

    def __call__(self, ok: bool, reason: str, message: str, event_type: str = cond.NORMAL, retry: float | None = None,
                 placement=None, progress: tuple[str, str] | None = None, rolling_out: bool = False) -> Result:
        """The Result with Ready set; Progressing True with `progress` (reason, message) when given,
        else False. Each condition is set once a pass (its lastTransitionTime moves only on a flip).
        status.observedGeneration says the generation whose outcome status reports: it stays as it
        was while Ray is still rolling the generation out (`rolling_out`), so a reader that waits for
        it (`moectl hot-swap --wait`) never reads the previous generation's swap records as this one's."""
        g = self.generation
        self.set(cond.READY, ok, reason, message)
        if progress is not None:
            self.set(cond.PROGRESSING, True, *progress)
        else:
            self.set(cond.PROGRESSING, False, reason if not ok else cond.RECONCILED,
                     message if not ok else f"generation {g} applied")
        if not rolling_out:
            self.status["observedGeneration"] = g
        return Result(build(self.status), (event_type, reason, message), retry, ok, placement or {})

    def serving(self, message: str, step: transition.Step, events: list[tuple[str, str, str]],
                rollout: tuple[str, str, float] | None = None) -> Result:
        """Ready (Serving), and Progressing while the placement step is not done (Rebalancing,
        retried when the step says) or while the backend rolls a change out (`rollout`: reason,
        message, retry)."""
        progress, retry = None, None
        if not step.done:
            progress, retry = (cond.REBALANCING, f"{step.phase}: {step.message}"), step.retry_after_s
        if rollout is not None:
            progress, retry = rollout[:2], min(retry or rollout[2], rollout[2])
        res = self(True, cond.SERVING, message, placement=step.ingress, progress=progress, retry=retry,
                   rolling_out=rollout is not None)
        res.events = events
        return res


def _validated(raw_spec, spec, allowed_roots, result: _Outcome):
    """(spec, facts, None) or (None, None, a failed Result)."""
    if spec is None:
        try:
            spec = parse_spec(raw_spec)
        except SpecError as err:
            return None, None, result(False, cond.INVALID_SPEC, str(err), cond.WARNING)
    facts, problems, reason = validate_semantics(spec, allowed_roots)
    if problems:
        return None, None, result(False, reason or cond.INVALID_SPEC, "; ".join(problems), cond.WARNING)
    return spec, facts, None


def outcome_events(before: dict, res: Result) -> list[tuple[str, str, str]]:
    """The Events a pass posts: its outcome (Ready's reason) when Ready's status or reason changed
    or the pass is for a generation status had not observed (a new spec's outcome is always told;
    a pass retried while Ray deploys, or a steady one, tells nothing new), then the hot-swap and
    rebalance outcomes it saw."""
    was = cond.get_condition((before or {}).get("conditions") or [], cond.READY) or {}
    now = cond.get_condition(res.status.get("conditions") or [], cond.READY) or {}
    told = ((was.get("status"), was.get("reason")) != (now.get("status"), now.get("reason"))
            or (before or {}).get("observedGeneration") != res.status.get("observedGeneration"))
    return ([res.event] if res.event and told else []) + res.events


def unconfigured(status: dict, generation: int, reason: str, message: str, retry: float | None) -> Result:
    """The pass could not start: something it needs from outside the spec (a Secret, the Ray
    address) is missing or unreadable. Ready=False with the reason, a Warning Event."""
    return _Outcome(status, generation)(False, reason, message, cond.WARNING, retry=retry)


def never_deployed(status: dict | None) -> bool:
    """True when this object never had a Serve application: it was never served (no endpoint)
    and it stopped before any Serve config was written (an invalid spec, or a Ray dashboard that
    never answered). Deleting such an object needs nothing from Ray, which may never answer."""
    status = status or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == cond.READY), {})
    return not status.get("endpoint") and ready.get("reason") in (cond.INVALID_SPEC, cond.RAY_UNREACHABLE,
                                                                   cond.RAY_NOT_CONFIGURED, cond.SECRET_UNAVAILABLE)


def reconcile(obj: ObjectRef, raw_spec: dict | None, status: dict, client: ServeBackend, settings: Settings, *,
              spec: MoEDeploymentSpec | None = None, fetch=fetch_app_status,
              api_key_digests: list[str] | None = None) -> Result:
    """ray.mode Existing (and standalone): `run_pass` over a Ray cluster's Serve REST API.
    `api_key_digests`: the keys in force."""
    return run_pass(obj, raw_spec, status, rest_backend(client, settings, api_key_digests=api_key_digests),
                    settings, spec=spec, fetch=fetch)


def rest_backend(client: ServeBackend, settings: Settings, **kw) -> RestBackend:
    return RestBackend(client, http_port=settings.serve_http_port, http_host=settings.serve_http_host,
                       endpoint_host=settings.endpoint_host, **kw)


def reconcile_kuberay(obj: ObjectRef, raw_spec: dict | None, status: dict, kuberay: "KubeRayClient",
                      settings: Settings, *, spec: MoEDeploymentSpec | None = None, fetch=fetch_app_status) -> Result:
    """ray.mode KubeRay: `run_pass` over a RayService the MoEDeployment owns."""
    return run_pass(obj, raw_spec, status, KubeRayBackend(kuberay), settings, spec=spec, fetch=fetch)


def run_pass(obj: ObjectRef, raw_spec: dict | None, status: dict, backend: Backend, settings: Settings, *,
             spec: MoEDeploymentSpec | None = None, fetch=fetch_app_status) -> Result:
    """The whole reconcile pass, for every backend: validate the spec, refuse what would move a
    served object, observe what is deployed, plan the placement step from it, render, apply, then
    build status from what the backend and the app report. Every exit is a `Result`: the status to
    write, the Event, when to look again. `spec`: the parsed spec when the caller has it; `fetch`:
    how the app's own report is read."""
    allowed_roots = list(settings.allowed_roots)
    result = _Outcome(status, obj.generation)
    status = result.status
    spec, facts, failed = _validated(raw_spec, spec, allowed_roots, result)
    if failed:
        return failed
    refused = backend.refusal(status, obj)
    if refused:
        return result(False, cond.INVALID_SPEC, refused, cond.WARNING)
    app = app_name(obj.namespace, obj.name)
    base_url = backend.base_url(obj, spec)
    try:
        deployed = backend.observe(obj) or {}
        ingress_now = ingress_placement(deployed) if deployed else None
        try:
            step = placement_step(facts, spec, status, ingress_now, shard_experts(deployed) if deployed else None,
                                  lambda: (fetch(base_url) or {}).get("replicas"), time.time())
            auto_events = contain(spec, facts, status)
            ours = render_application(obj.namespace, obj.name, spec, step.ingress, allowed_roots,
                                      shard_experts=step.shards, api_key_digests=backend.api_key_digests,
                                      auto_quarantine=status.get("autoQuarantined"))
        except UNRENDERABLE as err:
            return result(False, cond.INVALID_SPEC, f"cannot plan or render this spec: {err}", cond.WARNING)
        state = backend.apply(obj, spec, ours, result.conditions)
    except BackendError as err:
        return result(False, err.reason, str(err), cond.WARNING, retry=err.retry_s)
    status["endpoint"] = base_url + "/v1"
    backend.record(status, obj)
    status["groups"] = backend.groups(state, app, step.shards, spec.experts.replicas_per_group, status.get("groups"))
    status["replicas"] = min((g["readyReplicas"] for g in status["groups"]), default=0)
    result.set(cond.DEGRADED, *backend.degraded(state, status["groups"]))
    if not state.ready:
        return result(False, state.reason, state.message, cond.WARNING if state.warning else cond.NORMAL,
                      retry=state.retry_s, placement=step.ingress,
                      progress=(state.reason, state.progress) if state.progress else None,
                      rolling_out=state.reason == cond.DEPLOYING)
    events = record_step(status, step, ingress_now) + auto_events
    live, swap_events = observe_live(spec, status, fetch)
    status.update(live)
    rollout = (state.reason, state.progress, state.retry_s) if state.progress else None  # serving while a change rolls out
    return result.serving(backend.serving_message(status["endpoint"], obj), step, swap_events + events, rollout)


def contain(spec: MoEDeploymentSpec, facts, status: dict) -> list[tuple[str, str, str]]:
    """status.autoQuarantined / autoQuarantineRefused for this pass (`containment`), and an Event
    for each expert taken out, lifted or refused since the last pass."""
    before, before_refused = set(status.get("autoQuarantined") or []), set(status.get("autoQuarantineRefused") or [])
    auto, refused = auto_quarantine(spec, facts, status)
    status["autoQuarantined"], status["autoQuarantineRefused"] = auto or None, refused or None
    events = []
    added, lifted = [e for e in auto if e not in before], sorted(before - set(auto), key=expert_key)
    if added:
        events.append((cond.WARNING, cond.AUTO_QUARANTINED, f"quarantined {', '.join(added)} on a routing surge "
                       "(spec.routing.autoQuarantine); put them in spec.routing.quarantine to lift them by hand"))
    if lifted:
        events.append((cond.NORMAL, cond.AUTO_QUARANTINED, f"lifted the automatic quarantine of {', '.join(lifted)}"))
    new_refused = [e for e in refused if e not in before_refused]
    if new_refused:
        events.append((cond.WARNING, cond.AUTO_QUARANTINE_REFUSED, f"{', '.join(new_refused)} surge but keep serving: "
                       f"quarantining them would pass spec.routing.maxQuarantinedShare "
                       f"({spec.routing.max_quarantined_share}) or leave a layer fewer than top-k candidates"))
    return events


def deploying(status: dict) -> bool:
    """Whether Ray is still deploying what the last pass applied (pure): Ready=False, or
    Progressing=True while the previous version serves, with reason Deploying. A runner that wants
    an outcome runs the next pass after the pass' short retry."""
    conditions = status.get("conditions") or []
    ready = cond.get_condition(conditions, cond.READY) or {}
    progressing = cond.get_condition(conditions, cond.PROGRESSING) or {}
    return ((ready.get("status") == "False" and ready.get("reason") == cond.DEPLOYING)
            or (progressing.get("status") == "True" and progressing.get("reason") == cond.DEPLOYING))


def observe_live(spec: MoEDeploymentSpec, status: dict, fetch=fetch_app_status) -> tuple[dict, list[tuple[str, str, str]]]:
    """Status fields from the running app's own report (tiers, overridden experts, hot-swaps,
    routing anomalies) and the events for swaps that reached an outcome and for a routing anomaly.
    ({}, []) when the app cannot be read now."""
    endpoint = status.get("endpoint")
    if not endpoint:
        return {}, []
    report = fetch(endpoint.removesuffix("/v1"))
    if report is None:
        return {}, []
    fields = checked(summarise(spec, report, status))
    return fields, (swap_transitions(status.get("lastSwaps") or [], fields["lastSwaps"])
                    + anomaly_events(status.get("conditions") or [], fields["conditions"], report.get("routing") or {}))
