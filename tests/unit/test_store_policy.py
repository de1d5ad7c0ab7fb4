"""Eviction policies and the offline optimum (pure)."""

import random

import pytest

from moe_workers.store.policy import LFU, LRU, HintTracker, RecencyFrequency, belady_hits, make_policy, policy_hits


def test_lru_evicts_least_recent():
    p = LRU()
    for k in ["a", "b", "c", "a"]:
        p.access(k)
    assert p.victim(["a", "b", "c"]) == "b"


def test_lfu_evicts_least_frequent_with_recency_tiebreak():
    p = LFU()
    for k in ["a", "a", "b", "c", "c", "b"]:
        p.access(k)
    # all twice: b is the most recent; a the least recent
    assert p.victim(["a", "b", "c"]) == "a"
    p.access("a")
    assert p.victim(["a", "b", "c"]) == "c"


def test_recency_frequency_between_lru_and_lfu():
    # "hot" used often long ago, "new" used once just now
    short = RecencyFrequency(half_life=1)
    long = RecencyFrequency(half_life=10_000)
    for p in (short, long):
        for _ in range(5):
            p.access("hot")
        for i in range(20):
            p.access(f"x{i}")
        p.access("new")
    assert short.victim(["hot", "new"]) == "hot"  # behaves like LRU
    assert long.victim(["hot", "new"]) == "new"  # behaves like LFU


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="LRU"):
        make_policy("MRU")


def brute_force_optimum(trace, capacity):
    """Exhaustive search over eviction choices (tiny traces only)."""
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(trace):
            return 0
        k = trace[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < capacity:
            return best(i + 1, cache | {k})
        return max(best(i + 1, (cache - {v}) | {k}) for v in cache)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_optimal_on_small_traces(seed):
    rng = random.Random(seed)
    trace = [rng.randrange(5) for _ in range(14)]
    for cap in (1, 2, 3):
        assert belady_hits(trace, cap) == brute_force_optimum(trace, cap)


def test_online_policies_never_beat_belady():
    rng = random.Random(7)
    weights = [1 / (i + 1) ** 1.2 for i in range(32)]
    trace = rng.choices(range(32), weights=weights, k=3000)
    for cap in (4, 8, 16):
        opt = belady_hits(trace, cap)
        for p in (LRU(), LFU(), RecencyFrequency()):
            assert policy_hits(trace, cap, p) <= opt
    assert belady_hits(trace, 32) == len(trace) - len(set(trace))
    assert belady_hits(trace, 0) == 0


def test_recency_frequency_counts_per_layer():
    """A layer's popular expert is not aged by traffic in other layers (each layer is visited
    once per token, whatever the number of layers)."""
    p = RecencyFrequency(half_life=8)
    for _ in range(4):
        p.access((0, 0))
    p.access((0, 1))
    for i in range(200):  # many accesses in other layers
        p.access((1 + i % 30, i % 8))
    assert p.victim([(0, 0), (0, 1)]) == (0, 1)
    assert p.score((0, 0)) > p.score((5, 3))  # 4 recent uses in its layer beat an aged one elsewhere


def test_recency_frequency_forgets_a_shifted_popularity_lfu_does_not():
    rf, lfu = RecencyFrequency(half_life=16), LFU()
    for p in (rf, lfu):
        for _ in range(100):
            p.access((0, "old"))
        for _ in range(60):
            p.access((0, "new"))
    assert rf.victim([(0, "old"), (0, "new")]) == (0, "old")
    assert lfu.victim([(0, "old"), (0, "new")]) == (0, "new")


def test_hint_tracker_settles_hints_by_the_next_call_of_their_layer():
    t = HintTracker(window=4)
    assert t.accuracy is None
    t.hinted([(1, 0), (1, 2)])
    t.used([(0, 5)])  # another layer: settles nothing
    assert t.accuracy is None and t.settled == 0
    t.used([(1, 0), (1, 3)])  # (1, 0) hit, (1, 2) missed
    assert t.settled == 2 and t.accuracy == pytest.approx(0.75)  # first 1.0 (hit), then 1 + (0 - 1) / 4
    t.used([(1, 2)])  # already settled: no double count
    assert t.settled == 2


def test_hint_tracker_counts_hints_no_call_used_as_misses():
    t = HintTracker(window=2)
    t.hinted([(3, 1)])
    t.hinted([(3, 1)])  # the layer came again without a call here: the first hint missed
    assert t.settled == 1 and t.accuracy == 0.0
    t.used([(3, 1)])
    assert t.settled == 2 and t.accuracy == pytest.approx(0.5)
    with pytest.raises(ValueError):
        HintTracker(window=0)
