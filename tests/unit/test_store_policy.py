"""Eviction policies and the offline optimum (pure)."""

import random

import pytest

from moe_workers.store.policy import (LFU, LRU, HintTracker, RankAware, RecencyFrequency, belady_hits, make_policy,
                                      policy_hits, policy_hits_visits, visits_of)


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


def _runs(policy, ranked: bool, keep: bool, calls: int = 400, seed: int = 3):
    """Calls of layer 0 over experts 0-4 with top-2 routing: the first choice kept for runs of 20
    calls (`keep`) or drawn afresh each call; then one call whose first choice is expert 5."""
    rng = random.Random(seed)
    first = 0
    for i in range(calls):
        if not keep or i % 20 == 0:
            first = rng.randrange(5)
        second = rng.choice([e for e in range(5) if e != first])
        policy.visit([(0, first), (0, second)], {(0, first)} if ranked else ())
    policy.visit([(0, 5), (0, 1)], {(0, 5)} if ranked else ())


def test_rank_aware_keeps_the_layers_last_first_choice_when_tokens_keep_theirs():
    p = RankAware()
    _runs(p, ranked=True, keep=True)
    assert p.stay() > 0.8  # learnt: the last first choice comes again far more often than its share says
    # expert 5 was used once; expert 2 in ~40% of calls, but not in the last one
    assert p.victim([(0, 5), (0, 2)]) == (0, 2)
    rf = RecencyFrequency()
    _runs(rf, ranked=True, keep=True)
    assert rf.victim([(0, 5), (0, 2)]) == (0, 5)  # what the ranking changes


def test_rank_aware_is_popularity_when_first_choices_do_not_repeat_or_are_not_told():
    drawn = RankAware()
    _runs(drawn, ranked=True, keep=False)
    assert drawn.stay() < 0.1
    assert drawn.victim([(0, 5), (0, 2)]) == (0, 5)
    untold = RankAware()
    _runs(untold, ranked=False, keep=True)
    assert untold.stay() == 0.0
    assert untold.victim([(0, 5), (0, 2)]) == (0, 5)


def test_rank_aware_forgets_a_first_choice_made_elsewhere_and_compares_layers_by_share():
    p = RankAware()
    _runs(p, ranked=True, keep=True)
    p.visit([(0, 1)], {(9, 9)})  # a ranked call whose first choice another shard hosts
    assert p.victim([(0, 5), (0, 2)]) == (0, 5)
    # layer 1 is called 4 times as often as layer 3; each has one expert used in every call:
    # equally likely at their next call, and the one used longer ago goes first
    q = RankAware()
    for i in range(40):
        q.visit([(1, 0)])
        if i % 4 == 0:
            q.visit([(3, 0)])
    assert q.victim([(1, 0), (3, 0)]) == (3, 0)
    assert make_policy("RankAware").name == "RankAware"


def test_rank_aware_replayed_as_the_store_sees_calls_beats_recency_frequency_on_a_local_trace():
    """Top-2 calls over 4 layers of 8 experts whose first choice is kept with probability 0.5:
    the ranking is worth hits at a cache of a quarter of the experts."""
    rng = random.Random(11)
    weights = [1 / (r + 1) for r in range(8)]
    prev, visits = {}, []
    for _ in range(1500):
        for layer in range(4):
            first = prev[layer] if layer in prev and rng.random() < 0.5 else rng.choices(range(8), weights)[0]
            second = rng.choices([e for e in range(8) if e != first], [weights[e] for e in range(8) if e != first])[0]
            prev[layer] = first
            visits.append(([(layer, first), (layer, second)], {(layer, first)}))
    rank_aware = policy_hits_visits(visits, 8, RankAware())
    recency_frequency = policy_hits_visits(visits, 8, RecencyFrequency())
    assert rank_aware > 1.05 * recency_frequency
    trace = [k for keys, _ in visits for k in keys]
    assert visits_of(trace, 2) == [(keys, {keys[0]}) for keys, _ in visits]
    assert rank_aware <= belady_hits(trace, 8)
