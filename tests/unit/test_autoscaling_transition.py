"""Make-before-break placement changes (pure): the ingress never routes to a copy that is not
loaded on every replica, and a target is reached in three passes."""

from moe_operator.autoscaling.transition import (
    DRAINING, LOADING, STEADY, SWITCHING, loaded_everywhere, next_step, union)
from moe_operator.planner.initial import current_placement, initial_placement, placement_problem

OLD = {"ExpertShard-0": ["0.0", "0.1"], "ExpertShard-1": ["0.2", "0.3"]}
NEW = {"ExpertShard-0": ["0.0", "0.2", "0.3"], "ExpertShard-1": ["0.1", "0.3"]}  # 0.3 replicated


def reports_for(shards, replicas=1, lagging=()):
    out = []
    for g, experts in shards.items():
        for r in range(replicas):
            have = [e for e in experts if (g, r) not in lagging]
            out.append({"group": g, "replica": f"{g}-{r}", "experts": have})
    return out


def routed_are_hosted(ingress, shards):
    return all(set(ingress[g]) <= set(shards.get(g, [])) for g in ingress)


def test_steady_without_target():
    s = next_step(OLD, OLD, None, None, 1, None, 100.0)
    assert (s.phase, s.done, s.ingress, s.shards) == (STEADY, True, OLD, OLD)


def test_full_sequence_never_routes_to_an_unloaded_copy():
    ingress, shards, switched_at, now = OLD, OLD, None, 0.0
    phases = []
    for _ in range(10):
        reports = reports_for(shards, replicas=2)
        step = next_step(ingress, shards, None if phases and phases[-1] in (DRAINING, STEADY) else NEW,
                         reports, 2, switched_at, now)
        assert routed_are_hosted(step.ingress, step.shards)
        # the ingress may only move to copies that were hosted (and reported) before this pass
        assert routed_are_hosted(step.ingress, shards) or step.ingress == ingress
        if step.ingress != ingress:
            switched_at = now
        ingress, shards = step.ingress, step.shards
        phases.append(step.phase)
        now += 3.0
        if step.done:
            break
    assert phases == [LOADING, SWITCHING, SWITCHING, DRAINING]  # grace 5 s: one pass waits
    assert ingress == NEW and shards == NEW


def test_switch_waits_for_every_replica():
    both = union(OLD, NEW)
    lagging = reports_for(both, replicas=2, lagging={("ExpertShard-1", 1)})
    s = next_step(OLD, both, NEW, lagging, 2, None, 0.0)
    assert s.phase == LOADING and s.ingress == OLD and "ExpertShard-1 1/2" in s.message
    missing_replica = [r for r in reports_for(both, replicas=2) if r["replica"] != "ExpertShard-0-1"]
    assert next_step(OLD, both, NEW, missing_replica, 2, None, 0.0).ingress == OLD
    assert next_step(OLD, both, NEW, reports_for(both, replicas=2), 2, None, 0.0).ingress == NEW


def test_unreadable_reports_never_switch():
    both = union(OLD, NEW)
    s = next_step(OLD, both, NEW, None, 1, None, 0.0)
    assert s.phase == LOADING and s.ingress == OLD and s.shards == both


def test_loaded_everywhere_names_groups():
    ok, why = loaded_everywhere(NEW, [], 1)
    assert not ok and "ExpertShard-0 0/1" in why


def test_placement_problem_and_current_placement():
    p = initial_placement(2, 4, 2)
    assert placement_problem(p, 2, 4, 2) is None
    assert "groups" in placement_problem(p, 2, 4, 3)
    assert "outside" in placement_problem({**p, "ExpertShard-0": p["ExpertShard-0"] + ["5.0"]}, 2, 4, 2)
    assert "twice" in placement_problem({**p, "ExpertShard-0": p["ExpertShard-0"] * 2}, 2, 4, 2)
    assert "no copy" in placement_problem({"ExpertShard-0": [], "ExpertShard-1": ["0.0"]}, 2, 4, 2)
    # ids are parsed as the CRD's schema parses them: " 0.1" or "01.1" would have been int()-ed to 0.1 and
    # counted as that expert's copy, leaving 0.1 itself unhosted under a name the shards never serve
    for odd in (" 0.1", "+0.1", "00.1", "0.1.0", "0.x"):
        bad = {**p, "ExpertShard-0": [odd if e == "0.1" else e for e in p["ExpertShard-0"]],
               "ExpertShard-1": [odd if e == "0.1" else e for e in p["ExpertShard-1"]]}
        assert placement_problem(bad, 2, 4, 2).endswith(f"{odd!r} is not an expert id; expected LAYER.EXPERT, e.g. 3.12")
    # a rebalanced placement (a replica, uneven counts) is kept as deployed
    rebalanced = {"ExpertShard-0": ["0.0", "0.1", "0.2", "1.0"], "ExpertShard-1": ["0.2", "0.3", "1.1", "1.2", "1.3"]}
    assert current_placement(2, 4, 2, rebalanced) == rebalanced
    # the group count changed: re-planned from it, every expert once
    three = current_placement(2, 4, 3, rebalanced)
    assert placement_problem(three, 2, 4, 3) is None
