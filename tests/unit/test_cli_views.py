"""moectl's live views from an app report (pure), at a toy shape and at DeepSeek-V3's (58 MoE
layers after 3 dense ones, 256 routed experts each: 14,848 experts on 32 shard groups)."""

import random

import pytest
from rich.console import Console

from moe_operator.cli.views import (expert_rows, heatmap, layer_summary, load_grid, parse_layers, select_rows,
                                    summary_table)


def report():
    def v(tier, tokens, digest="sha256:aa", source="checkpoint"):
        return {"tier": tier, "tokens": tokens, "digest": digest, "source": source}

    return {"replicas": [
        {"group": "ExpertShard-0", "replica": "a", "versions": {"0.0": v("hot", 10), "1.0": v("warm", 1)}},
        {"group": "ExpertShard-0", "replica": "b", "versions": {"0.0": v("hot", 5), "1.0": v("cold", 2)}},
        {"group": "ExpertShard-1", "replica": "c", "versions": {"0.1": v("hot", 3, "sha256:bb", "/w/x.safetensors"),
                                                                "1.1": v("source", 0), "0.0": v("warm", 1, "sha256:cc")}},
    ]}


def test_expert_rows_aggregate_replicas():
    rows = {r["expert"]: r for r in expert_rows(report())}
    assert list(rows) == ["0.0", "0.1", "1.0", "1.1"]
    assert rows["0.0"]["groups"] == ["ExpertShard-0", "ExpertShard-1"] and rows["0.0"]["replicas"] == 3
    assert rows["0.0"]["tiers"] == {"hot": 2, "warm": 1} and rows["0.0"]["version"] == "mixed"
    assert rows["0.0"]["tokens"] == 16
    assert rows["0.1"]["override"] and rows["0.1"]["version"] == "sha256:bb"
    assert not rows["1.0"]["override"] and rows["1.0"]["tiers"] == {"cold": 1, "warm": 1}


def test_load_grid_and_heatmap_imbalance():
    grid, layers, experts = load_grid(report())
    assert (layers, experts) == ([0, 1], 2) and grid == [[16, 3], [3, 0]]
    table = heatmap(grid, "t")
    assert table.row_count == 2
    imbalance = table.columns[-1]._cells
    assert imbalance == [f"{16 / 9.5:.2f}", f"{3 / 1.5:.2f}"]


def test_replica_progress_of_a_swap():
    from moe_operator.cli.views import replica_progress

    path = "/w/new.safetensors"
    rep = {"replicas": [
        {"group": "ExpertShard-1", "replica": "aaaaaaaaaa",
         "versions": {"1.1": {"source": path, "digest": "sha256:1234567890abcdef"}}},
        {"group": "ExpertShard-1", "replica": "bbbbbbbbbb",
         "versions": {"1.1": {"source": "checkpoint", "digest": "sha256:feedfeedfeed"}},
         "swaps": {"1.1": {"path": path, "outcome": "Failed", "reason": "sha256 is x"}}},
        {"group": "ExpertShard-2", "replica": "cccccccccc",
         "versions": {"1.1": {"source": "checkpoint", "digest": "sha256:feedfeedfeed"}}},
        {"group": "ExpertShard-0", "replica": "dddddddddd", "versions": {"0.0": {"source": "checkpoint"}}},
    ]}
    assert replica_progress(rep, "1.1", path) == [
        ("ExpertShard-1/aaaaaaaa", "serving sha256:1234567890ab"),
        ("ExpertShard-1/bbbbbbbb", "refused: sha256 is x"),
        ("ExpertShard-2/cccccccc", "waiting (serving sha256:feedfeedfeed)")]
    assert replica_progress(rep, "1.1", None)[2] == ("ExpertShard-2/cccccccc", "back on the checkpoint")


def deepseek_report(seed=0):
    """What 32 shard groups report for DeepSeek-V3's 14,848 routed experts: tokens drawn heavy-tailed."""
    rng = random.Random(seed)
    replicas = [{"group": f"ExpertShard-{g}", "replica": f"r{g}", "versions": {}} for g in range(32)]
    for layer in range(3, 61):
        for e in range(256):
            tier = "hot" if e % 4 else "warm"
            replicas[(layer * 7 + e) % 32]["versions"][f"{layer}.{e}"] = {
                "tier": tier, "tokens": int(rng.paretovariate(1.2) * 10), "digest": "sha256:aa", "source": "checkpoint"}
    return {"replicas": replicas}


def _lines(table, width):
    console = Console(width=width, record=True, color_system=None)
    console.print(table)
    return console.export_text().splitlines()


