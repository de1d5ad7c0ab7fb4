"""Per-expert load from the workers' metrics, and the signals derived from it.

Sources (one interface: `expert_token_totals()` -> {(group, "L.E"): tokens so far}):
- ScrapeSource: reads Ray's Prometheus export on each node directly (the embedded default);
- PrometheusSource: asks a Prometheus server's HTTP API (PromQL) that scrapes them.
Derived (pure): per-expert rates over a window, smoothed (EWMA); per-group load; imbalance
(max / mean group load) and coefficient of variation.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from moe_workers.expert_ids import layer_of

EXPERT_TOKENS = "ray_moe_expert_tokens"  # the shards' counter, as Ray exports it (ray_ prefix)

Totals = dict[tuple[str, str], float]  # (group, "L.E") -> tokens since the replicas started


class MetricsUnavailable(RuntimeError):
    pass


def totals_from_exposition(text: str, app: str | None = None) -> Totals:
    """Sum the expert-token counter over replicas, per group and expert (Prometheus text format),
    for one Serve application when `app` is given (a Ray cluster may serve several)."""
    out: Totals = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (EXPERT_TOKENS, EXPERT_TOKENS + "_total"):
            continue
        for s in family.samples:
            if s.name.endswith("_created") or (app is not None and s.labels.get("app") != app):
                continue
            key = (s.labels.get("group", ""), f"{s.labels.get('layer')}.{s.labels.get('expert')}")
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


@dataclass
class ScrapeSource:
    """Ray's metrics export of every node (http://node:metrics-export-port/metrics)."""

    urls: list[str]
    app: str | None = None
    timeout_s: float = 5.0

    def expert_token_totals(self) -> Totals:
        out: Totals = {}
        for url in self.urls:
            try:
                with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                    text = resp.read().decode()
            except OSError as err:
                raise MetricsUnavailable(f"{url}: {err}") from None
            for k, v in totals_from_exposition(text, self.app).items():
                out[k] = out.get(k, 0.0) + v
        return out


@dataclass
class PrometheusSource:
    """A Prometheus server that scrapes the Ray nodes: instant query of the counter's sum."""

    url: str
    app: str | None = None
    timeout_s: float = 5.0

    def expert_token_totals(self) -> Totals:
        sel = f'{{app="{self.app}"}}' if self.app else ""
        query = f"sum by (group, layer, expert) ({EXPERT_TOKENS}_total{sel} or {EXPERT_TOKENS}{sel})"
        target = self.url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
        try:
            with urllib.request.urlopen(target, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError) as err:
            raise MetricsUnavailable(f"{self.url}: {err}") from None
        if body.get("status") != "success":
            raise MetricsUnavailable(f"{self.url}: {body.get('error', 'query failed')}")
        out: Totals = {}
        for r in body["data"]["result"]:
            m = r["metric"]
            out[(m.get("group", ""), f"{m.get('layer')}.{m.get('expert')}")] = float(r["value"][1])
        return out


@dataclass
class LoadWindow:
    """Snapshots of the totals over a time window -> smoothed per-expert rates (pure)."""

    window_s: float
    smoothing: float = 0.5  # EWMA weight of the newest window rate
    snapshots: deque = field(default_factory=deque)
    smoothed: dict[tuple[str, str], float] = field(default_factory=dict)

    def add(self, now: float, totals: Totals) -> None:
        self.snapshots.append((now, dict(totals)))
        while len(self.snapshots) > 2 and now - self.snapshots[1][0] >= self.window_s:
            self.snapshots.popleft()
        rates = self.window_rates()
        for k, r in rates.items():
            prev = self.smoothed.get(k)
            self.smoothed[k] = r if prev is None else self.smoothing * r + (1 - self.smoothing) * prev

    def window_rates(self) -> dict[tuple[str, str], float]:
        """Tokens/s per (group, expert) between the oldest and newest snapshot; a counter that
        went down (a replica restarted) counts from zero."""
        if len(self.snapshots) < 2:
            return {}
        (t0, a), (t1, b) = self.snapshots[0], self.snapshots[-1]
        dt = t1 - t0
        if dt <= 0:
            return {}
        return {k: ((v - a.get(k, 0.0)) if v >= a.get(k, 0.0) else v) / dt for k, v in b.items()}


def expert_load(rates: dict[tuple[str, str], float]) -> dict[str, float]:
    """Per expert over all the groups hosting a copy of it."""
    out: dict[str, float] = {}
    for (_, eid), r in rates.items():
        out[eid] = out.get(eid, 0.0) + r
    return out


def group_load(rates: dict[tuple[str, str], float], groups: list[str] | None = None) -> dict[str, float]:
    """Per shard group; groups listed in `groups` but idle count as 0 (they lower the mean)."""
    out: dict[str, float] = {g: 0.0 for g in groups or []}
    for (group, _), r in rates.items():
        out[group] = out.get(group, 0.0) + r
    return out


def layer_imbalance(rates: dict[tuple[str, str], float], groups: list[str]) -> dict[int, float]:
    """Per MoE layer with load: max / mean over the shard groups of that layer's expert-tokens
    (idle groups count as 0)."""
    per: dict[int, dict[str, float]] = {}
    for (group, eid), r in rates.items():
        loads = per.setdefault(layer_of(eid), {g: 0.0 for g in groups})
        loads[group] = loads.get(group, 0.0) + r
    return {layer: imbalance(loads) for layer, loads in sorted(per.items()) if sum(loads.values()) > 0}


def mean_imbalance(per_layer: dict[int, float]) -> float:
    """What a decode step pays: the mean over layers of each layer's max / mean (1.0 when idle)."""
    return sum(per_layer.values()) / len(per_layer) if per_layer else 1.0


def imbalance(loads: dict[str, float]) -> float:
    """max / mean; 1.0 when balanced or idle."""
    values = list(loads.values())
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def coefficient_of_variation(loads: dict[str, float]) -> float:
    values = list(loads.values())
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    if mean <= 0:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean


def totals_from_app_report(report: dict) -> Totals:
    """The same totals from the app's own report (GET <prefix>/moe/v1/status): every shard
    replica's tokens per expert since it started."""
    out: Totals = {}
    for r in report.get("replicas") or []:
        for eid, n in (r.get("load") or {}).items():
            key = (r.get("group", ""), eid)
            out[key] = out.get(key, 0.0) + float(n)
    return out


def co_selection_from_report(report: dict | None) -> dict[tuple[str, str], float]:
    """(L.a, L.b) -> tokens that picked both, from the ingress's routing report."""
    pairs = ((report or {}).get("routing") or {}).get("co_selected") or []
    return {(a, b): float(n) for a, b, n in pairs}


@dataclass
class AppReportSource:
    """Direct, when no Ray metrics URL is known: the app's own report through its HTTP endpoint."""

    base_url: str
    timeout_s: float = 5.0

    def expert_token_totals(self) -> Totals:
        from moe_operator.observe import fetch_app_status

        report = fetch_app_status(self.base_url, self.timeout_s)
        if report is None:
            raise MetricsUnavailable(f"{self.base_url}/moe/v1/status cannot be read")
        return totals_from_app_report(report)
