"""Load-aware placement planner (pure): per-layer balance, equal slots, copy and move budgets."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from moe_operator.planner.initial import initial_placement
from moe_operator.planner.layer import LayerState, feasible, improve, slots_per_group
from moe_operator.planner.rebalance import (balancedness, layer_balancedness, lower_bound_balancedness,
                                            plan, replicate)
from moe_operator.planner.synthetic import lognormal_load, zipf_load

MB = 2**20


def check_valid(p, current, redundant_slots, max_moves=None):
    """Every expert served, never two copies in one group, equal slots per group in every layer,
    never more copies than the layer's experts plus the spare slots, moves within the budget."""
    experts = {e for es in current.values() for e in es}
    hosted = Counter(e for es in p.placement.values() for e in es)
    assert set(hosted) == experts
    assert set(p.placement) == set(current)
    layers = {e.split(".")[0] for e in experts}
    groups = len(current)
    for layer in layers:
        n = sum(1 for e in experts if e.split(".")[0] == layer)
        cap = slots_per_group(n, groups, redundant_slots)
        assert p.slots_per_group >= cap
        copies = sum(c for e, c in hosted.items() if e.split(".")[0] == layer)
        assert copies <= n + redundant_slots, (layer, copies)
        for g, es in p.placement.items():
            assert len(es) == len(set(es)), g
            assert sum(1 for e in es if e.split(".")[0] == layer) <= cap, (g, layer)
    if max_moves is not None:
        assert p.moved_copies <= max_moves


def test_uniform_load_on_a_balanced_placement_moves_nothing():
    current = initial_placement(4, 8, 4)
    load = {e: 10.0 for es in current.values() for e in es}
    p = plan(load, current, 44 * MB, redundant_slots=4)
    assert p.moved_copies == 0 and p.bytes_moved == 0 and abs(p.balancedness - 1.0) < 1e-9


def test_skew_is_rebalanced_per_layer_and_hot_experts_replicated():
    current = initial_placement(4, 8, 4)
    load = zipf_load(4, 8, 1.2, 1)
    before = balancedness(current, load)
    p = plan(load, current, 44 * MB, redundant_slots=4)
    check_valid(p, current, 4)
    assert p.balancedness > before and p.balancedness > 0.95
    assert p.slots_per_group == 3  # (8 experts + 4 spare) / 4 groups, in every layer
    assert all(len(es) == 12 for es in p.placement.values())  # 3 slots x 4 layers, every group alike
    for layer in range(4):
        hottest = max((e for e in load if e.startswith(f"{layer}.")), key=load.get)
        assert p.copies[hottest] >= 2
    assert p.bytes_moved == p.moved_copies * 44 * MB
    assert set(p.layer_balancedness) == {0, 1, 2, 3}
    assert p.imbalance == sum(1 / b for b in p.layer_balancedness.values()) / 4


def test_each_layer_is_balanced_not_the_sum_over_layers():
    """Layer 0's hot expert in group 0, layer 1's in group 1: summed over layers both groups carry
    the same, yet every step waits for the hot group of each layer."""
    current = {"ExpertShard-0": ["0.0", "0.1", "1.2", "1.3"], "ExpertShard-1": ["0.2", "0.3", "1.0", "1.1"]}
    load = {"0.0": 100.0, "0.1": 100.0, "0.2": 1.0, "0.3": 1.0, "1.0": 100.0, "1.1": 100.0, "1.2": 1.0, "1.3": 1.0}
    before = layer_balancedness(current, load)
    assert before[0] < 0.6 and before[1] < 0.6
    p = plan(load, current, 1)
    check_valid(p, current, 0)
    assert min(p.layer_balancedness.values()) > 0.99  # one hot expert on each side, in both layers
    assert p.moved_copies == 4  # two swaps


def test_replication_goes_to_the_highest_load_per_copy():
    copies = replicate({"0.0": 90.0, "0.1": 40.0, "0.2": 10.0}, num_groups=3, redundant_slots=3)
    assert copies == {"0.0": 3, "0.1": 2, "0.2": 1}  # 90/1, 45, 40, 30 -> slots to 0.0, 0.0, 0.1
    assert replicate({"0.0": 90.0}, num_groups=2, redundant_slots=5) == {"0.0": 2}  # at most one per group


def test_lower_bound_is_per_layer_after_the_best_replication():
    load = {"0.0": 90.0, "0.1": 10.0, "1.0": 50.0, "1.1": 50.0}
    bound = lower_bound_balancedness(load, 2, redundant_slots=0)
    assert bound == {0: 50.0 / 90.0, 1: 1.0}
    # one spare copy does not fit: 2 experts + 1 spare over 2 groups is still 1 slot each
    assert lower_bound_balancedness(load, 2, redundant_slots=1)[0] == 50.0 / 90.0
    assert lower_bound_balancedness(load, 2, redundant_slots=2)[0] == 1.0  # 45 + 5 | 45 + 5


