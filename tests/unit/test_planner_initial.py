"""Initial placement: complete, balanced, deterministic, minimal movement when groups change."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, strategies as st

from moe_operator.planner.initial import _layer_capacity, initial_placement, moved_experts


def _check_complete_and_balanced(p, layers, experts, groups):
    copies = Counter(e for es in p.values() for e in es)
    assert set(copies) == {f"{l}.{e}" for l in range(layers) for e in range(experts)}
    assert set(copies.values()) == {1}
    assert len(p) == groups
    totals = [len(es) for es in p.values()]
    assert max(totals) - min(totals) <= 1  # bytes balanced to one expert
    for layer in range(layers):
        per = [sum(1 for e in es if e.startswith(f"{layer}.")) for es in p.values()]
        assert max(per) - min(per) <= 1


@given(st.integers(1, 6), st.integers(1, 64), st.integers(1, 16))
def test_complete_balanced_deterministic(layers, experts, groups):
    p = initial_placement(layers, experts, groups)
    _check_complete_and_balanced(p, layers, experts, groups)
    assert p == initial_placement(layers, experts, groups)


@given(st.integers(1, 4), st.integers(1, 64), st.integers(1, 16), st.integers(1, 16))
def test_regrouping_moves_only_the_surplus(layers, experts, g1, g2):
    before = initial_placement(layers, experts, g1)
    after = initial_placement(layers, experts, g2, previous=before)
    _check_complete_and_balanced(after, layers, experts, g2)
    # fewest moves possible: per layer, a surviving group keeps at most min(old experts, new capacity)
    keepable = 0
    for layer in range(layers):
        caps = _layer_capacity(layer, experts, g2)
        for k in range(min(g1, g2)):
            old = sum(1 for e in before[f"ExpertShard-{k}"] if e.startswith(f"{layer}."))
            keepable += min(old, caps[k])
    assert moved_experts(before, after) == layers * experts - keepable


def test_doubling_groups_moves_half():
    before = initial_placement(4, 8, 4)
    after = initial_placement(4, 8, 8, previous=before)
    assert moved_experts(before, after) == 4 * 4  # one of each group's two experts per layer
    same = initial_placement(4, 8, 4, previous=before)
    assert moved_experts(before, same) == 0
