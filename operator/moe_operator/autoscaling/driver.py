"""The autoscaler's memory between passes (load windows per object) and the one pass both the
kopf timer and standalone mode run (`decide`): read the metrics source when due, smooth, decide.

A window lives in the operator's memory only: after a restart it refills within
`windowSeconds`; the policy's own memory (stabilization, cooldown) is in status.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_operator.api.models import MoEDeploymentSpec
from moe_operator.api.semantics import validate_semantics
from moe_operator.autoscaling.loop import Pass, autoscale
from moe_operator.autoscaling.signals import (
    AppReportSource, LoadWindow, MetricsUnavailable, PrometheusSource, ScrapeSource, co_selection_from_report)


def metrics_source(spec: MoEDeploymentSpec, app: str, endpoint: str | None, local_metrics_urls: list[str] | None = None):
    """Prometheus when configured; else the Ray metrics URLs (the spec's, or the local Ray's in
    standalone mode); else the app's own load report."""
    m = spec.autoscaling.metrics
    if m.source == "Prometheus":
        return PrometheusSource(m.prometheus_url, app)
    urls = list(m.scrape_urls) or list(local_metrics_urls or [])
    if urls:
        return ScrapeSource(urls, app)
    if endpoint:
        return AppReportSource(endpoint.removesuffix("/v1"))
    return None


@dataclass
class _Track:
    window: LoadWindow
    last_read: float = 0.0


@dataclass
class Autoscaler:
    tracks: dict[str, _Track] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def forget(self, key: str) -> None:
        with self.lock:
            self.tracks.pop(key, None)

    def step(self, key: str, spec: MoEDeploymentSpec, status: dict, placement: dict[str, list[str]], source,
             expert_bytes: int, request: str | None = None, now: float | None = None,
             report=None) -> Pass | None:
        """None when a read is not due yet (and nothing was requested). `report()`: the app's own
        report, for the experts the router picks together (the planner keeps them in one group)."""
        now = time.time() if now is None else now
        a = spec.autoscaling
        requested = request is not None and request != (status.get("autoscaling") or {}).get("lastRequest")
        with self.lock:
            track = self.tracks.get(key)
            if track is None or track.window.window_s != a.window_seconds:
                track = self.tracks[key] = _Track(LoadWindow(a.window_seconds))
        if a.mode == "Off" and not requested and not (status.get("autoscaling") or {}).get("target"):
            return None
        if now - track.last_read < a.metrics.scrape_interval_seconds and not requested:
            return None
        if source is None:
            return Pass({**(status.get("autoscaling") or {}), "message": "no metrics source: no endpoint yet"})
        try:
            totals = source.expert_token_totals()
        except MetricsUnavailable as err:
            return Pass({**(status.get("autoscaling") or {}), "message": f"metrics unavailable: {err}"})
        track.last_read = now
        track.window.add(now, totals)
        if len(track.window.snapshots) < 2:
            return Pass({**(status.get("autoscaling") or {}), "message": "measuring load: first read of the window"})
        co = co_selection_from_report(report()) if report is not None else None
        return autoscale(spec, status, placement, dict(track.window.smoothed), now, expert_bytes,
                         int(status.get("replicas") or 0), request, co)


def decide(autoscaler: Autoscaler, key: str, spec: MoEDeploymentSpec, status: dict, request: str | None,
           read_placement: Callable[[], dict[str, list[str]] | None], allowed_roots, app: str,
           metrics_urls: list[str] | None = None, now: float | None = None) -> Pass | None:
    """The autoscale pass of an object with no placement change in progress, as the kopf timer
    and `moectl up` both run it: nothing while autoscaling is Off and no new `moectl rebalance`
    request came; nothing while the spec's files have a problem (the reconcile pass says which);
    the deployed placement (`read_placement()`; nothing while there is none); then `step`."""
    requested = request is not None and request != (status.get("autoscaling") or {}).get("lastRequest")
    if spec.autoscaling.mode == "Off" and not requested:
        return None
    facts, problems, _ = validate_semantics(spec, list(allowed_roots))
    if problems:
        return None
    placement = read_placement()
    if not placement:
        return None
    source = metrics_source(spec, app, status.get("endpoint"), metrics_urls)
    return autoscaler.step(key, spec, status, placement, source, facts.expert_bytes(spec.model.dtype), request, now,
                           report=report_reader(status.get("endpoint")))


def report_reader(endpoint: str | None):
    """A callable reading the app's report at status.endpoint (None when there is none yet)."""
    if not endpoint:
        return None
    from moe_operator.observe import fetch_app_status

    return lambda: fetch_app_status(endpoint.removesuffix("/v1"))
