"""Hot-swap on a real Ray under sustained concurrent load, with tiers smaller than the model.

Outputs are checked against in-process computations with the old and the new weights: requests
finished before the swap was asked for match the old ones, requests started after it served
everywhere match the new ones, and no request fails. Every bad swap leaves the old expert serving.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests
import torch
from safetensors.torch import save_file

from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.random_init import write_random_mixtral
from moe_workers.serve.config import AppArgs, serve_application
from moe_workers.store.versions import content_digest, file_sha256
from serve_rest import delete_all, deploy
from waiting import wait_for

pytestmark = pytest.mark.ray

LAYERS, EXPERTS, GROUPS = 2, 4, 2
SWAPPED = (1, 2)  # layer 1, expert 2: hosted by ExpertShard-0 (2 % 2 == 0)
EID = f"{SWAPPED[0]}.{SWAPPED[1]}"


@pytest.fixture(scope="module")
def setup(ray_head, tmp_path_factory):
    ray = ray_head.connect_driver(namespace="hotswap-test")
    from ray import serve

    root = tmp_path_factory.mktemp("hotswap")
    path = write_random_mixtral(root / "model", vocab_size=128, hidden_size=32, intermediate_size=64,
                                num_layers=LAYERS, num_experts=EXPERTS, num_heads=4, num_kv_heads=2, top_k=2,
                                max_position_embeddings=128, seed=5)
    weights_dir = root / "weights"
    weights_dir.mkdir()
    old = InProcessModel(path)
    original = {w: t.clone() for w, t in old.experts.weights[SWAPPED].items()}
    new_weights = {w: (t * 40).contiguous() for w, t in original.items()}  # large enough to change tokens
    swap_file = weights_dir / "expert-1.2-v2.safetensors"
    save_file({f"{w}.weight": t for w, t in new_weights.items()}, str(swap_file))
    new = InProcessModel(path)
    new.experts.weights[SWAPPED] = new_weights
    placement = {f"ExpertShard-{g}": [f"{l}.{e}" for l in range(LAYERS) for e in range(EXPERTS) if e % GROUPS == g]
                 for g in range(GROUPS)}
    one = old.cfg.expert_bytes
    # each shard hosts 4 experts; hot holds 2 (one layer's worth), warm 1: experts move under load
    tiers = {"hot_budget": 2 * one, "warm_budget": one, "cold_dir": str(root / "cold"), "idle_demotion_s": 0}
    args = AppArgs(model_path=str(path), served_model_name="m", num_groups=GROUPS, max_batch_size=8,
                   kv_cache_budget_bytes=8 * 2**20, max_queued_requests=64, allowed_weight_roots=[str(weights_dir)])

    def apply(overrides=None):
        deploy(ray_head, [serve_application("swap", "/", args, placement, tiers=tiers, overrides=overrides,
                                             prefetch_lookahead=1)])

    apply()
    shard = serve.get_deployment_handle("ExpertShard-0", app_name="swap")
    ctx = dict(url=f"http://127.0.0.1:{ray_head.serve_http_port}", old=old, new=new, apply=apply,
               status=lambda: shard.status.remote().result(), swap_file=swap_file, weights_dir=weights_dir,
               new_digest=content_digest(new_weights), old_digest=content_digest(original), root=root)
    try:
        yield ctx
    finally:
        delete_all(ray_head)
        ray.shutdown()


def complete(url, prompt, n=4):
    return requests.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0},
                         timeout=120)


def prompts(count, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (count,), generator=g)]


def test_swap_under_load_zero_failures_old_then_new(setup):
    url, old, new = setup["url"], setup["old"], setup["new"]
    pool = prompts(24, 1)
    want_old = {tuple(p): old.generate([p], 4, stop_at_eos=True)[0] for p in pool}
    want_new = {tuple(p): new.generate([p], 4, stop_at_eos=True)[0] for p in pool}
    assert sum(want_old[k] != want_new[k] for k in want_old) >= 4, "the new weights must change outputs"
    results, stop = [], threading.Event()
    swap_asked, swap_serving = [None], [None]

    def client(i):
        k = 0
        while not stop.is_set():
            p = pool[(i * 7 + k) % len(pool)]
            k += 1
            t0 = time.monotonic()
            try:
                r = complete(url, p)
                results.append((t0, time.monotonic(), p, r.status_code, r.json()["choices"][0]["token_ids"]
                                if r.status_code == 200 else r.text))
            except Exception as err:  # a failed request is a test failure, recorded as such
                results.append((t0, time.monotonic(), p, -1, repr(err)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(results) >= 100, timeout_s=300, what="100 requests before the swap")
        swap_asked[0] = time.monotonic()
        setup["apply"]({EID: {"path": str(setup["swap_file"]), "sha256": file_sha256(setup["swap_file"])}})
        wait_for(lambda: setup["status"]()["swaps"].get(EID, {}).get("outcome") == "Serving", timeout_s=120,
                 what="swap serving")
        swap_serving[0] = time.monotonic()
        n = len(results)
        wait_for(lambda: len(results) >= n + 100, timeout_s=300, what="100 requests after the swap")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    failed = [r for r in results if r[3] != 200]
    assert not failed, failed[:3]
    assert len(results) >= 200
    before = [r for r in results if r[1] < swap_asked[0]]
    after = [r for r in results if r[0] > swap_serving[0]]
    assert len(before) >= 100 and len(after) >= 100
    assert all(r[4] == want_old[tuple(r[2])] for r in before)
    bad = [(r[2], r[4], want_new[tuple(r[2])], want_old[tuple(r[2])]) for r in after if r[4] != want_new[tuple(r[2])]]
    assert not bad, (len(bad), len(after), bad[:3])
    status = setup["status"]()
    assert status["versions"][EID]["digest"] == setup["new_digest"]
    assert status["swaps"][EID]["duration_s"] > 0
    # tiers were exercised under that load and stayed within budget
    assert status["store"]["misses"]["hot"] > 0
    assert status["tiers"]["hot"]["bytes"] <= status["budgets"]["hot"]
    assert status["tiers"]["warm"]["bytes"] <= status["budgets"]["warm"]


def _bad_overrides(setup):
    wd, root = setup["weights_dir"], setup["root"]
    good = setup["swap_file"]
    old = setup["old"]
    w = {k: v.clone() for k, v in old.experts.weights[SWAPPED].items()}
    save_file({"w1.weight": w["w1"], "w2.weight": w["w2"][:, :8].contiguous(), "w3.weight": w["w3"]},
              str(wd / "shape.safetensors"))
    (wd / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    torch.save(w, wd / "pickled.pt")
    outside = root / "elsewhere"
    outside.mkdir(exist_ok=True)
    save_file({f"{k}.weight": v for k, v in w.items()}, str(outside / "x.safetensors"))
    return [
        ({"path": str(wd / "missing.safetensors")}, "no such file"),
        ({"path": str(wd / "shape.safetensors")}, "w2 has shape"),
        ({"path": str(good), "sha256": "f" * 64}, "sha256 is"),
        ({"path": str(wd / "junk.safetensors")}, "not a valid safetensors file"),
        ({"path": str(wd / "pickled.pt")}, "not a .safetensors file"),
        ({"path": str(outside / "x.safetensors")}, "outside the allowed weight roots"),
    ]


def test_bad_swaps_leave_the_serving_version_and_rollback_restores(setup):
    url = setup["url"]
    probe = prompts(6, 2)
    current = setup["status"]()["versions"][EID]["digest"]
    reference = setup["new"] if current == setup["new_digest"] else setup["old"]
    want = [reference.generate([p], 4, stop_at_eos=True)[0] for p in probe]
    for override, reason in _bad_overrides(setup):
        setup["apply"]({EID: override})
        wait_for(lambda: reason in setup["status"]()["swaps"].get(EID, {}).get("reason", ""), timeout_s=60,
                 what=f"swap refused with {reason!r}")
        rec = setup["status"]()["swaps"][EID]
        assert rec["outcome"] == "Failed" and reason in rec["reason"], rec
        assert setup["status"]()["versions"][EID]["digest"] == current
        assert [complete(url, p).json()["choices"][0]["token_ids"] for p in probe] == want
    # removing the override rolls back to the checkpoint's own version
    setup["apply"](None)
    wait_for(lambda: setup["status"]()["swaps"].get(EID, {}).get("outcome") == "RolledBack", timeout_s=60,
             what="rollback")
    assert setup["status"]()["versions"][EID]["digest"] == setup["old_digest"]
    old = setup["old"]
    assert [complete(url, p).json()["choices"][0]["token_ids"] for p in probe] == [old.generate([p], 4, stop_at_eos=True)[0] for p in probe]


def test_a_committed_swap_invalidates_cached_prefixes(setup):
    """A prompt whose blocks the Ingress cached under the old weights is computed anew once the
    swap serves (the KV of every later layer depends on the swapped expert): tokens equal a cold
    run on the new weights, and the prefix is cached again for the requests after it."""
    url, old, new = setup["url"], setup["old"], setup["new"]
    assert setup["status"]()["versions"][EID]["digest"] == setup["old_digest"]  # rolled back above
    g = torch.Generator().manual_seed(9)
    long = torch.randint(3, 128, (40,), generator=g).tolist()
    assert old.generate([long], 4, stop_at_eos=True)[0] != new.generate([long], 4, stop_at_eos=True)[0]

    def ask():
        body = complete(url, long).json()
        return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def weights():
        return requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]["kv"]["weights"]

    def board_serves_old():  # the Ingress resets its prefix cache when its status read sees the board change
        reps = requests.get(url + "/moe/v1/status", timeout=30).json()["replicas"]
        hosting = [r for r in reps if EID in (r.get("versions") or {})]
        return hosting and all(r["versions"][EID]["digest"] == setup["old_digest"] for r in hosting)

    # the rollback above is seen by the Ingress through the board, which lags the shard's own status
    wait_for(board_serves_old, timeout_s=60, what="the board to report the rolled-back version")
    ask()
    assert ask() == (old.generate([long], 4, stop_at_eos=True)[0], 32)
    before = weights()
    setup["apply"]({EID: {"path": str(setup["swap_file"]), "sha256": file_sha256(setup["swap_file"])}})
    wait_for(lambda: setup["status"]()["swaps"].get(EID, {}).get("outcome") == "Serving", timeout_s=120,
             what="swap serving")
    try:
        wait_for(lambda: weights() != before, timeout_s=60, what="the Ingress to see the new expert version")
    except AssertionError:
        channel = requests.get(url + "/moe/v1/status", timeout=30).json()["channel"]
        raise AssertionError(f"the Ingress did not see the swap; its channel: {channel}") from None
    want = new.generate([long], 4, stop_at_eos=True)[0]
    assert ask() == (want, 0)
    assert ask() == (want, 32)
    setup["apply"](None)
    wait_for(lambda: setup["status"]()["swaps"].get(EID, {}).get("outcome") == "RolledBack", timeout_s=60,
             what="rollback")


def test_tier_metrics_exported_in_prometheus_format(setup, ray_head):
    """Per-replica tier metrics reach Ray's metrics export (after the load test above moved experts)."""
    assert complete(setup["url"], [3, 4, 5]).status_code == 200
    wanted = ("ray_moe_tier_bytes{", "ray_moe_tier_experts{", "ray_moe_tier_budget_bytes{", "ray_moe_tier_hits",
              "ray_moe_tier_misses", "ray_moe_tier_promotion_seconds_bucket{", "ray_moe_tier_moved_bytes",
              "ray_moe_hotswaps", "ray_moe_prefetch_issued", "ray_moe_prefetch_hint_accuracy{")
    deadline = time.monotonic() + 90
    missing = wanted
    while time.monotonic() < deadline:
        text = requests.get(ray_head.metrics_url, timeout=10).text
        missing = [w for w in wanted if w not in text]
        if not missing:
            break
        time.sleep(2)
    assert not missing, missing
    hot = [l for l in text.splitlines() if l.startswith("ray_moe_tier_bytes{") and 'tier="hot"' in l
           and 'group="ExpertShard-0"' in l]
    one = setup["old"].cfg.expert_bytes
    assert hot and all(0 < float(l.rsplit(" ", 1)[1]) <= 2 * one for l in hot)  # within the hot budget