def test_the_heatmap_of_a_deepseek_sized_model_fits_the_terminal_and_names_the_busiest():
    rep = deepseek_report()
    grid, layers, experts = load_grid(rep)
    assert layers == list(range(3, 61)) and experts == 256  # the dense layers 0-2 have no row
    for width in (120, 200):
        table = heatmap(grid, "t", layers, width)
        lines = _lines(table, width)
        assert max(len(line) for line in lines) <= width and table.row_count == 58
        busiest = table.columns[2]._cells
        for layer, row, cell in zip(layers, grid, busiest):
            e = max(range(256), key=lambda k: row[k])
            assert cell == f"{layer}.{e} {100 * row[e] / sum(row):.1f}%"
    # a toy shape keeps one column an expert, with its count
    assert len(heatmap([[1, 2], [3, 4]], "t").columns) == 4


def test_moectl_experts_at_deepseek_scale_summarises_layers_and_filters_experts():
    rows = expert_rows(deepseek_report())
    assert len(rows) == 14_848
    summary = layer_summary(rows)
    assert [s["layer"] for s in summary] == list(range(3, 61))
    assert all(s["experts"] == 256 and s["copies"] == 256 and s["tiers"] == {"hot": 192, "warm": 64} for s in summary)
    assert sum(s["tokens"] for s in summary) == sum(r["tokens"] for r in rows)
    lines = _lines(summary_table(summary, sum(r["tokens"] for r in rows)), 120)
    assert len(lines) == 59 and max(len(line) for line in lines) <= 120  # a header and a row a layer
    by_id = {r["expert"]: r for r in rows}
    assert all(by_id[s["hottest"]]["tokens"] == max(r["tokens"] for r in rows if r["expert"].startswith(f"{s['layer']}."))
               for s in summary)

    assert {r["expert"].split(".")[0] for r in select_rows(rows, parse_layers("3-4,60"))} == {"3", "4", "60"}
    assert len(select_rows(rows, parse_layers("3-4,60"))) == 3 * 256
    mine = select_rows(rows, None, "5")
    assert mine and all(r["groups"] == ["ExpertShard-5"] for r in mine)
    assert select_rows(rows, None, "ExpertShard-5") == mine
    top = select_rows(rows, {10}, None, top=5)
    assert [r["tokens"] for r in top] == sorted((r["tokens"] for r in rows if r["expert"].startswith("10.")),
                                                reverse=True)[:5]


@pytest.mark.parametrize("text", ["", "a", "5-3", "3-", "-2", "1,,2"])
def test_a_bad_layer_selection_names_the_part(text):
    with pytest.raises(ValueError, match="is not a layer or a range of layers"):
        parse_layers(text)


def health_report():
    rep = report()
    rep["replicas"][0]["health"] = {"0.0": {"p95_ms": 0.4, "samples": 5, "misses": 2, "errors": 0},
                                    "1.0": {"p95_ms": None, "samples": 0, "misses": 1, "errors": 1}}
    rep["replicas"][1]["health"] = {"0.0": {"p95_ms": 0.9, "samples": 3, "misses": 0, "errors": 0}}
    rep["routing"] = {"load": {"0": {"share": [0.7, 0.3], "baseline": [0.5, 0.5]},
                               "1": {"share": [0.9, 0.1], "baseline": [0.9, 0.0]}}}
    return rep


def test_expert_rows_carry_health_over_replicas_and_load_against_its_baseline():
    from moe_operator.cli.views import load_vs_baseline

    rows = {r["expert"]: r for r in expert_rows(health_report())}
    assert (rows["0.0"]["p95_ms"], rows["0.0"]["samples"], rows["0.0"]["misses"]) == (0.9, 8, 2)  # slowest replica
    assert (rows["1.0"]["p95_ms"], rows["1.0"]["misses"], rows["1.0"]["errors"]) == (None, 1, 1)
    assert rows["0.1"]["p95_ms"] is None and rows["0.1"]["misses"] == 0  # a replica with no health yet
    assert [load_vs_baseline(rows[e]) for e in ("0.0", "0.1", "1.0", "1.1")] == ["1.40x", "0.60x", "1.00x", "new"]
    assert load_vs_baseline(expert_rows(report())[0]) == "-"  # no routing window yet


def test_tail_lists_the_least_loaded_first_then_the_slowest():
    rows = expert_rows(health_report())
    assert [r["expert"] for r in select_rows(rows, tail=3)] == ["1.1", "0.1", "0.0"]
    assert [r["expert"] for r in select_rows(rows, layers={0}, tail=5)] == ["0.1", "0.0"]
    # equal shares: the slower p95, then more misses, first
    same = [{**r, "share": 0.5} for r in rows]
    assert [r["expert"] for r in select_rows(same, tail=2)] == ["1.1", "1.0"]  # fewest tokens first
