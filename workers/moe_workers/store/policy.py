"""Which expert to keep: eviction policies over a logical access clock (pure, deterministic).

Each policy scores resident keys; the store evicts the lowest score among the keys it may evict.
The clock is the number of accesses so far, not wall time, so a trace replays the same way
everywhere (tests, bench/tiering) and a slow machine does not change decisions.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

POLICIES = ("RankAware", "RecencyFrequency", "LRU", "LFU")
DEFAULT_POLICY = "RankAware"


class Policy:
    """Access history of keys; `victim` names the least valuable of the candidates."""

    name = "base"

    def __init__(self) -> None:
        self.clock = 0

    def access(self, key: Hashable) -> None:
        self.clock += 1
        self._record(key)

    def visit(self, keys: list[Hashable], top1: Iterable[Hashable] = ()) -> None:
        """One call's experts (one layer's, on a shard), in order; `top1`: those that were some
        token's first choice by the router's ranking (empty when the call did not say). Policies
        that do not use the ranking see an access per key."""
        for key in keys:
            self.access(key)

    def forget(self, key: Hashable) -> None:
        """The key left the tier; its history is kept (re-admission should remember it)."""

    def score(self, key: Hashable) -> float:
        raise NotImplementedError

    def victim(self, candidates: Iterable[Hashable]) -> Hashable | None:
        # ties break on the key so the choice never depends on set/dict iteration order
        best = None
        for key in candidates:
            s = (self.score(key), _order(key))
            if best is None or s < best[0]:
                best = (s, key)
        return None if best is None else best[1]

    def _record(self, key: Hashable) -> None:
        raise NotImplementedError


def _layer(key: Hashable) -> Hashable:
    """A (layer, expert) key's layer; other keys share one group."""
    return key[0] if isinstance(key, tuple) and key else None


def _order(key: Hashable):
    return key if isinstance(key, tuple) else (str(key),)


class LRU(Policy):
    """Least recently used goes first."""

    name = "LRU"

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[Hashable, int] = {}

    def _record(self, key: Hashable) -> None:
        self.last[key] = self.clock

    def score(self, key: Hashable) -> float:
        return self.last.get(key, -1)


class LFU(Policy):
    """Least frequently used goes first; recency breaks ties."""

    name = "LFU"

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[Hashable, int] = {}
        self.last: dict[Hashable, int] = {}

    def _record(self, key: Hashable) -> None:
        self.count[key] = self.count.get(key, 0) + 1
        self.last[key] = self.clock

    def score(self, key: Hashable) -> float:
        # the recency term is < 1, so it only orders keys with equal counts
        return self.count.get(key, 0) + self.last.get(key, -1) / (self.clock + 2)


class RecencyFrequency(Policy):
    """Exponentially decayed frequency (LRFU, Lee et al. 2001), counted per layer.

    Each access adds 1 to the key's value, which halves every `half_life` accesses of the key's
    layer (keys are (layer, expert); other keys share one group). Counting per layer makes the
    value an estimate of how likely the expert is at its layer's next visit, comparable across
    layers whatever their number: under Zipf-like routing it keeps the popular experts through
    bursts of rare ones (like LFU), and unlike LFU it forgets a popularity that has shifted.
    A small half-life behaves like LRU, a large one like LFU. Ties go to the least recent."""

    name = "RecencyFrequency"

    def __init__(self, half_life: float = 64.0) -> None:
        super().__init__()
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        self.decay = math.log(2) / half_life
        self.value: dict[Hashable, float] = {}  # as of the key's group clock at `updated`
        self.updated: dict[Hashable, int] = {}
        self.group_clock: dict[Hashable, int] = {}
        self.last: dict[Hashable, int] = {}

    def _record(self, key: Hashable) -> None:
        g = _layer(key)
        now = self.group_clock.get(g, 0) + 1
        self.group_clock[g] = now
        self.value[key] = self._log_value(key, now, empty=0.0, log=False) + 1.0
        self.updated[key] = now
        self.last[key] = self.clock

    def _log_value(self, key: Hashable, now: int, empty: float, log: bool) -> float:
        if key not in self.value:
            return empty
        age = now - self.updated[key]
        if log:  # log form: comparable without underflow after long idle periods
            return math.log(self.value[key]) - self.decay * age
        return self.value[key] * math.exp(-self.decay * age)

    def score(self, key: Hashable) -> float:
        now = self.group_clock.get(_layer(key), 0)
        # the recency term (< 1e-6 of a halving) only orders keys with equal values
        return self._log_value(key, now, empty=-math.inf, log=True) + 1e-9 * self.last.get(key, -1)


