"""kopf wiring: one level-triggered loop per MoEDeployment over moe_operator.reconcile.

    kopf run -m moe_operator.handlers.operator --namespace NS [--standalone]

Each object has one loop (`reconcile_loop`, a kopf daemon): it runs the pass
(`reconcile.run_pass`, over the object's `Backend`), writes status once if it changed, posts the
pass' Events, and sleeps for the pass' retry or STEADY_S. Nothing else reconciles: the daemon starts on
create and resume, and its first pass covers them; a spec update only wakes the loop, as does the
autoscaler when it sets a target; deletion asks the
backend until the application is gone (the finalizer). Nothing waits for Ray anywhere.

What the handlers share lives in kopf's operator memo, built once at startup: the settings
(moe_operator.settings, from the environment the Helm chart sets), the autoscaler, which
remembers each object's load window between timer passes, the loops' wake-ups, and the API
clients (Ray's per cluster, Kubernetes' once, on first use).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from typing import Any

import kopf

from moe_operator.api import models
from moe_operator.backends.kuberay import KubeRayClient, KubeRayError
from moe_operator.backends.kuberay_backend import KubeRayBackend
from moe_operator.backends.ray_rest import RayClients, RayServeError
from moe_operator.backends.render_only import RenderOnlyClient
from moe_operator.backends.serve_backend import Backend, BackendError, ServeBackend
from moe_operator.metrics import RECONCILES, RECONCILE_SECONDS, APPLIED_GENERATION, start_metrics_server
from moe_operator.api import conditions as cond
from moe_operator.api.validation import SpecError, parse_spec
from moe_operator.autoscaling.driver import Autoscaler, decide
from moe_operator.merge_patch import merge_patch
from moe_operator.settings import RENDER_ONLY, Settings, SettingsError
from moe_operator.reconcile import (
    ObjectRef, deployed_placement, keys_fingerprint, never_deployed, observe_live, outcome_events,
    placement_from_rayservice, rest_backend, run_pass, unconfigured)
from moe_operator.names import FINALIZER, REBALANCE_ANNOTATION, app_name
from moe_workers.serve.auth import digests

RESOURCE = (models.GROUP, models.VERSION, models.PLURAL)
PREFIX = models.GROUP
DIFFBASE_KEY = "last-handled-configuration"  # kopf's record of the last spec it handled (an annotation)
STEADY_S = 5.0  # a serving object's loop reads its live report this often
ERROR_RETRY_S = 10.0  # a turn that raised (the apiserver or a backend down) runs again after this
STOP_POLL_S = 1.0  # a sleeping loop notices kopf stopping it this soon
log = logging.getLogger(__name__)
REMOVAL_RETRY_S = 2  # a deletion looks again this soon whether the application is gone
EVENT_MESSAGE_LIMIT = 1000  # characters of an Event's message (the apiserver keeps 1 KiB of it)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's settings, and the operator memo: our settings (a bad value stops the operator with
    the variable's name), the autoscaler, and the Ray clients (one write lock per cluster)."""
    try:
        memo.settings = Settings.from_env(os.environ)
    except SettingsError as err:  # not retried: the operator exits, saying which variable
        raise kopf.PermanentError(str(err)) from err
    memo.autoscaler = Autoscaler()
    memo.ray_clients = RayClients()
    memo.kube = KubeApis()
    import kubernetes

    try:  # every loop writes status through it: import and configure it once, at start
        memo.kube.load()
    except kubernetes.config.ConfigException as err:  # no configuration yet: loaded on first use instead
        log.warning("Kubernetes clients not loaded at start (%s); loaded on first use", err)
    memo.render_only = RenderOnlyClient(memo.settings.render_only_dir)
    memo.wakers = Wakers()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key=DIFFBASE_KEY)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 120
    # serve the namespaces given on the command line and the CRDs present at start: watching all
    # CRDs and namespaces would need cluster-wide RBAC the operator should not have
    settings.scanning.disabled = True
    if memo.settings.metrics_port is not None:
        start_metrics_server(memo.settings.metrics_port, memo.settings.metrics_host)


