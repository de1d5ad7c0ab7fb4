"""Each expert's share of its layer against its moving baseline (`serve.load_baseline`, pure)."""

import pytest

from moe_workers.serve.load_baseline import LoadBaseline


def test_the_baseline_is_the_average_of_the_windows_before_the_last():
    b = LoadBaseline(alpha=0.5)
    b.update([[30, 10], [0, 0]])  # the first window is its own baseline; a layer with no tokens is left out
    assert b.report() == {"0": {"share": [0.75, 0.25], "baseline": [0.75, 0.25]}}
    b.update([[10, 30], [0, 0]])
    assert b.report()["0"] == {"share": [0.25, 0.75], "baseline": [0.75, 0.25]}
    b.update([[20, 20], [5, 15]])
    r = b.report()
    assert r["0"]["share"] == [0.5, 0.5] and r["0"]["baseline"] == pytest.approx([0.5, 0.5])  # (0.75 + 0.25) / 2
    assert r["1"] == {"share": [0.25, 0.75], "baseline": [0.25, 0.75]}
