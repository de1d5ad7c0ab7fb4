"""Load signals from the workers' metrics (pure parts)."""

import math

import pytest

from moe_operator.autoscaling.signals import (LoadWindow, coefficient_of_variation, expert_load, group_load,
                                              imbalance, totals_from_exposition)

EXPOSITION = """# HELP ray_moe_expert_tokens_total Tokens routed to each expert.
# TYPE ray_moe_expert_tokens_total counter
ray_moe_expert_tokens_total{Component="core_worker",Version="2.60.0",app="ns.a",expert="0",group="ExpertShard-0",layer="1",WorkerId="a"} 30.0
ray_moe_expert_tokens_total{Component="core_worker",Version="2.60.0",app="ns.a",expert="0",group="ExpertShard-0",layer="1",WorkerId="b"} 12.0
ray_moe_expert_tokens_total{Component="core_worker",Version="2.60.0",app="ns.a",expert="1",group="ExpertShard-1",layer="1",WorkerId="c"} 6.0
ray_moe_expert_tokens_total{Component="core_worker",Version="2.60.0",app="ns.b",expert="1",group="ExpertShard-1",layer="1",WorkerId="d"} 99.0
# HELP ray_moe_tier_bytes Bytes of expert weights resident per tier.
# TYPE ray_moe_tier_bytes gauge
ray_moe_tier_bytes{group="ExpertShard-0",replica="a",tier="hot"} 1.0e+06
"""


def test_totals_sum_replicas_per_group_and_expert_of_one_app():
    assert totals_from_exposition(EXPOSITION, "ns.a") == {("ExpertShard-0", "1.0"): 42.0, ("ExpertShard-1", "1.1"): 6.0}
    assert totals_from_exposition(EXPOSITION)[("ExpertShard-1", "1.1")] == 105.0  # every app on the cluster


def test_window_rates_smoothing_and_counter_resets():
    w = LoadWindow(window_s=10, smoothing=0.5)
    k = ("g0", "0.0")
    w.add(0, {k: 0})
    w.add(5, {k: 50})
    assert w.window_rates() == {k: 10.0} and w.smoothed[k] == 10.0
    w.add(10, {k: 150})
    assert w.window_rates() == {k: 15.0}  # 150 tokens over 10 s
    assert w.smoothed[k] == pytest.approx(12.5)
    w.add(20, {k: 20})  # the replica restarted: its counter went down
    assert w.window_rates()[k] == pytest.approx(20 / 10)
    assert len(w.snapshots) == 2  # older snapshots leave the window


def test_group_load_imbalance_and_cv():
    rates = {("g0", "0.0"): 30.0, ("g0", "1.0"): 10.0, ("g1", "0.1"): 20.0, ("g1", "0.0"): 10.0}
    loads = group_load(rates, ["g0", "g1", "g2"])
    assert loads == {"g0": 40.0, "g1": 30.0, "g2": 0.0}
    assert imbalance(loads) == pytest.approx(40 / (70 / 3))
    assert coefficient_of_variation(loads) == pytest.approx(
        math.sqrt(((40 - 70 / 3) ** 2 + (30 - 70 / 3) ** 2 + (70 / 3) ** 2) / 3) / (70 / 3))
    assert expert_load(rates)["0.0"] == 40.0
    assert imbalance({"a": 0.0, "b": 0.0}) == 1.0 and coefficient_of_variation({}) == 0.0
