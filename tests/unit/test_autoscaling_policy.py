"""Autoscaling policy against synthetic load series (pure): hysteresis, cooldown, bounds, the
scale subresource, and the Off / Recommend / Auto modes."""

from moe_operator.api.models import AutoscalingSpec
from moe_operator.autoscaling.policy import NONE, REBALANCE, SCALE_DOWN, SCALE_UP, PolicyState, Signals, decide


def spec(**kw):
    base = dict(mode="Auto", imbalance_threshold=1.25, stabilization_window_seconds=60, cooldown_seconds=300)
    return AutoscalingSpec.model_validate({**base, **kw})


def run(sp, series, replicas=1, step=10.0, after=1.05, state=None):
    """series: (imbalance, busiest group tokens/s) per step; replicas follow what the policy applies."""
    state = state or PolicyState()
    decisions = []
    spec_replicas = replicas
    for i, (imb, tps) in enumerate(series):
        d, state = decide(sp, Signals(imb, tps, spec_replicas, spec_replicas, after), state, i * step)
        decisions.append(d)
        if d.apply and d.replicas_per_group is not None:
            spec_replicas = d.replicas_per_group
    return decisions, state


def test_off_decides_nothing():
    ds, _ = run(spec(mode="Off"), [(3.0, 100)] * 20)
    assert all(d.kind == NONE and not d.apply for d in ds)


def test_short_spikes_are_ignored_sustained_imbalance_rebalances_once():
    spiky = [(2.0, 10), (1.0, 10)] * 10  # above for 10 s at a time: never 60 s
    ds, _ = run(spec(), spiky)
    assert all(d.kind == NONE for d in ds)
    sustained = [(1.1, 10)] * 3 + [(2.0, 10)] * 12
    ds, _ = run(spec(), sustained)
    kinds = [d.kind for d in ds]
    assert kinds.count(REBALANCE) == 1
    first = kinds.index(REBALANCE)
    assert first == 3 + 6  # above from t=30; 60 s later
    assert ds[first].apply and ds[first].imbalance_before == 2.0 and ds[first].imbalance_after == 1.05
    assert "cooling down" in ds[first + 1].reason or "stabilization" in ds[first + 1].reason


def test_cooldown_then_rebalance_again():
    ds, _ = run(spec(cooldown_seconds=100, stabilization_window_seconds=0), [(2.0, 10)] * 25)
    times = [i * 10 for i, d in enumerate(ds) if d.kind == REBALANCE]
    assert times[0] == 0 and all(b - a >= 100 for a, b in zip(times, times[1:])) and len(times) >= 2


def test_recommend_records_but_never_applies():
    ds, state = run(spec(mode="Recommend", stabilization_window_seconds=0), [(2.0, 10)] * 5)
    assert all(d.kind == REBALANCE and not d.apply for d in ds)
    assert state.last_applied is None


def test_no_rebalance_when_the_planner_cannot_improve():
    ds, _ = run(spec(stabilization_window_seconds=0), [(1.5, 10)] * 3, after=1.49)
    assert all(d.kind == NONE and "no placement does better" in d.reason for d in ds)


def test_replicas_follow_load_within_bounds():
    sp = spec(target_tokens_per_second_per_replica=100, min_replicas_per_group=1, max_replicas_per_group=3,
              cooldown_seconds=0)
    ds, _ = run(sp, [(1.0, 250), (1.0, 250), (1.0, 900), (1.0, 40)])
    assert [(d.kind, d.replicas_per_group) for d in ds] == [
        (SCALE_UP, 3), (NONE, None), (NONE, None), (SCALE_DOWN, 1)]  # 900 tok/s wants 9: capped at 3


def test_replica_count_set_through_the_scale_subresource_is_respected():
    sp = spec(target_tokens_per_second_per_replica=100, cooldown_seconds=0, max_replicas_per_group=8)
    d, state = decide(sp, Signals(1.0, 300, 1, 1), PolicyState(), 0)
    assert d.kind == SCALE_UP and d.replicas_per_group == 3 and state.last_set_replicas == 3
    # someone ran `kubectl scale --replicas=5`: the spec says 5, not the 3 the policy wrote
    d, state = decide(sp, Signals(1.0, 100, 5, 5), state, 10)
    assert d.kind == NONE and d.replicas_per_group is None
    # rebalancing still works meanwhile
    d, _ = decide(spec(stabilization_window_seconds=0, cooldown_seconds=0, target_tokens_per_second_per_replica=100),
                  Signals(2.0, 100, 5, 5, 1.1), state, 20)
    assert d.kind == REBALANCE
