"""Load-aware placement planner (pure)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from moe_operator.planner.initial import initial_placement
from moe_operator.planner.rebalance import balancedness, lower_bound_balancedness, plan, replicate
from moe_operator.planner.synthetic import zipf_load

MB = 2**20


def check_valid(p, current, load):
    experts = {e for es in current.values() for e in es}
    hosted = [e for es in p.placement.values() for e in es]
    assert set(hosted) == experts  # every expert served
    for g, es in p.placement.items():
        assert len(es) == len(set(es)), g  # never two copies in one group
    assert set(p.placement) == set(current)


def test_uniform_load_on_a_balanced_placement_moves_nothing():
    current = initial_placement(4, 8, 4)
    load = {e: 10.0 for es in current.values() for e in es}
    p = plan(load, current, 44 * MB)
    assert p.moved_copies == 0 and p.bytes_moved == 0 and abs(p.balancedness - 1.0) < 1e-9


def test_skew_is_rebalanced_and_hot_experts_replicated():
    current = initial_placement(4, 8, 4)
    load = zipf_load(4, 8, 1.2, 1)
    before = balancedness(current, load)
    p = plan(load, current, 44 * MB, redundant_slots=4)
    check_valid(p, current, load)
    assert p.balancedness > before and p.balancedness > 0.95
    assert sum(p.copies.values()) == 32 + 4
    hottest = max(load, key=load.get)
    assert p.copies[hottest] >= 2
    assert p.bytes_moved == p.moved_copies * 44 * MB


def test_replication_goes_to_the_highest_load_per_copy():
    copies = replicate({"0.0": 90.0, "0.1": 40.0, "0.2": 10.0}, num_groups=3, redundant_slots=3)
    assert copies == {"0.0": 3, "0.1": 2, "0.2": 1}  # 90/1, 45, 40, 30 -> slots to 0.0, 0.0, 0.1
    assert replicate({"0.0": 90.0}, num_groups=2, redundant_slots=5) == {"0.0": 2}  # at most one per group


def test_move_budget_is_respected_and_everything_stays_served():
    current = initial_placement(4, 8, 4)
    load = zipf_load(4, 8, 1.4, 2)
    full = plan(load, current, 1, redundant_slots=8)
    limited = plan(load, current, 1, redundant_slots=8, max_moves=3)
    check_valid(limited, current, load)
    assert full.moved_copies > 3 and limited.moved_copies <= 3
    assert balancedness(current, load) <= limited.balancedness <= full.balancedness + 1e-9


def test_co_selected_experts_share_a_group():
    current = {"g0": ["0.0", "0.1", "0.2", "0.3"], "g1": []}  # two of them must move anyway
    load = {e: 10.0 for e in ("0.0", "0.1", "0.2", "0.3")}
    co = {("0.0", "0.2"): 100.0, ("0.1", "0.3"): 100.0}
    p = plan(load, current, 1, co_selection=co)
    assert p.moved_copies == 2  # no more moves than without co-selection
    groups_of = {e: g for g, es in p.placement.items() for e in es}
    assert groups_of["0.0"] == groups_of["0.2"] and groups_of["0.1"] == groups_of["0.3"]
    assert abs(p.balancedness - 1.0) < 1e-9


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 4), experts=st.integers(2, 16), groups=st.integers(1, 8), skew=st.floats(0.0, 2.0),
       slots=st.integers(0, 16), seed=st.integers(0, 1000), max_moves=st.one_of(st.none(), st.integers(0, 10)))
def test_plans_are_valid_deterministic_and_within_the_bound(layers, experts, groups, skew, slots, seed, max_moves):
    current = initial_placement(layers, experts, groups)
    load = zipf_load(layers, experts, skew, seed)
    p = plan(load, current, 3, redundant_slots=slots, max_moves=max_moves)
    check_valid(p, current, load)
    assert p == plan(load, current, 3, redundant_slots=slots, max_moves=max_moves)
    assert p.balancedness <= lower_bound_balancedness(load, groups, p.copies) + 1e-9
    if max_moves is not None:
        assert p.moved_copies <= max_moves
