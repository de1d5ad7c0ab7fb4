"""Live app report -> MoEDeployment status fields (pure)."""

from moe_operator.api.validation import parse_spec
from moe_operator.cli.get import kv_columns
from moe_operator.observe import summarise, swap_transitions, swaps_settled

PATH = "/weights/e-1.2.safetensors"


def spec(overrides=()):
    return parse_spec({
        "model": {"path": "/models/m"},
        "experts": {"groups": 2, "tiers": {"hot": {"budget": "1Gi"}, "warm": {"budget": "1Gi"}},
                    "overrides": [{"expert": e, "weights": {"path": p}} for e, p in overrides]},
    })


def replica(name, group, versions, swaps=None, hot=(1, 100), warm=(2, 200), cold=(3, 300)):
    return {"replica": name, "group": group, "versions": versions, "swaps": swaps or {},
            "tiers": {"hot": {"experts": hot[0], "bytes": hot[1]}, "warm": {"experts": warm[0], "bytes": warm[1]},
                      "cold": {"experts": cold[0], "bytes": cold[1]}}}


def v(source="checkpoint", digest="sha256:old"):
    return {"source": source, "digest": digest, "tier": "hot", "tokens": 0}


def swap(outcome, path=PATH, reason="", duration=0.2, started="2026-11-29T10:00:00Z"):
    return {"outcome": outcome, "path": path, "reason": reason, "duration_s": duration, "started_at": started}


def test_serving_on_every_replica():
    reps = [replica("a", "ExpertShard-0", {"1.2": v(PATH, "sha256:new")}, {"1.2": swap("Serving", duration=0.3)}),
            replica("b", "ExpertShard-0", {"1.2": v(PATH, "sha256:new")}, {"1.2": swap("Serving", duration=0.5)}),
            replica("c", "ExpertShard-1", {"1.3": v()})]
    out = summarise(spec([("1.2", PATH)]), {"replicas": reps}, {})
    assert out["lastSwaps"] == [{"expert": "1.2", "outcome": "Serving", "digest": "sha256:new",
                                 "startedAt": "2026-11-29T10:00:00Z", "durationSeconds": 0.5}]
    assert out["overriddenExperts"] == 1
    assert out["tiers"] == {"hot": {"experts": 3, "bytes": 300}, "warm": {"experts": 6, "bytes": 600},
                            "cold": {"experts": 9, "bytes": 900}}
    assert swaps_settled(out)


def test_pending_until_every_replica_serves():
    reps = [replica("a", "ExpertShard-0", {"1.2": v(PATH, "sha256:new")}, {"1.2": swap("Serving")}),
            replica("b", "ExpertShard-0", {"1.2": v()})]
    out = summarise(spec([("1.2", PATH)]), {"replicas": reps}, {})
    assert out["lastSwaps"][0]["outcome"] == "Pending"
    assert out["lastSwaps"][0]["reason"] == "serving on 1 of 2 replicas"
    assert not swaps_settled(out)


def test_failure_names_the_replica_and_reason():
    reps = [replica("a", "ExpertShard-0", {"1.2": v()}, {"1.2": swap("Failed", reason="w2 has shape (3, 3)")}),
            replica("b", "ExpertShard-0", {"1.2": v()})]
    out = summarise(spec([("1.2", PATH)]), {"replicas": reps}, {})
    rec = out["lastSwaps"][0]
    assert rec["outcome"] == "Failed" and rec["reason"] == "ExpertShard-0 replica a: w2 has shape (3, 3)"
    assert out["overriddenExperts"] == 0


def test_an_old_failure_of_another_file_does_not_count():
    reps = [replica("a", "ExpertShard-0", {"1.2": v()}, {"1.2": swap("Failed", path="/weights/old.safetensors")})]
    out = summarise(spec([("1.2", PATH)]), {"replicas": reps}, {})
    assert out["lastSwaps"][0]["outcome"] == "Pending"