class KubeApis:
    """The Kubernetes API clients the handlers use beside kopf's own (status, Secrets, RayServices):
    the configuration loaded and each client built once, at the operator's start (`load`: every
    loop writes status; importing `kubernetes` alone is ~0.4 CPU s), or on first use if that failed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._core = self._kuberay = self._custom = None

    def load(self) -> None:
        """Load the configuration and build the clients now (the operator's start), not on first use."""
        with self._lock:
            if self._custom is None:
                self._load()

    def _load(self) -> None:
        import kubernetes

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:  # outside a cluster: $KUBECONFIG as it is now
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        self._core = kubernetes.client.CoreV1Api()
        self._custom = kubernetes.client.CustomObjectsApi()
        self._kuberay = KubeRayClient(self._custom)

    @property
    def core(self):
        with self._lock:
            if self._core is None:
                self._load()
            return self._core

    @property
    def kuberay(self) -> KubeRayClient:
        with self._lock:
            if self._kuberay is None:
                self._load()
            return self._kuberay

    def patch_status(self, namespace: str, name: str, change: dict) -> None:
        """Merge-patch a MoEDeployment's status subresource."""
        self.load()
        self._custom.patch_namespaced_custom_object_status(
            models.GROUP, models.VERSION, namespace, models.PLURAL, name, {"status": change}, _request_timeout=30)


class Wakers:
    """Per object, the asyncio.Event its loop sleeps on between passes. Handlers set it from the
    operator's event loop or from a worker thread (a sync handler)."""

    def __init__(self):
        self._events: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

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


def _post(body, events) -> None:
    """Each (type, reason, message) as an Event on the object."""
    for event_type, reason, message in events:
        kopf.event(body, type=event_type, reason=reason, message=message[:EVENT_MESSAGE_LIMIT])


class Unconfigured(Exception):
    """What the pass needs from outside the spec is missing or unreadable (a Secret, the Ray
    address): the object shows Ready=False with `reason` and the message, never an exception out
    of a handler."""

    def __init__(self, reason: str, message: str, retry_s: float | None = 10):
        super().__init__(message)
        self.reason, self.retry_s = reason, retry_s


def _secret_value(ref: dict, namespace: str, field: str, kube: KubeApis) -> str:
    import base64

    import kubernetes

    where = f"{field}: Secret {namespace}/{ref['name']}"
    try:
        secret = kube.core.read_namespaced_secret(ref["name"], namespace, _request_timeout=30)
    except kubernetes.client.ApiException as err:
        why = {404: "not found", 403: "not readable by the operator (Helm value readTokenSecrets)"}
        raise Unconfigured(cond.SECRET_UNAVAILABLE, f"{where} {why.get(err.status, f'unreadable: {err.status} {err.reason}')}")
    except (OSError, kubernetes.client.exceptions.OpenApiException) as err:
        raise Unconfigured(cond.SECRET_UNAVAILABLE, f"{where} unreadable: {err}")
    key = ref.get("key", "token")
    value = (secret.data or {}).get(key)
    if value is None:
        raise Unconfigured(cond.SECRET_UNAVAILABLE, f"{where} has no key {key}")
    return base64.b64decode(value).decode()


def _api_key_digests(spec: dict, namespace: str, kube: KubeApis) -> list[str] | None:
    ref = ((spec.get("ingress") or {}).get("apiKeySecretRef")) or None
    if not ref:
        return None
    keys = digests(_secret_value(ref, namespace, "spec.ingress.apiKeySecretRef", kube))
    if not keys:
        raise Unconfigured(cond.SECRET_UNAVAILABLE, f"spec.ingress.apiKeySecretRef: Secret {namespace}/{ref['name']} "
                           "holds no key")
    return keys


def _token(spec: dict, namespace: str, memo: kopf.Memo) -> str | None:
    settings: Settings = memo.settings
    ref = ((spec.get("ray") or {}).get("authTokenSecretRef")) or None
    if ref:
        return _secret_value(ref, namespace, "spec.ray.authTokenSecretRef", memo.kube).strip()
    if settings.ray_token_file:  # read each pass: a mounted Secret changes in place
        try:
            return open(settings.ray_token_file).read().strip()
        except OSError as err:
            raise Unconfigured(cond.SECRET_UNAVAILABLE, f"MOE_RAY_TOKEN_FILE {settings.ray_token_file}: {err}")
    return settings.ray_token or None


def _client(spec: dict, namespace: str, memo: kopf.Memo) -> ServeBackend:
    settings: Settings = memo.settings
    if settings.ray_backend == RENDER_ONLY:
        return memo.render_only
    address = (spec.get("ray") or {}).get("address") or settings.ray_address
    if not address:
        raise Unconfigured(cond.RAY_NOT_CONFIGURED, "no Ray address: set spec.ray.address, or the operator's "
                           "MOE_RAY_ADDRESS (Helm value ray.address)", retry_s=None)
    return memo.ray_clients.get(address, _token(spec, namespace, memo))


def _served_client(spec: dict, namespace: str, status: dict, memo: kopf.Memo) -> ServeBackend:
    """A client of the cluster the application was deployed to (status.rayAddress), which a spec
    edited since may no longer name (the pass refuses to move it)."""
    address = status.get("rayAddress")
    if not address or memo.settings.ray_backend == RENDER_ONLY:
        return _client(spec, namespace, memo)
    return memo.ray_clients.get(address, _token(spec, namespace, memo))


def _backend(spec: dict, namespace: str, memo: kopf.Memo, status: dict | None = None) -> Backend:
    """The backend this object's pass runs over: its RayService (ray.mode KubeRay), else its Ray
    cluster's Serve REST API with the API keys in force. `status`: for a deletion, the cluster the
    application was deployed to (a KubeRay object's RayService), whatever the spec names now."""
    served = status or {}
    if served.get("rayService") or (_kuberay_mode(spec) and not served.get("rayAddress")):
        return KubeRayBackend(memo.kube.kuberay)
    if status is not None:
        return rest_backend(_served_client(spec, namespace, served, memo), memo.settings)
    return rest_backend(_client(spec, namespace, memo), memo.settings,
                        api_key_digests=_api_key_digests(spec, namespace, memo.kube))


def _reconcile(name: str, namespace: str, spec_dict: dict, meta, status: dict, memo: kopf.Memo):
    obj = ObjectRef(namespace, name, meta.get("generation", 0), meta.get("uid", ""))
    try:
        backend = _backend(spec_dict, namespace, memo)
    except Unconfigured as err:
        return unconfigured(status, obj.generation, err.reason, str(err), err.retry_s)
    return run_pass(obj, spec_dict, status, backend, memo.settings)


@kopf.on.update(*RESOURCE, field="spec")
async def wake_handler(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A new spec: its loop runs a pass now (the loop, not this handler, reconciles). Not on create
    or resume: the daemon starts then and its first pass covers them, while a wake that lands
    during that first pass would run a second whole pass from the object as the first one read it
    (its own status write not yet seen). Without create handlers kopf still stores the diff base."""
    memo.wakers.wake(f"{namespace}/{name}")


@kopf.daemon(*RESOURCE, cancellation_backoff=10.0, cancellation_timeout=10.0)
async def reconcile_loop(name: str, namespace: str, body, stopped, memo: kopf.Memo, logger, **_: Any) -> None:
    """The object's one loop: a pass (in a worker thread: it does blocking I/O), then sleep for the
    pass' retry or the steady interval, or until a handler wakes it. Level-triggered: every pass
    starts from the object as it is now (kopf keeps `body` current), so a lost wake-up, a dropped
    retry or a restarted operator all end in the same state."""
    key = f"{namespace}/{name}"
    wake = memo.wakers.event(key)
    first = True
    while not stopped:
        wake.clear()
        try:
            delay = await asyncio.to_thread(one_pass, name, namespace, copy.deepcopy(dict(body)), first, memo, logger)
            first = False
        except Exception as err:  # an apiserver or backend outage: logged, looked at again soon
            logger.warning("reconcile pass of %s failed: %s; again in %s s", key, err, ERROR_RETRY_S)
            delay = ERROR_RETRY_S
        deadline = time.monotonic() + delay
        while not stopped and not wake.is_set() and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(wake.wait(), timeout=min(left, STOP_POLL_S))
            except asyncio.TimeoutError:
                pass
    memo.wakers.forget(key)


def needs_pass(spec: dict, meta: dict, status: dict, first: bool) -> bool:
    """Whether this turn of the loop runs the whole pass (pure): always its first turn, a generation
    status has not observed, an object not Ready (the pass' retry already set the wait), one still
    Progressing (a change rolling out, a rebalance), ray.mode KubeRay (KubeRay changes the
    RayService's status on its own). Otherwise the app serves what the spec asks for, and only its
    live report is read."""
    conditions = status.get("conditions") or []
    return (first or status.get("observedGeneration") != meta.get("generation")
            or not cond.is_true(conditions, cond.READY) or cond.is_true(conditions, cond.PROGRESSING)
            or _kuberay_mode(spec) or (status.get("autoscaling") or {}).get("target") is not None)


def one_pass(name: str, namespace: str, raw: dict, first: bool, memo: kopf.Memo, logger=log) -> float:
    """One turn of the object's loop; the seconds until the next. Status is written once, as a merge
    patch of what changed (nothing on a steady turn); the Events are posted once, here."""
    spec, meta, status = raw.get("spec") or {}, raw.get("metadata") or {}, raw.get("status") or {}
    if meta.get("deletionTimestamp"):
        return STEADY_S  # the finalizer's handler has it
    rename = None
    if not needs_pass(spec, meta, status, first):
        keys_changed = _keys_changed(spec, namespace, status, memo)
        if not keys_changed:
            try:
                parsed = parse_spec(dict(spec))
            except SpecError:
                return STEADY_S
            fields, events = observe_live(parsed, status)
            _write_status(memo, namespace, name, status, {**status, **fields})
            _post(raw, events)
            return STEADY_S
        rename = cond.API_KEYS_CHANGED
    started = time.perf_counter()
    res = _reconcile(name, namespace, dict(spec), meta, dict(status), memo)
    _write_status(memo, namespace, name, status, res.status)
    RECONCILE_SECONDS.observe(time.perf_counter() - started)
    RECONCILES.labels(result=res.event[1] if res.event else "None").inc()
    events = outcome_events(status, res)
    if rename and res.event:  # the keys apply in place: say why this pass ran
        events = [(res.event[0], rename, "API keys changed; " + res.event[2])] + res.events
    _post(raw, events)
    if res.ready:
        APPLIED_GENERATION.labels(namespace=namespace, name=name).set(meta.get("generation", 0))
    delay = res.retry_after_s if res.retry_after_s is not None else STEADY_S
    if _kuberay_mode(spec):  # KubeRay moves on its own; a pass only reads the RayService unless it changed
        delay = min(delay, STEADY_S)
    if not res.ready or res.retry_after_s is not None:
        logger.info("%s %s: %s; next pass in %.0f s", "Ready" if res.ready else "not Ready", res.event[1],
                    res.event[2], delay)
    return delay


def _keys_changed(spec: dict, namespace: str, status: dict, memo: kopf.Memo) -> bool:
    """Whether the API keys in force differ from those the app was rendered with (the Secret is read
    each steady turn: no Secret watch, so no list/watch on Secrets is needed)."""
    if not ((spec.get("ingress") or {}).get("apiKeySecretRef") or status.get("apiKeys")):
        return False
    try:
        current = keys_fingerprint(_api_key_digests(spec, namespace, memo.kube))
    except Unconfigured:
        current = "unreadable"  # the pass says why
    return current != (status.get("apiKeys") or {}).get("fingerprint")


def _write_status(memo: kopf.Memo, namespace: str, name: str, before: dict, after: dict) -> None:
    """The one status write: a merge patch of what changed, none when nothing did."""
    change = merge_patch(before, after)
    if change:
        memo.kube.patch_status(namespace, name, change)


def _kuberay_mode(spec: dict) -> bool:
    return (spec.get("ray") or {}).get("mode") == "KubeRay"


@kopf.on.delete(*RESOURCE)
def delete_handler(name: str, namespace: str, spec, meta, status, logger, memo: kopf.Memo, **_: Any) -> None:
    """Ask the backend to remove the application; the finalizer stays (the handler is retried)
    until nothing of ours is left there. Nothing waits here."""
    memo.autoscaler.forget(f"{namespace}/{name}")
    if never_deployed(dict(status or {})):
        logger.info("nothing was deployed for %s/%s (never Ready); nothing to remove from Ray", namespace, name)
        return
    try:
        backend = _backend(dict(spec), namespace, memo, dict(status or {}))
        gone = backend.delete(ObjectRef(namespace, name, meta.get("generation", 0), meta["uid"]))
    except (BackendError, Unconfigured) as err:  # keep the finalizer until the app is confirmed gone
        raise kopf.TemporaryError(str(err), delay=10)
    what = f"RayService {namespace}/{name}" if backend.mode == "KubeRay" else f"Serve application {app_name(namespace, name)}"
    if not gone:
        raise kopf.TemporaryError(f"removal of {what} under way", delay=REMOVAL_RETRY_S)
    logger.info("%s removed", what)


@kopf.timer(*RESOURCE, interval=2.0, initial_delay=5.0)
def autoscale_handler(name: str, namespace: str, spec, status, meta, patch, body, logger, memo: kopf.Memo,
                      **_: Any) -> None:
    """When load is due to be read (spec.autoscaling.metrics.scrapeIntervalSeconds) or `moectl
    rebalance` asked, read it, decide, and write the decision (status, Event;
    spec.experts.replicasPerGroup on scaling); a target wakes the object's loop, which applies it
    make-before-break."""
    status = dict(status or {})
    if status.get("observedGeneration") != meta.get("generation"):
        return  # the object's loop has not applied this generation yet
    if not cond.is_true(status.get("conditions") or [], cond.READY):
        return
    spec_dict = dict(spec)
    try:
        parsed = parse_spec(spec_dict)
    except SpecError:
        return
    if (status.get("autoscaling") or {}).get("target") is not None:
        return  # the object's loop drives the change, step by step
    request = (meta.get("annotations") or {}).get(REBALANCE_ANNOTATION)

    def read_placement() -> dict[str, list[str]] | None:
        try:
            if _kuberay_mode(spec_dict):
                return placement_from_rayservice(memo.kube.kuberay.get(namespace, name))
            return deployed_placement(_client(spec_dict, namespace, memo).get(), app_name(namespace, name))
        except (RayServeError, KubeRayError, OSError, Unconfigured) as err:
            logger.info("autoscaler: cannot read the deployed placement: %s", err)
            return None

    p = decide(memo.autoscaler, f"{namespace}/{name}", parsed, status, request, read_placement,
               memo.settings.allowed_roots, app_name(namespace, name))
    if p is None:
        return
    _write_status(memo, namespace, name, status, {**status, **p.status, "autoscaling": p.autoscaling})
    if p.replicas_per_group is not None:
        patch.spec["experts"] = {"replicasPerGroup": p.replicas_per_group}  # a new spec: it wakes the loop
    if p.event:
        _post(body, [p.event])
    if (p.autoscaling or {}).get("target") is not None:
        memo.wakers.wake(f"{namespace}/{name}")  # a new target: the loop starts moving to it
