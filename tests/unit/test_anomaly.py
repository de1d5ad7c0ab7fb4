"""The routing anomaly detector (serve/anomaly.py): pure, over plain per-window counts."""

import random

import pytest

from moe_workers.serve.anomaly import ANONYMOUS, ENTROPY, SURGE, Detector, Thresholds, attribute, entropy
from moe_workers.serve.auth import key_digest, key_id

E = 8


def normal(rng: random.Random, tokens: int = 800) -> list[int]:
    """Top-2 of 8 over random router weights: every expert used, unevenly."""
    weights = [1.0, 1.3, 0.8, 1.1, 0.9, 1.2, 0.7, 1.0]
    counts = [0] * E
    for _ in range(tokens):
        counts[rng.choices(range(E), weights)[0]] += 1
    return counts


def warmed(windows: int = 3, seed: int = 0) -> tuple[Detector, random.Random]:
    rng = random.Random(seed)
    d = Detector()
    for i in range(windows):
        assert d.observe({0: normal(rng), 1: normal(rng)}, {}, f"t{i}") == []
    return d, rng


def test_normal_traffic_never_alerts():
    d, rng = warmed()
    for i in range(50):
        assert d.observe({0: normal(rng), 1: normal(rng)}, {}, f"n{i}") == []
    assert d.status() == ""


def test_a_surge_names_layer_expert_and_the_key_that_drove_it():
    d, rng = warmed()
    counts = normal(rng)
    counts[5] += 3000  # one expert takes most of the layer's tokens
    keys = {"aaaa1111": {1: [0] * 5 + [2900, 0, 0]}, "bbbb2222": {1: [10] * 5 + [100, 10, 10]}}
    [a] = [x for x in d.observe({0: normal(rng), 1: counts}, keys, "t9") if x.kind == SURGE]
    assert (a.layer, a.expert, a.key) == (1, 5, "aaaa1111")
    assert a.share > 3 * a.baseline and a.key_share == pytest.approx(2900 / 3000)
    assert a.since == "t9"
    # it lasts: `since` kept, the baseline frozen (a sustained surge does not become normal)
    for i in range(10):
        [a2] = [x for x in d.observe({1: counts}, keys, f"u{i}") if x.kind == SURGE]
        assert a2.since == "t9" and a2.baseline == a.baseline


def test_a_rarely_used_expert_going_from_one_token_to_three_is_not_material():
    d = Detector()
    base = [200, 200, 200, 200, 200, 200, 200, 1]
    for i in range(3):
        d.observe({0: base}, {}, str(i))
    assert d.observe({0: base[:-1] + [3]}, {}, "x") == []


def test_entropy_drop_fires_and_recovery_clears():
    d, rng = warmed()
    skewed = [1000, 900, 1, 1, 1, 1, 1, 1]  # two experts take everything
    assert entropy(skewed) < 0.5
    found = d.observe({0: skewed}, {}, "s")
    assert {(a.layer, a.kind, a.expert) for a in found} >= {(0, ENTROPY, 0)}
    assert d.observe({0: normal(rng), 1: normal(rng)}, {}, "r") == []


def test_no_alert_while_warming_up_and_no_change_without_traffic():
    d = Detector(Thresholds(warmup_windows=3))
    rng = random.Random(1)
    skewed = [5000, 1, 1, 1, 1, 1, 1, 1]
    assert d.observe({0: normal(rng)}, {}, "a") == []
    assert d.observe({0: skewed}, {}, "b") == []  # one window of baseline: too early to say
    assert "warming up" in d.status()
    d2, rng = warmed()
    assert d2.observe({0: skewed}, {}, "c")
    assert d2.observe({0: [1, 0, 0, 0, 0, 0, 0, 0]}, {}, "d")  # too few tokens: the alert stays
    assert Detector().status() == "no window with traffic yet"


def test_thresholds_from_user_config():
    th = Thresholds.from_dict({"entropyFloor": 0.2, "surgeFactor": 5.0, "warmupWindows": 1})
    assert (th.entropy_floor, th.surge_factor, th.warmup_windows) == (0.2, 5.0, 1)
    with pytest.raises(ValueError, match="entropyFlor"):
        Thresholds.from_dict({"entropyFlor": 0.2})


def test_key_ids_and_attribution():
    assert key_id(None) == key_id("Basic x") == key_id("Bearer ") == ANONYMOUS
    assert key_id("Bearer sk-secret") == key_digest("sk-secret")[:8]
    assert attribute({}, 0, 1) == (ANONYMOUS, 0.0)
    assert attribute({"k1": {0: [0, 3]}, "k2": {0: [5, 1]}}, 0, 1) == ("k1", 0.75)


def test_the_anomaly_gauge_goes_to_zero_when_an_alert_clears_and_key_tokens_count_up():
    import types

    from moe_workers.serve.metrics import IngressMetrics

    m = IngressMetrics("app", "r1")
    seen = []
    m.enabled = True
    m.anomaly = types.SimpleNamespace(set=lambda v, tags: seen.append((v, tags["layer"], tags["expert"], tags["key"])))
    m.key_tokens = types.SimpleNamespace(inc=lambda v, tags: seen.append((v, tags["key"])))
    m.anomalies([{"layer": 1, "expert": 5, "kind": SURGE, "key": "k1"}])
    m.anomalies([])
    m.keys({"k1": 12, "-": 0})
    assert seen == [(1, "1", "5", "k1"), (0, "1", "5", "k1"), (12, "k1")]


def test_an_alert_keeps_naming_its_expert_while_it_still_qualifies():
    d, rng = warmed()
    both = normal(rng)
    both[2] += 1500
    both[6] += 1400
    [first] = [a for a in d.observe({0: both}, {}, "a") if a.kind == SURGE]
    swapped = list(both)
    swapped[2], swapped[6] = both[6], both[2]  # the other one leads now: the alert still names the first
    [again] = [a for a in d.observe({0: swapped}, {}, "b") if a.kind == SURGE]
    assert (again.expert, again.since) == (first.expert, "a")


def test_the_load_report_sets_each_window_against_the_baseline_before_it():
    """Expert health's VS BASE (`Detector.load_report`): the last window's shares beside the
    baseline before it; the first window is its own baseline; a window under min_tokens or a layer
    without traffic leaves the report as it was; an alerting layer's baseline stays frozen."""
    d = Detector(Thresholds(min_tokens=4, warmup_windows=1, baseline_weight=0.5))
    d.observe({0: [30, 10]}, None, "t0")
    assert d.load_report() == {"0": {"share": [0.75, 0.25], "baseline": [0.75, 0.25]}}
    d.observe({0: [10, 30], 1: [1, 1]}, None, "t1")  # layer 1: too few tokens to count
    assert d.load_report() == {"0": {"share": [0.25, 0.75], "baseline": [0.75, 0.25]}}
    d.observe({0: [20, 20]}, None, "t2")
    assert d.load_report()["0"] == {"share": [0.5, 0.5], "baseline": pytest.approx([0.5, 0.5])}