def test_move_budget_is_respected_and_everything_stays_served():
    current = initial_placement(4, 8, 4)
    load = zipf_load(4, 8, 1.4, 2)
    full = plan(load, current, 1, redundant_slots=8)
    limited = plan(load, current, 1, redundant_slots=8, max_moves=3)
    check_valid(limited, current, 8, max_moves=3)
    assert full.moved_copies > 3 and 0 < limited.moved_copies <= 3
    assert balancedness(current, load) < limited.balancedness <= full.balancedness + 1e-9


def test_refused_moves_never_leave_more_copies_than_the_spare_slots():
    """The issue's smallest case: under a move budget of 1 the old planner kept every old copy
    and added new ones (5 copies against a limit of 3 experts + 1 spare)."""
    p0 = initial_placement(1, 3, 2)
    p1 = plan(zipf_load(1, 3, 1.2, 2), p0, 1, redundant_slots=1)
    p2 = plan(zipf_load(1, 3, 1.2, 1002), p1.placement, 1, redundant_slots=1, max_moves=1)
    check_valid(p2, p0, 1, max_moves=1)
    assert sum(p2.copies.values()) <= 4


def test_a_placement_over_the_new_limits_gives_up_its_surplus_copies():
    """redundantExpertSlots lowered from 4 to 0: the surplus copies are dropped (no move)."""
    current = initial_placement(1, 8, 4)
    load = zipf_load(1, 8, 1.2, 1)
    wide = plan(load, current, 1, redundant_slots=4)
    assert sum(wide.copies.values()) == 12
    narrow = plan(load, wide.placement, 1, redundant_slots=0, max_moves=2)
    check_valid(narrow, current, 0, max_moves=2)
    assert sum(narrow.copies.values()) == 8


def test_co_selected_experts_share_a_group():
    current = {"g0": ["0.0", "0.1", "0.2", "0.3"], "g1": []}  # two of them must move anyway
    load = {e: 10.0 for e in ("0.0", "0.1", "0.2", "0.3")}
    co = {("0.0", "0.2"): 100.0, ("0.1", "0.3"): 100.0}
    p = plan(load, current, 1, co_selection=co)
    assert p.moved_copies == 2  # no more moves than without co-selection
    groups_of = {e: g for g, es in p.placement.items() for e in es}
    assert groups_of["0.0"] == groups_of["0.2"] and groups_of["0.1"] == groups_of["0.3"]
    assert abs(p.balancedness - 1.0) < 1e-9


def test_feasibility_is_gale_ryser():
    assert feasible([2, 1], [1, 1, 1]) and not feasible([3], [2, 1]) and not feasible([2, 2], [2, 1, 0])
    assert feasible([2, 2, 1], [2, 2, 1]) and not feasible([1, 1, 1], [1, 1])


def test_improvement_lowers_the_busiest_group_within_the_slots():
    state = LayerState(["a", "b"], [{"0.0", "0.1"}, {"0.2", "0.3"}], {"0.0": 5, "0.1": 4, "0.2": 1, "0.3": 1},
                       capacity=2, max_copies=4)
    improve(state)
    assert state.busiest() == 6.0 and all(len(h) == 2 for h in state.hosts)  # {5, 1} | {4, 1}


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 3), experts=st.integers(2, 16), groups=st.integers(1, 8), skew=st.floats(0.0, 2.0),
       slots=st.integers(0, 16), seed=st.integers(0, 1000), max_moves=st.one_of(st.none(), st.integers(0, 10)),
       lognormal=st.booleans(), from_plan=st.booleans())
def test_plans_are_valid_deterministic_and_within_the_bound(layers, experts, groups, skew, slots, seed, max_moves,
                                                            lognormal, from_plan):
    current = initial_placement(layers, experts, groups)
    if from_plan:  # a placement an earlier plan made, with its own replicas (maybe more than now allowed)
        current = plan(zipf_load(layers, experts, 1.2, seed + 1), current, 1, redundant_slots=16 - slots).placement
    load = lognormal_load(layers, experts, 1.0, seed) if lognormal else zipf_load(layers, experts, skew, seed)
    p = plan(load, current, 3, redundant_slots=slots, max_moves=max_moves)
    cap = slots_per_group(experts, groups, slots)
    over = sum(max(0, sum(1 for e in es if e.startswith(f"{layer}.")) - cap) for es in current.values()
               for layer in range(layers))
    if max_moves is None or max_moves >= over:  # a group above its (lowered) slots needs moves to get under
        check_valid(p, initial_placement(layers, experts, groups), slots, max_moves)
    else:
        assert sum(p.copies.values()) <= layers * (experts + slots) and p.moved_copies <= max_moves
    assert p == plan(load, current, 3, redundant_slots=slots, max_moves=max_moves)
    bound = lower_bound_balancedness(load, groups, slots)
    for layer, b in p.layer_balancedness.items():
        assert b <= bound[layer] + 1e-9
    within = all(sum(1 for e in es if e.startswith(f"{layer}.")) <= cap for es in current.values()
                 for layer in range(layers)) and sum(map(len, current.values())) <= layers * (experts + slots)
    if within and max_moves is None:
        assert p.balancedness >= balancedness(current, load) - 1e-9  # never worse than staying