def test_rollback_after_the_override_is_removed_and_history_kept():
    previous = [{"expert": "1.2", "outcome": "Serving", "startedAt": "2026-11-29T10:00:00Z"},
                {"expert": "0.1", "outcome": "Failed", "reason": "x", "startedAt": "2026-11-29T09:00:00Z"}]
    reps = [replica("a", "ExpertShard-0", {"1.2": v()}, {"1.2": swap("RolledBack", path="checkpoint",
                                                                     started="2026-11-29T11:00:00Z")})]
    out = summarise(spec(), {"replicas": reps}, {"lastSwaps": previous})
    assert [(r["expert"], r["outcome"]) for r in out["lastSwaps"]] == [("1.2", "RolledBack"), ("0.1", "Failed")]


def test_transitions_post_one_event_per_outcome():
    before = [{"expert": "1.2", "outcome": "Pending"}]
    after = [{"expert": "1.2", "outcome": "Serving", "digest": "sha256:new", "durationSeconds": 0.5},
             {"expert": "0.1", "outcome": "Failed", "reason": "sha256 is abc"}]
    events = swap_transitions(before, after)
    assert [e[1] for e in events] == ["HotSwapServing", "HotSwapFailed"]
    assert swap_transitions(after, after) == []


def test_the_ingress_kv_cache_is_summarised_into_status_and_moectl_get():
    kv = {"block_size": 16, "blocks_total": 100, "blocks_used": 25, "max_sequence_tokens": 1600, "bytes": 1,
          "block_bytes": 1, "prefix_caching": True, "prefix_queried_tokens": 400, "prefix_hit_tokens": 300,
          "prefix_cached_blocks": 3, "preemptions": 2, "chunked_prefills": 5, "max_num_batched_tokens": 512}
    status = summarise(spec(), {"replicas": [], "ingress": {"kv": kv}}, {})
    assert status["kvCache"] == {"blockSize": 16, "blocksTotal": 100, "blocksUsed": 25, "maxSequenceTokens": 1600,
                                 "prefixHitRate": 0.75, "preemptions": 2, "chunkedPrefills": 5}
    assert kv_columns(status["kvCache"]) == ["25/100 x16", "75%", "2"]
    none_queried = summarise(spec(), {"replicas": [], "ingress": {"kv": {**kv, "prefix_queried_tokens": 0}}}, {})
    assert "prefixHitRate" not in none_queried["kvCache"] and kv_columns(none_queried["kvCache"])[1] == ""
    assert "kvCache" not in summarise(spec(), {"replicas": []}, {}) and kv_columns(None) == ["", "", ""]


def test_status_says_which_attention_path_decode_runs_and_why_it_left_flex():
    kv = {"block_size": 16, "blocks_total": 100, "blocks_used": 25, "max_sequence_tokens": 1600,
          "prefix_queried_tokens": 0, "prefix_hit_tokens": 0}
    flex = {"configured": "flex", "running": "flex", "fallbacks": 0, "error": ""}
    ran = summarise(spec(), {"replicas": [], "ingress": {"kv": {**kv, "attention": flex}}}, {})
    assert ran["kvCache"]["attention"] == "flex"
    failed = {"configured": "flex", "running": "gather", "fallbacks": 1, "error": "InductorError: no kernel"}
    fell = summarise(spec(), {"replicas": [], "ingress": {"kv": {**kv, "attention": failed}}}, {})
    assert fell["kvCache"]["attention"] == "gather (flex failed: InductorError: no kernel)"


def test_tiers_carry_one_experts_bytes_in_each_tiers_form():
    """A quantized app's warm and cold tiers hold the stored form: status says its bytes and the
    ratio to the compute dtype, as the replicas report them."""
    rep = replica("a", "ExpertShard-0", {"1.2": v()})
    for tier, form, n, ratio in (("hot", "compute", 1000, 1.0), ("warm", "stored", 265, 0.265), ("cold", "stored", 264, 0.264)):
        rep["tiers"][tier].update(form=form, expert_bytes=n, vs_compute=ratio)
    rep["tiers"]["hot"]["decoder"] = "native (avx512)"
    tiers = summarise(spec(), {"replicas": [rep, replica("b", "ExpertShard-1", {})]}, {})["tiers"]
    assert tiers["warm"] == {"experts": 4, "bytes": 400, "form": "stored", "expertBytes": 265, "vsCompute": 0.265}
    assert tiers["hot"]["form"] == "compute" and tiers["cold"]["vsCompute"] == 0.264
    assert tiers["hot"]["decoder"] == "native (avx512)" and "decoder" not in tiers["warm"]
