"""kopf wiring: one level-triggered loop per MoEDeployment, and nothing else.

    kopf run -m moe_operator.handlers.operator --namespace NS [--standalone]

Each object has one loop (`reconcile_loop`, a kopf daemon) that turns `object_loop.one_pass`: the
pass (`reconcile.run_pass`, over the object's `Backend`), status written once if it changed, the
pass' Events, then a sleep for the pass' retry or `object_loop.STEADY_S`. Nothing else reconciles:
the daemon starts on create and resume, and its first pass covers them; a spec update only wakes the
loop, as does the autoscaler when it sets a target; deletion asks the backend until the application
is gone (the finalizer). Nothing waits for Ray anywhere.

What the handlers share lives in kopf's operator memo, built once at startup: the settings
(moe_operator.settings, from the environment the Helm chart sets), the autoscaler, which
remembers each object's load window between timer passes, the loops' wake-ups, and the API
clients (`clients.py`: Ray's per cluster, Kubernetes' once, at start).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from moe_operator.api import conditions as cond
from moe_operator.api import models
from moe_operator.api.validation import SpecError, parse_spec
from moe_operator.autoscaling.driver import Autoscaler, decide
from moe_operator.backends.kuberay import KubeRayError
from moe_operator.backends.ray_rest import RayClients, RayServeError
from moe_operator.backends.render_only import RenderOnlyClient
from moe_operator.backends.serve_backend import BackendError
from moe_operator.clients import KubeApis, Unconfigured, backend_for, kuberay_mode, serve_client
from moe_operator.metrics import start_metrics_server
from moe_operator.names import FINALIZER, REBALANCE_ANNOTATION, app_name
from moe_operator.object_loop import Wakers, one_pass, post_events, turn_body, write_status
from moe_operator.reconcile import ObjectRef, deployed_placement, never_deployed, placement_from_rayservice
from moe_operator.settings import Settings, SettingsError

RESOURCE = (models.GROUP, models.VERSION, models.PLURAL)
PREFIX = models.GROUP
DIFFBASE_KEY = "last-handled-configuration"  # kopf's record of the last spec it handled (an annotation)
ERROR_RETRY_S = 10.0  # a turn that raised (the apiserver or a backend down) runs again after this
REMOVAL_RETRY_S = 2  # a deletion looks again this soon whether the application is gone
log = logging.getLogger(__name__)


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



@kopf.on.update(*RESOURCE, field="spec")
async def wake_handler(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A new spec: its loop runs a pass now (the loop, not this handler, reconciles). Not on create
    or resume: the daemon starts then and its first pass covers them, while a wake that lands
    during that first pass would run a second whole pass from the object as the first one read it
    (its own status write not yet seen). Without create handlers kopf still stores the diff base."""
    memo.wakers.wake(f"{namespace}/{name}")


@kopf.daemon(*RESOURCE, cancellation_backoff=10.0, cancellation_timeout=10.0)
async def reconcile_loop(name: str, namespace: str, body, stopped, memo: kopf.Memo, **_: Any) -> None:
    """The object's one loop: a pass (in a worker thread: it does blocking I/O; under the object's
    lock, which the finalizer's handler takes too), then sleep for the pass' retry or the steady
    interval, or until a handler wakes it. Level-triggered: every pass starts from the object as it
    is now (kopf keeps `body` current), so a lost wake-up, a dropped retry or a restarted operator
    all end in the same state; except that a turn woken before the watch brought the previous
    turn's own status write starts from that status (else a rebalance's switch time, say, would
    be read as unset)."""
    key = f"{namespace}/{name}"
    wake = memo.wakers.event(key)
    first = True
    left: tuple[str | None, dict] | None = None  # (the resourceVersion the last turn read, the status it left)
    try:
        while not stopped:
            wake.clear()
            raw, read = turn_body(body, left)
            try:
                turn = await asyncio.to_thread(memo.wakers.locked, key, one_pass, name, namespace, raw, first, memo)
                first, delay, left = False, turn.delay, (read, turn.status)
            except Exception as err:  # an apiserver or backend outage: logged, looked at again soon
                log.warning("reconcile pass of %s failed: %s; again in %s s", key, err, ERROR_RETRY_S)
                delay, left = ERROR_RETRY_S, None
            if not stopped:
                await _sleep(wake, stopped, delay)
    finally:
        memo.wakers.forget(key)


async def _sleep(wake: asyncio.Event, stopped, delay: float) -> None:
    """Until `delay` passes, a handler wakes the loop, or kopf stops it (nothing polls)."""
    waits = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait(delay))]
    try:
        await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)  # nothing of the sleep outlives it



@kopf.on.delete(*RESOURCE)
def delete_handler(name: str, namespace: str, spec, meta, status, logger, memo: kopf.Memo, **_: Any) -> None:
    """Ask the backend to remove the application; the finalizer stays (the handler is retried)
    until nothing of ours is left there. Nothing waits here."""
    memo.autoscaler.forget(f"{namespace}/{name}")
    with memo.wakers.lock(f"{namespace}/{name}"):  # a pass under way ends first (it might apply the app)
        _remove(name, namespace, spec, meta, status, logger, memo)


def _remove(name: str, namespace: str, spec, meta, status, logger, memo: kopf.Memo) -> None:
    if never_deployed(dict(status or {})):
        logger.info("nothing was deployed for %s/%s (never Ready); nothing to remove from Ray", namespace, name)
        return
    try:
        backend = backend_for(dict(spec), namespace, memo, dict(status or {}))
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
            if kuberay_mode(spec_dict):
                return placement_from_rayservice(memo.kube.kuberay.get(namespace, name))
            return deployed_placement(serve_client(spec_dict, namespace, memo).get(), app_name(namespace, name))
        except (RayServeError, KubeRayError, OSError, Unconfigured) as err:
            log.info("autoscaler: cannot read the deployed placement of %s/%s: %s", namespace, name, err)
            return None

    p = decide(memo.autoscaler, f"{namespace}/{name}", parsed, status, request, read_placement,
               memo.settings.allowed_roots, app_name(namespace, name))
    if p is None:
        return
    write_status(memo, namespace, name, status, {**status, **p.status, "autoscaling": p.autoscaling})
    if p.replicas_per_group is not None:
        patch.spec["experts"] = {"replicasPerGroup": p.replicas_per_group}  # a new spec: it wakes the loop
    if p.event:
        post_events(body, [p.event])
    if (p.autoscaling or {}).get("target") is not None:
        memo.wakers.wake(f"{namespace}/{name}")  # a new target: the loop starts moving to it