def test_expert_load_signals_from_the_ray_export(setup, ray_head):
    """The autoscaler's direct scrape of Ray's metrics export: per group and expert totals that
    grow with traffic, and rates over a window."""
    from moe_operator.autoscaling.signals import LoadWindow, ScrapeSource, group_load, imbalance

    source = ScrapeSource([ray_head.metrics_url], app="swap")  # other tests' apps share this Ray cluster
    window = LoadWindow(window_s=60)
    first = wait_for(lambda: source.expert_token_totals(), timeout_s=90, what="expert tokens exported")
    window.add(time.monotonic(), first)
    assert {g for g, _ in first} == {"ExpertShard-0", "ExpertShard-1"}
    assert all(eid.count(".") == 1 for _, eid in first)
    for p in prompts(8, 9):
        assert complete(setup["url"], p).status_code == 200
    before = sum(first.values())
    later = wait_for(lambda: (t := source.expert_token_totals()) and sum(t.values()) > before and t, timeout_s=90,
                     what="totals to grow")
    window.add(time.monotonic(), later)
    rates = window.window_rates()
    assert sum(rates.values()) > 0
    loads = group_load(rates, ["ExpertShard-0", "ExpertShard-1"])
    assert imbalance(loads) >= 1.0


def test_expert_load_through_a_real_prometheus(setup, ray_head, tmp_path):
    """The PromQL source against Debian's Prometheus scraping the local Ray: the same per-group,
    per-expert totals as the direct scrape, and the router's figures (entropy, activation rate,
    switching) queryable."""
    from conftest import _cache_bin
    from moe_operator.autoscaling.signals import MetricsUnavailable, PrometheusSource, ScrapeSource
    from prometheus_proc import Prometheus

    binary = _cache_bin() / "prometheus"
    assert binary.is_file(), "prometheus missing: run scripts/testenv install"
    prom = Prometheus(binary, tmp_path / "prom", [ray_head.metrics_url]).start()
    try:
        for p in prompts(6, 11):
            assert complete(setup["url"], p).status_code == 200
        # Ray's exporter serves every series of the session's earlier apps too (MBs of text by
        # now): a slow scrape is retried, not a failure
        direct = ScrapeSource([ray_head.metrics_url], app="swap", timeout_s=30)
        source = PrometheusSource(prom.url, app="swap")

        def agree():
            try:
                want, got = direct.expert_token_totals(), source.expert_token_totals()
            except MetricsUnavailable:
                return False
            return want and got == want and got

        totals = wait_for(agree, timeout_s=120, what="prometheus to hold the exported expert tokens")
        assert {g for g, _ in totals} == {"ExpertShard-0", "ExpertShard-1"}
        assert all(v > 0 for v in totals.values())
        assert PrometheusSource(prom.url, app="no-such-app").expert_token_totals() == {}
        def per_replica():
            rows = prom.query('sum by (group, replica) (ray_moe_replica_tokens_total{app="swap"})')
            return sum(float(r["value"][1]) for r in rows) == sum(totals.values()) and rows

        rows = wait_for(per_replica, timeout_s=60, what="tokens per replica adding up to the expert totals")
        assert {r["metric"]["group"] for r in rows} == {"ExpertShard-0", "ExpertShard-1"}
        for metric in ("ray_moe_routing_entropy", "ray_moe_activation_rate", "ray_moe_expert_switch_rate"):
            series = wait_for(lambda: prom.query(f'{metric}{{app="swap"}}'), timeout_s=60, what=metric)
            assert all(0.0 <= float(s["value"][1]) <= 1.0 for s in series), (metric, series)
        # the Grafana dashboard the chart ships: every query is valid PromQL, and those on the
        # workers' load, tiers and routing find their series under the names Ray exports
        import json
        from pathlib import Path

        dashboard = Path(__file__).resolve().parents[2] / "helm" / "moe-operator" / "dashboards" / "moe-operator.json"
        exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"] for t in p["targets"]]
        for expr in exprs:
            prom.query(expr)  # asserts the query is accepted
            if any(m in expr for m in ("expert_tokens", "tier_bytes", "tier_hits", "routing_entropy", "activation_rate",
                                       "kv_cache_blocks_used")):
                wait_for(lambda: prom.query(expr), timeout_s=60, what=f"series for the dashboard's {expr}")
    finally:
        prom.stop()
