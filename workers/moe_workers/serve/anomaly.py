"""Routing anomaly detection over the Ingress' routing windows (pure: no Ray, no torch, no clock).

Per MoE layer, each expert's baseline share of the layer's expert-tokens is an exponentially
weighted mean over the windows that saw traffic (`min_tokens` or more). A layer alerts:

- `surge`: an expert's share of the window exceeds `surge_factor` x its baseline share (3.0: +200%)
  and is material, at least `min_share_factor` / E (2.0: twice what uniform routing gives it), so a
  rarely used expert going from 1 token to 3 does not fire;
- `entropy`: the layer's routing entropy, normalised as RoutingStats reports it (h / log E: 1.0 is
  uniform use of all E experts, 0 one expert taking every token), falls below `entropy_floor`
  (0.5: half of log E, about the entropy of routing every token among sqrt(E) experts).

No alert before the layer has `warmup_windows` windows of baseline. While a layer alerts its
baseline is frozen (a sustained surge never becomes the new normal and clears itself); a window
with traffic that no longer crosses the thresholds clears the alert; a window without traffic
leaves everything as it was. An alert keeps naming its expert while that one still qualifies (no
flapping between two surging experts; the operator's condition changes only with what it names).
Each alert names the API key (its short id, `auth.key_id`) with the most
of the surging expert's tokens in the window ("-": requests without a key), from the per-key
expert-token counts RoutingStats keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

SURGE, ENTROPY = "surge", "entropy"
from moe_workers.serve.auth import ANONYMOUS


@dataclass(frozen=True)
class Thresholds:
    """What counts as an anomaly (user_config "anomaly", from spec.routing.anomaly)."""

    entropy_floor: float = 0.5
    surge_factor: float = 3.0
    min_share_factor: float = 2.0
    min_tokens: int = 64  # a layer's expert-tokens in a window for it to count at all
    warmup_windows: int = 3
    baseline_weight: float = 0.2  # of each new window in the baseline's moving mean

    @classmethod
    def from_dict(cls, d: dict | None) -> "Thresholds":
        """From user_config's camelCase or snake_case keys; unknown keys refused (ValueError)."""
        names = {f: f for f in cls.__dataclass_fields__}
        names.update({"entropyFloor": "entropy_floor", "surgeFactor": "surge_factor",
                      "minShareFactor": "min_share_factor", "minTokens": "min_tokens",
                      "warmupWindows": "warmup_windows", "baselineWeight": "baseline_weight"})
        out = cls()
        for k, v in (d or {}).items():
            if k not in names:
                raise ValueError(f"anomaly setting {k!r} is not one of {', '.join(sorted(cls.__dataclass_fields__))}")
            out = replace(out, **{names[k]: v})
        return out


@dataclass(frozen=True)
class Anomaly:
    layer: int
    expert: int  # the surging expert; for `entropy`, the layer's most selected expert
    kind: str  # SURGE | ENTROPY
    share: float  # the expert's share of the layer's expert-tokens in the window
    baseline: float  # its baseline share
    entropy: float | None  # the layer's normalised entropy in the window
    key: str  # the key id with the most of the expert's tokens
    key_share: float  # that key's share of the expert's tokens
    since: str  # when it was first seen (as the caller passed `now`)

    def as_dict(self) -> dict:
        return {"layer": self.layer, "expert": self.expert, "kind": self.kind, "share": round(self.share, 4),
                "baseline": round(self.baseline, 4),
                "entropy": None if self.entropy is None else round(self.entropy, 4),
                "key": self.key, "key_share": round(self.key_share, 4), "since": self.since}


def entropy(counts: list[int]) -> float | None:
    """Normalised entropy h / log E of one layer's counts (None: no tokens, or fewer than 2 experts)."""
    total = sum(counts)
    if total == 0 or len(counts) < 2:
        return None
    h = -sum(c / total * math.log(c / total) for c in counts if c)
    return h / math.log(len(counts))


