"""The body of an object's loop in the kopf operator: one turn (`one_pass`) reads the object as it
is, runs the reconcile pass (`reconcile.run_pass`) over the object's `Backend` or, while it serves
its generation, only reads the app's live report; writes status once if it changed; posts the
turn's Events; and says how long to sleep. Also the wake-ups the handlers set (`Wakers`). Not pure:
reads Secrets, talks to the backend, writes status and Events; `needs_pass` alone is pure. The kopf
daemon that turns it lives in `handlers/operator.py`."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from typing import NamedTuple

import kopf

from moe_operator import containment
from moe_operator.api import conditions as cond
from moe_operator.api.status import status_patch
from moe_operator.api.validation import SpecError, parse_spec
from moe_operator.clients import Unconfigured, api_key_digests, backend_for, kuberay_mode
from moe_operator.metrics import APPLIED_GENERATION, LOOP_TURNS, RECONCILE_SECONDS, RECONCILES
from moe_operator.reconcile import ObjectRef, Result, keys_fingerprint, observe_live, outcome_events, run_pass, unconfigured
from moe_operator.settings import RENDER_ONLY

STEADY_S = 5.0  # a serving object's loop reads its live report this often
EVENT_MESSAGE_LIMIT = 1000  # characters of an Event's message (the apiserver keeps 1 KiB of it)
log = logging.getLogger(__name__)


class Wakers:
    """Per object, the asyncio.Event its loop sleeps on between passes (handlers set it from the
    operator's event loop or from a worker thread: a sync handler), and the lock a pass holds while
    it runs, which the finalizer's handler takes too: a pass that started before the deletion
    cannot apply the application again after the handler removed it."""

    def __init__(self):
        self._events: dict[str, asyncio.Event] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def lock(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def locked(self, key: str, fn, *args):
        """fn(*args) holding the object's lock (in a worker thread)."""
        with self.lock(key):
            return fn(*args)

    def event(self, key: str) -> asyncio.Event:
        """The loop's own event (called from the loop, on the operator's event loop)."""
        self._loop = asyncio.get_running_loop()
        return self._events.setdefault(key, asyncio.Event())

    def wake(self, key: str) -> None:
        event = self._events.get(key)
        if event is None:
            return  # no loop yet: its first pass is still to come
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop or self._loop is None:
            event.set()
        else:
            self._loop.call_soon_threadsafe(event.set)

    def forget(self, key: str) -> None:
        self._events.pop(key, None)
        with self._guard:
            self._locks.pop(key, None)


def post_events(body, events) -> None:
    """Each (type, reason, message) as an Event on the object."""
    for event_type, reason, message in events:
        kopf.event(body, type=event_type, reason=reason, message=message[:EVENT_MESSAGE_LIMIT])


def write_status(memo: kopf.Memo, namespace: str, name: str, before: dict, after: dict) -> None:
    """The one status write: a merge patch of what changed, both sides read through the typed
    status (`api/status.status_patch`); none when nothing did."""
    change = status_patch(before, after)
    if change:
        memo.kube.patch_status(namespace, name, change)


def needs_pass(spec: dict, meta: dict, status: dict, first: bool) -> bool:
    """Whether this turn of the loop runs the whole pass (pure): always its first turn, a generation
    status has not observed, an object not Ready (the pass' retry already set the wait), one still
    Progressing (a change rolling out, a rebalance), ray.mode KubeRay (KubeRay changes the
    RayService's status on its own), a surging expert spec.routing.autoQuarantine has not decided on
    (`containment.pending`). Otherwise the app serves what the spec asks for, and only its
    live report is read (the whole pass still runs when that report cannot be read)."""
    conditions = status.get("conditions") or []
    return (first or status.get("observedGeneration") != meta.get("generation")
            or not cond.is_true(conditions, cond.READY) or cond.is_true(conditions, cond.PROGRESSING)
            or kuberay_mode(spec) or (status.get("autoscaling") or {}).get("target") is not None
            or containment.pending(spec, status))


def turn_body(body: dict, left: tuple[str | None, dict] | None) -> tuple[dict, str | None]:
    """The object a turn starts from (pure; a copy of kopf's live `body`) and the resourceVersion it
    read. `left`: the previous turn's (resourceVersion read, status left). While the watch has not
    brought anything since (the same resourceVersion), that turn's own status write is not in
    `body` yet: the turn starts from the status it left instead."""
    raw = copy.deepcopy(dict(body))
    read = (raw.get("metadata") or {}).get("resourceVersion")
    if left is not None and read == left[0]:
        raw["status"] = copy.deepcopy(left[1])
    return raw, read


class Turn(NamedTuple):
    delay: float  # seconds until the next turn
    status: dict  # the status this turn left (what it wrote, or what it read when it wrote nothing)


def one_pass(name: str, namespace: str, raw: dict, first: bool, memo: kopf.Memo) -> Turn:
    """One turn of the object's loop. Status is written once, as a merge patch of what changed
    (nothing on a steady turn); the Events are posted once, here. Logs go to the operator's log
    only: kopf's per-object logger would post each line as an Event."""
    spec, meta, status = raw.get("spec") or {}, raw.get("metadata") or {}, raw.get("status") or {}
    if meta.get("deletionTimestamp"):
        return Turn(STEADY_S, status)  # the finalizer's handler has it
    LOOP_TURNS.inc()
    rename = None
    if not needs_pass(spec, meta, status, first):
        keys_changed = _keys_changed(spec, namespace, status, memo)
        if not keys_changed:
            try:
                parsed = parse_spec(dict(spec))
            except SpecError:
                return Turn(STEADY_S, status)
            fields, events = observe_live(parsed, status)
            # the app answered (it serves what the spec asks), or nothing serves (render-only: no
            # report to read and nothing to deploy again)
            if fields or memo.settings.ray_backend == RENDER_ONLY:
                after = {**status, **fields}
                write_status(memo, namespace, name, status, after)
                post_events(raw, events)
                return Turn(STEADY_S, after)
            # its report cannot be read: the whole pass looks at what Ray has (the app may be gone:
            # a restarted cluster, someone's delete), and applies it again if so
        else:
            rename = cond.API_KEYS_CHANGED
    started = time.perf_counter()
    res = _reconcile(name, namespace, dict(spec), meta, dict(status), memo)
    write_status(memo, namespace, name, status, res.status)
    RECONCILE_SECONDS.observe(time.perf_counter() - started)
    RECONCILES.labels(result=res.event[1] if res.event else "None").inc()
    events = outcome_events(status, res)
    if rename and res.event:  # the keys apply in place: say why this pass ran
        events = [(res.event[0], rename, "API keys changed; " + res.event[2])] + res.events
    post_events(raw, events)
    if res.ready:
        APPLIED_GENERATION.labels(namespace=namespace, name=name).set(meta.get("generation", 0))
    delay = res.retry_after_s if res.retry_after_s is not None else STEADY_S
    if kuberay_mode(spec):  # KubeRay moves on its own; a pass only reads the RayService unless it changed
        delay = min(delay, STEADY_S)
    if not res.ready or res.retry_after_s is not None:
        log.info("%s/%s %s %s: %s; next pass in %.0f s", namespace, name, "Ready" if res.ready else "not Ready",
                 res.event[1], res.event[2], delay)
    return Turn(delay, res.status)


def _reconcile(name: str, namespace: str, spec_dict: dict, meta, status: dict, memo: kopf.Memo) -> Result:
    obj = ObjectRef(namespace, name, meta.get("generation", 0), meta.get("uid", ""))
    try:
        backend = backend_for(spec_dict, namespace, memo)
    except Unconfigured as err:
        return unconfigured(status, obj.generation, err.reason, str(err), err.retry_s)
    return run_pass(obj, spec_dict, status, backend, memo.settings)


def _keys_changed(spec: dict, namespace: str, status: dict, memo: kopf.Memo) -> bool:
    """Whether the API keys in force differ from those the app was rendered with (the Secret is read
    each steady turn: no Secret watch, so no list/watch on Secrets is needed)."""
    if not ((spec.get("ingress") or {}).get("apiKeySecretRef") or status.get("apiKeys")):
        return False
    try:
        current = keys_fingerprint(api_key_digests(spec, namespace, memo.kube))
    except Unconfigured:
        current = "unreadable"  # the pass says why
    return current != (status.get("apiKeys") or {}).get("fingerprint")