class RankAware(Policy):
    """The expert least likely to be used at its layer's next call goes first, with the router's
    ranking (bench/tiering.py: 0.95-0.99 of the best online bound where RecencyFrequency reaches
    0.88-0.99).

    Per layer (keys are (layer, expert); a call holds one layer's experts), in that layer's calls:
    q = an expert's exponentially decayed share of the calls that used it (the chance the next
    call uses it, as RecencyFrequency's value estimates it, halving every `half_life` calls). A
    token tends to keep its first choice from one token to the next (temporal locality), so an
    expert that was some token's top-1 at its layer's last call is kept with the chance
    stay + (1 - stay) q, where `stay` is learnt online: how often the last call's top-1 experts
    came again beyond what q predicted for them (decayed over about `stay_half_life` of them).
    Without a ranking (`access`, or a call that names no top-1) it is popularity by layer and
    recency. Ties go to the least recent."""

    name = "RankAware"

    def __init__(self, half_life: float = 48.0, stay_half_life: float = 256.0) -> None:
        super().__init__()
        if half_life <= 0 or stay_half_life <= 0:
            raise ValueError("half_life and stay_half_life must be positive")
        self.decay = math.log(2) / half_life
        self.keep = math.exp(-math.log(2) / stay_half_life)
        self.value: dict[Hashable, tuple[float, int]] = {}  # key -> (decayed calls using it, at its layer's clock)
        self.calls: dict[Hashable, tuple[float, int]] = {}  # layer -> (decayed calls, at its clock)
        self.layer_clock: dict[Hashable, int] = {}
        self.last_top1: dict[Hashable, frozenset] = {}  # layer -> the top-1 experts of its last ranked call
        self.last: dict[Hashable, int] = {}
        self.repeats = self.predicted = self.seen = 0.0  # decayed: last top-1s used again; what q said; how many

    def access(self, key: Hashable) -> None:
        self.visit([key])

    def visit(self, keys: list[Hashable], top1: Iterable[Hashable] = ()) -> None:
        by_layer: dict[Hashable, list[Hashable]] = {}
        for key in keys:
            by_layer.setdefault(_layer(key), []).append(key)
        top1 = set(top1)
        for layer, ks in by_layer.items():
            previous = self.last_top1.get(layer)
            if previous:  # did the last call's first choices come again, against what q predicted?
                used = set(ks)
                for k in previous:
                    self.repeats = self.repeats * self.keep + (k in used)
                    self.predicted = self.predicted * self.keep + self._q(k)
                    self.seen = self.seen * self.keep + 1.0
            now = self.layer_clock.get(layer, 0) + 1
            self.layer_clock[layer] = now
            calls, at = self.calls.get(layer, (0.0, now))
            self.calls[layer] = (calls * math.exp(-self.decay * (now - at)) + 1.0, now)
            for k in dict.fromkeys(ks):
                self.clock += 1
                self.value[k] = (self._decayed(k, now) + 1.0, now)
                self.last[k] = self.clock
            ranked = top1.intersection(ks)
            if ranked:
                self.last_top1[layer] = frozenset(ranked)
            else:  # the first choices were elsewhere, or the call did not say
                self.last_top1.pop(layer, None)

    def _decayed(self, key: Hashable, now: int) -> float:
        if key not in self.value:
            return 0.0
        value, at = self.value[key]
        return value * math.exp(-self.decay * (now - at))

    def _q(self, key: Hashable) -> float:
        layer = _layer(key)
        now = self.layer_clock.get(layer, 0)
        calls, at = self.calls.get(layer, (0.0, now))
        calls *= math.exp(-self.decay * (now - at))
        return min(1.0, self._decayed(key, now) / calls) if calls > 0 else 0.0

    def stay(self) -> float:
        """How much more often a call's top-1 comes again at the next call than q says (0..1)."""
        if not self.seen:
            return 0.0
        rate, q = self.repeats / self.seen, self.predicted / self.seen
        return max(0.0, (rate - q) / (1 - q)) if q < 1 else 0.0

    def score(self, key: Hashable) -> float:
        q = self._q(key)
        if key in self.last_top1.get(_layer(key), ()):
            stay = self.stay()
            q = stay + (1 - stay) * q
        return q

    def victim(self, candidates: Iterable[Hashable]) -> Hashable | None:
        best = None  # ties on the chance go to the least recent, then the key (never iteration order)
        for key in candidates:
            s = (self.score(key), self.last.get(key, -1), _order(key))
            if best is None or s < best[0]:
                best = (s, key)
        return None if best is None else best[1]


