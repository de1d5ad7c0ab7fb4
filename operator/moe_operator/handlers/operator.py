"""kopf handlers: thin wrappers over moe_operator.reconcile.

    kopf run -m moe_operator.handlers.operator --namespace NS [--standalone]

What the handlers share lives in kopf's operator memo, built once at startup: the settings
(moe_operator.settings, from the environment the Helm chart sets), the autoscaler, which
remembers each object's load window between timer passes, and the API clients (Ray's per cluster,
Kubernetes' once, on first use), which the 2 s and 5 s timers would otherwise rebuild every call.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import datetime
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
    ObjectRef, deployed_placement, keys_fingerprint, never_deployed, observe_live, placement_from_rayservice,
    rest_backend, run_pass, unconfigured)
from moe_operator.names import FINALIZER, REBALANCE_ANNOTATION, app_name
from moe_workers.serve.auth import digests

RESOURCE = (models.GROUP, models.VERSION, models.PLURAL)
PREFIX = models.GROUP
DIFFBASE_KEY = "last-handled-configuration"  # kopf's record of the last spec it handled (an annotation)
ORPHAN_GRACE_S = 30.0  # a retry kopf has not run this long after its time was dropped
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
    memo.render_only = RenderOnlyClient(memo.settings.render_only_dir)
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
    """The Kubernetes API clients the handlers use beside kopf's own (Secrets, RayServices):
    the configuration loaded and each client built once, on first use (an operator that never
    reads a Secret or a RayService never loads it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._core = self._kuberay = None

    def _load(self) -> None:
        import kubernetes

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:  # outside a cluster: $KUBECONFIG as it is now
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        self._core = kubernetes.client.CoreV1Api()
        self._kuberay = KubeRayClient(kubernetes.client.CustomObjectsApi())

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


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def reconcile_handler(name: str, namespace: str, spec, meta, status, patch, body, memo: kopf.Memo, **_: Any) -> None:
    started = time.perf_counter()
    before = dict(status or {})
    res = _reconcile(name, namespace, dict(spec), meta, dict(before), memo)
    patch.status.update(merge_patch(before, res.status))
    RECONCILE_SECONDS.observe(time.perf_counter() - started)
    RECONCILES.labels(result=res.event[1] if res.event else "None").inc()
    _post(body, ([res.event] if res.event else []) + res.events)
    if res.ready:
        APPLIED_GENERATION.labels(namespace=namespace, name=name).set(meta.get("generation", 0))
    elif res.retry_after_s is not None:
        raise kopf.TemporaryError(res.event[2], delay=res.retry_after_s)
    # a rebalance in progress is driven on by the autoscale timer


def _kuberay_mode(spec: dict) -> bool:
    return (spec.get("ray") or {}).get("mode") == "KubeRay"


@kopf.on.delete(*RESOURCE)
def delete_handler(name: str, namespace: str, spec, meta, status, logger, memo: kopf.Memo, **_: Any) -> None:
    memo.autoscaler.forget(f"{namespace}/{name}")
    if never_deployed(dict(status or {})):
        logger.info("nothing was deployed for %s/%s (never Ready); nothing to remove from Ray", namespace, name)
        return
    try:
        backend = _backend(dict(spec), namespace, memo, dict(status or {}))
        removed = backend.delete(ObjectRef(namespace, name, meta.get("generation", 0), meta["uid"]))
    except (BackendError, Unconfigured) as err:  # keep the finalizer until the app is confirmed gone
        raise kopf.TemporaryError(str(err), delay=10)
    what = f"RayService {namespace}/{name}" if backend.mode == "KubeRay" else f"Serve application {app_name(namespace, name)}"
    logger.info("removed %s" if removed else "no %s of ours to remove", what)


def orphaned_generation(meta: dict, spec: dict, now: float | None = None) -> bool:
    """Whether nobody will apply the object's current generation (status has not observed it):
    kopf's last handled spec equals it, so kopf sees no change to handle, and no reconcile retry is
    due (none recorded, or one whose time passed ORPHAN_GRACE_S ago without kopf running it). That
    happens when an edit fails temporarily (retried after a delay) and a second edit reverts it
    before the retry: kopf drops the retry, as the spec is back to what it handled, and leaves its
    record behind."""
    annotations = meta.get("annotations") or {}
    try:
        handled = json.loads(annotations.get(f"{PREFIX}/{DIFFBASE_KEY}") or "null")
    except ValueError:
        return False
    if not isinstance(handled, dict) or handled.get("spec") != spec:
        return False  # a change kopf is handling (or has not seen yet)
    now = time.time() if now is None else now
    for key, value in annotations.items():
        if not key.startswith(f"{PREFIX}/reconcile_handler"):
            continue
        try:
            delayed = datetime.fromisoformat(json.loads(value)["delayed"]).timestamp()
        except (ValueError, KeyError, TypeError):
            return False  # a handler running, or a record we cannot read: kopf's
        if delayed > now - ORPHAN_GRACE_S:
            return False  # its retry is still to come
    return True


@kopf.timer(*RESOURCE, interval=5.0, initial_delay=5.0)
def observe_handler(name: str, namespace: str, spec, status, meta, patch, body, memo: kopf.Memo, **_: Any) -> None:
    """Between reconciles: read the live app's report and update tiers, overridden experts and
    hot-swap outcomes (written only when they changed; events on each outcome). A changed API-key
    Secret runs the reconcile pass again (the keys apply in place). With ray.mode KubeRay the pass
    runs every time: it maps the RayService's status, which KubeRay changes on its own."""
    status = dict(status or {})
    spec_dict = dict(spec)
    if status.get("observedGeneration") != meta.get("generation"):
        if not orphaned_generation(meta, spec_dict):
            return  # the reconcile handler owns this generation until it has applied it
        res = _reconcile(name, namespace, spec_dict, meta, status, memo)
        patch.status.update(merge_patch(status, res.status))
        _post(body, ([res.event] if res.event else []) + res.events)
        return
    if _kuberay_mode(spec_dict) and (status.get("autoscaling") or {}).get("target") is None:
        # (a rebalance in progress is the autoscale timer's: it runs the same pass)
        # the application's state lives in the RayService's status, which KubeRay changes on its
        # own (an app turning UNHEALTHY, an upgrade): map it again; a steady pass writes nothing
        res = _reconcile(name, namespace, spec_dict, meta, status, memo)
        before, after = (cond.get_condition(c.get("conditions") or [], cond.READY) or {} for c in (status, res.status))
        patch.status.update(merge_patch(status, res.status))
        flipped = (before.get("status"), before.get("reason")) != (after.get("status"), after.get("reason"))
        _post(body, ([res.event] if res.event and flipped else []) + res.events)
        return
    if not cond.is_true(status.get("conditions") or [], cond.READY):
        return
    if (spec_dict.get("ingress") or {}).get("apiKeySecretRef") or status.get("apiKeys"):
        try:
            current = keys_fingerprint(_api_key_digests(spec_dict, namespace, memo.kube))
        except Unconfigured:
            current = "unreadable"  # the pass says why
        if current != (status.get("apiKeys") or {}).get("fingerprint"):
            res = _reconcile(name, namespace, spec_dict, meta, status, memo)
            patch.status.update(merge_patch(status, res.status))
            if res.event:
                _post(body, [(res.event[0], "ApiKeysChanged", "API keys changed; " + res.event[2])])
            return
    try:
        parsed = parse_spec(dict(spec))
    except SpecError:
        return
    fields, events = observe_live(parsed, status)
    for key, value in fields.items():
        if status.get(key) != value:
            patch.status[key] = value
    _post(body, events)


@kopf.timer(*RESOURCE, interval=2.0, initial_delay=5.0)
def autoscale_handler(name: str, namespace: str, spec, status, meta, patch, body, logger, memo: kopf.Memo,
                      **_: Any) -> None:
    """Drive a placement change in progress one make-before-break step; otherwise, when load is due
    to be read (spec.autoscaling.metrics.scrapeIntervalSeconds) or `moectl rebalance` asked, read
    it, decide, and write the decision (status, Event; spec.experts.replicasPerGroup on scaling)."""
    status = dict(status or {})
    if status.get("observedGeneration") != meta.get("generation"):
        return  # the reconcile handler owns this generation until it has applied it
    if not cond.is_true(status.get("conditions") or [], cond.READY):
        return
    spec_dict = dict(spec)
    try:
        parsed = parse_spec(spec_dict)
    except SpecError:
        return
    if (status.get("autoscaling") or {}).get("target") is not None:
        res = _reconcile(name, namespace, spec_dict, meta, dict(status), memo)
        patch.status.update(merge_patch(status, res.status))
        _post(body, res.events)
        return
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
    after = {**status, **p.status, "autoscaling": p.autoscaling}
    patch.status.update(merge_patch(status, after))
    if p.replicas_per_group is not None:
        patch.spec["experts"] = {"replicasPerGroup": p.replicas_per_group}
    if p.event:
        _post(body, [p.event])
