"""Per-expert health on a shard replica: compute latency by sampling, and errors (pure
bookkeeping, no Ray, no torch).

Timing every expert of every call would split a decode step's one native call into one call an
expert; so one call in `SAMPLE_EVERY` is computed an expert at a time, each timed
(`expert_call.compute_call`'s `timer`), and the last `SAMPLES_KEPT` durations of each expert
give its p95. A row's values do not depend on the other rows of its call (the C kernels', and
each expert's products), so a sampled call's outputs are the grouped call's bit for bit
(tests/unit/test_expert_health.py). A call that raised counts an error for each of its experts.
Hot-tier misses per expert come from the store (`TieredExpertStore.misses_by_key`).
"""

from __future__ import annotations

import math
import threading
from collections import deque

from moe_workers.expert_ids import ExpertId

SAMPLE_EVERY = 16  # one call in this many is computed an expert at a time, each timed
SAMPLES_KEPT = 64  # durations kept per expert (its p95 is over these)

Key = tuple[int, int]


def p95(values) -> float | None:
    """The 95th percentile (nearest rank) of `values`; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class ExpertHealth:
    """Sampled compute durations and errors per expert of one shard replica."""

    def __init__(self, sample_every: int = SAMPLE_EVERY, kept: int = SAMPLES_KEPT):
        self.sample_every, self.kept = sample_every, kept
        self._calls = 0
        self._lock = threading.Lock()
        self._samples: dict[Key, deque] = {}
        self._errors: dict[Key, int] = {}
        self._fresh: set[Key] = set()  # sampled since the last `fresh_p95_seconds`

    def sample_next(self) -> bool:
        """Whether the call about to run is timed an expert at a time (one in `sample_every`;
        calls on several connections' threads may share a count now and then: a cadence, not a
        ledger)."""
        self._calls += 1
        return self._calls % self.sample_every == 0

    def record(self, key: Key, seconds: float) -> None:
        """One expert's compute in a sampled call."""
        with self._lock:
            ring = self._samples.get(key)
            if ring is None:
                ring = self._samples[key] = deque(maxlen=self.kept)
            ring.append(seconds)
            self._fresh.add(key)

    def failed(self, keys: list[Key]) -> None:
        """A call with these experts raised."""
        with self._lock:
            for key in keys:
                self._errors[key] = self._errors.get(key, 0) + 1

    def fresh_p95_seconds(self) -> dict[Key, float]:
        """The p95 compute seconds of each expert sampled since the last call (the metrics'
        gauge: a gauge set costs tens of microseconds, so only those that moved)."""
        with self._lock:
            rings = {k: list(self._samples[k]) for k in self._fresh}
            self._fresh = set()
        return {k: p95(v) for k, v in rings.items() if v}

    def report(self, keys, misses: dict[Key, int]) -> dict[str, dict]:
        """Per expert of `keys` (those hosted): {"p95_ms" (None before a sample), "samples",
        "misses" (hot misses, from the store), "errors"}, by expert id."""
        with self._lock:
            rings = {k: list(v) for k, v in self._samples.items()}
            errors = dict(self._errors)
        out = {}
        for key in keys:
            ring = rings.get(key, [])
            q = p95(ring)
            out[str(ExpertId(*key))] = {"p95_ms": None if q is None else round(q * 1e3, 4), "samples": len(ring),
                                   "misses": misses.get(key, 0), "errors": errors.get(key, 0)}
        return out