class HintTracker:
    """How often prefetch hints come true. Hints name experts a layer's next call will likely
    use; that call's experts (per layer: the key's group) settle them: each hinted expert is a
    hit if the call used it. A layer hinted again before any call settled its hints (this replica
    hosted none of that step's experts there) counts the old ones as misses. `accuracy`: an
    exponentially weighted share of hits over about `window` hints (None before the first)."""

    def __init__(self, window: int = 64) -> None:
        if window <= 0:
            raise ValueError("window must be positive")
        self.alpha = 1.0 / window
        self.pending: dict[Hashable, set[Hashable]] = {}
        self.accuracy: float | None = None
        self.settled = 0

    def hinted(self, keys: Iterable[Hashable]) -> None:
        fresh: dict[Hashable, set[Hashable]] = {}
        for k in keys:
            fresh.setdefault(_layer(k), set()).add(k)
        for g, ks in fresh.items():
            stale = self.pending.get(g)
            if stale:
                self._settle(stale, set())
            self.pending[g] = ks

    def used(self, keys: Iterable[Hashable]) -> None:
        used = set(keys)
        for g in sorted({_layer(k) for k in used}, key=lambda x: (x is None, x)):
            hinted = self.pending.pop(g, None)
            if hinted:
                self._settle(hinted, used)

    def _settle(self, hinted: set[Hashable], used: set[Hashable]) -> None:
        for k in sorted(hinted, key=_order):
            hit = 1.0 if k in used else 0.0
            self.accuracy = hit if self.accuracy is None else self.accuracy + self.alpha * (hit - self.accuracy)
            self.settled += 1


def make_policy(name: str) -> Policy:
    if name == "RankAware":
        return RankAware()
    if name == "RecencyFrequency":
        return RecencyFrequency()
    if name == "LRU":
        return LRU()
    if name == "LFU":
        return LFU()
    raise ValueError(f"unknown tier policy {name!r}; choose one of {', '.join(POLICIES)}")


def belady_hits(trace: list[Hashable], capacity: int) -> int:
    """Hits of the offline optimum (Belady's MIN) for a cache of `capacity` equal-size items:
    on a miss with a full cache, evict the item whose next use is furthest away."""
    if capacity <= 0:
        return 0
    import heapq

    n = len(trace)
    next_use = [n] * n
    seen: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = seen.get(trace[i], n + i)  # never used again: beyond the end, distinct
        seen[trace[i]] = i
    cached: dict[Hashable, int] = {}  # key -> its next use
    heap: list[tuple[int, int, Hashable]] = []  # (-next use, tiebreak, key), lazily invalidated
    hits = 0
    for i, key in enumerate(trace):
        if key in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                neg, _, k = heapq.heappop(heap)
                if cached.get(k) == -neg:
                    del cached[k]
                    break
        cached[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], i, key))
    return hits


def visits_of(trace: list[Hashable], top_k: int) -> list[tuple[list[Hashable], set[Hashable]]]:
    """A batch-1 trace as calls: each `top_k` accesses in a row, the first the router's top-1."""
    return [(trace[i:i + top_k], {trace[i]}) for i in range(0, len(trace), top_k)]


def policy_hits_visits(visits: list[tuple[list[Hashable], set[Hashable]]], capacity: int, policy: Policy) -> int:
    """Hits of an online policy replaying calls as the store sees them: the call's experts are
    told to the policy first (with its top-1), then each one missing is brought in, evicting the
    policy's victim among the cached experts the call does not use."""
    cached: set[Hashable] = set()
    hits = 0
    for keys, top1 in visits:
        policy.visit(keys, top1)
        for key in keys:
            if key in cached:
                hits += 1
                continue
            if capacity <= 0:
                continue
            if len(cached) >= capacity:
                v = policy.victim(cached - set(keys))
                if v is None:
                    continue
                cached.discard(v)
                policy.forget(v)
            cached.add(key)
    return hits


def policy_hits(trace: list[Hashable], capacity: int, policy: Policy) -> int:
    """Hits of an online policy on the same trace (same cache model as belady_hits)."""
    cached: set[Hashable] = set()
    hits = 0
    for key in trace:
        if key in cached:
            hits += 1
        elif len(cached) >= capacity:
            v = policy.victim(cached)
            cached.discard(v)
            policy.forget(v)
        policy.access(key)
        if capacity > 0:
            cached.add(key)
    return hits
