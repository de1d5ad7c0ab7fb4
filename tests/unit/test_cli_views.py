"""moectl's live views from an app report (pure)."""

from moe_operator.cli.views import expert_rows, heatmap, load_grid


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
    assert (layers, experts) == (2, 2) and grid == [[16, 3], [3, 0]]
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