class Detector:
    """Per-layer baselines and the active alerts. `observe()` takes one window's counts."""

    def __init__(self, thresholds: Thresholds | None = None):
        self.thresholds = thresholds or Thresholds()
        self.baseline: dict[int, list[float]] = {}  # layer -> each expert's share
        self.windows: dict[int, int] = {}  # layer -> windows in its baseline
        self.active: dict[tuple[int, str], Anomaly] = {}  # (layer, kind) -> the alert
        # layer -> (each expert's share in the last window that counted, the baseline before it)
        self.last: dict[int, tuple[list[float], list[float]]] = {}

    def configure(self, thresholds: Thresholds) -> None:
        """New thresholds; the baselines are kept (they measure traffic, not the settings)."""
        self.thresholds = thresholds

    def status(self) -> str:
        """'' when every layer seen has its baseline; else what is still warming up."""
        if not self.windows:
            return "no window with traffic yet"
        cold = sorted(layer for layer, n in self.windows.items() if n < self.thresholds.warmup_windows)
        if not cold:
            return ""
        return (f"warming up: layers {', '.join(map(str, cold[:8]))} have fewer than "
                f"{self.thresholds.warmup_windows} windows of baseline")

    def observe(self, selected: dict[int, list[int]], keys: dict[str, dict[int, list[int]]] | None,
                now: str) -> list[Anomaly]:
        """`selected`: layer -> each expert's expert-tokens in the window; `keys`: key id -> layer ->
        each expert's expert-tokens from that key's requests (may be partial or empty). The alerts
        active after this window, by layer."""
        th = self.thresholds
        for layer, counts in selected.items():
            total = sum(counts)
            if total < th.min_tokens or len(counts) < 2:
                continue  # too little traffic to say anything: alerts and baseline stay as they are
            shares = [c / total for c in counts]
            self.last[layer] = (shares, list(self.baseline.get(layer) or shares))
            h = entropy(counts)
            warm = self.windows.get(layer, 0) >= th.warmup_windows
            found: dict[str, Anomaly] = {}
            if warm:
                base = self.baseline[layer]
                floor = th.min_share_factor / len(counts)
                surges = [e for e, s in enumerate(shares) if s >= floor and s > th.surge_factor * base[e]]
                if surges:
                    e = self._named(layer, SURGE, surges, lambda x: shares[x] - base[x])
                    found[SURGE] = self._anomaly(layer, e, SURGE, shares, base, h, keys, now)
                if h is not None and h < th.entropy_floor:
                    e = self._named(layer, ENTROPY, range(len(counts)), lambda x: counts[x])
                    found[ENTROPY] = self._anomaly(layer, e, ENTROPY, shares, base, h, keys, now)
            for kind in (SURGE, ENTROPY):
                if kind not in found:
                    self.active.pop((layer, kind), None)
            self.active.update({(layer, kind): a for kind, a in found.items()})
            if not found:  # a layer that alerts keeps its baseline as it was
                self._learn(layer, shares)
        return [self.active[k] for k in sorted(self.active)]

    def load_report(self) -> dict[str, dict[str, list[float]]]:
        """Each expert's load against its own baseline, for expert health (`moectl experts`' VS
        BASE): {layer: {"share": its share of the layer's expert-tokens in the last window that
        counted, "baseline": the baseline share before that window}} (layers as strings, for
        JSON). One baseline for both uses: the one the alerts compare with (frozen while the layer
        alerts)."""
        return {str(layer): {"share": [round(v, 6) for v in share], "baseline": [round(v, 6) for v in base]}
                for layer, (share, base) in sorted(self.last.items())}

    def _named(self, layer: int, kind: str, candidates, rank) -> int:
        """The expert an alert names: the one it named already while that one still qualifies (an
        alert does not flap between two surging experts), else the top of `rank`."""
        previous = self.active.get((layer, kind))
        candidates = list(candidates)
        if previous is not None and previous.expert in candidates and (kind == SURGE or rank(previous.expert) > 0):
            return previous.expert
        return max(candidates, key=rank)

    def _anomaly(self, layer, e, kind, shares, base, h, keys, now) -> Anomaly:
        key, key_share = attribute(keys or {}, layer, e)
        previous = self.active.get((layer, kind))
        since = previous.since if previous is not None else now  # the layer's alert goes on
        return Anomaly(layer, e, kind, shares[e], base[e], h, key, key_share, since)

    def _learn(self, layer: int, shares: list[float]) -> None:
        w = self.thresholds.baseline_weight
        base = self.baseline.get(layer)
        n = self.windows.get(layer, 0)
        if base is None or len(base) != len(shares):
            self.baseline[layer], self.windows[layer] = list(shares), 1
            return
        # the plain mean over the warm-up windows, then the moving mean
        a = max(w, 1.0 / (n + 1))
        self.baseline[layer] = [(1 - a) * b + a * s for b, s in zip(base, shares)]
        self.windows[layer] = n + 1


def attribute(keys: dict[str, dict[int, list[int]]], layer: int, expert: int) -> tuple[str, float]:
    """The key id with the most of `expert`'s tokens in `layer`, and its share of them
    (ANONYMOUS, 0.0 when no key's counts are known)."""
    per_key = {k: layers[layer][expert] for k, layers in keys.items()
               if layer in layers and expert < len(layers[layer])}
    total = sum(per_key.values())
    if not total:
        return ANONYMOUS, 0.0
    best = max(sorted(per_key), key=lambda k: per_key[k])
    return best, per_key[best] / total
