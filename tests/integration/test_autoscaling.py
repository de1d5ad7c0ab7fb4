"""Autoscaling end to end on a real Ray (standalone mode, its embedded defaults: the local Ray's
metrics export scraped directly): a checkpoint whose routers send nearly every token to two
experts of one shard group; the imbalance is measured, a rebalance replicates and moves them
make-before-break, the imbalance falls below the threshold, and no request fails meanwhile."""

from __future__ import annotations

import json
import os

import pytest
import requests
import yaml

from checkpoints import make_mixtral, make_skewed_mixtral
from load_clients import Load
from manifests import SKEW_AUTOSCALING, small_deployment
from moe_operator.standalone.local_ray import free_port
from moectl_proc import MoectlUp, moectl as _moectl
from waiting import wait_for

pytestmark = pytest.mark.ray


def _status(env, name: str = "skewed") -> dict:
    return json.loads(_moectl("get", name, "--local", "-o", "json", env=env).stdout)["status"]


def _moectl_up(tmp_path, manifest: dict, env: dict) -> tuple[MoectlUp, str]:
    """`moectl up` of this manifest on its own 2-CPU local Ray; (the process, its base URL)."""
    f = tmp_path / f"{manifest['metadata']['name']}.yaml"
    f.write_text(yaml.safe_dump(manifest))
    port = free_port()
    return MoectlUp(f, port, env, tmp_path / "up.log", "--num-cpus", "2"), f"http://127.0.0.1:{port}"


def test_skewed_router_is_rebalanced_without_failed_requests(tmp_path):
    env = {**os.environ, "MOE_STATE_DIR": str(tmp_path / "state")}
    make_skewed_mixtral(tmp_path / "models" / "skewed", num_local_experts=8, hot_experts=(0, 4))
    threshold = 1.5
    manifest = small_deployment("skewed", "models/skewed", groups=4, num_cpus=0.25,
                                autoscaling={**SKEW_AUTOSCALING, "imbalanceThreshold": threshold})
    up, url = _moectl_up(tmp_path, manifest, env)
    try:
        up.wait_serving()
        before = requests.get(url + "/moe/v1/status", timeout=30).json()["placement"]
        assert any({"0.0", "0.4"} <= set(es) for es in before.values())  # both hot experts in one group
        with Load(url) as load:
            # measured above the threshold (one reading can be lower than the true ~3.7: the Ray
            # exports of different replicas are not taken at the same instant)
            skewed = wait_for(lambda: (lambda s: (s.get("imbalance") or 0) > threshold and s)(_status(env)),
                              timeout_s=120, what="the imbalance to be measured")
            # per layer: both layers route to the same group, so the worst is about as bad as the mean
            assert skewed["worstLayer"]["layer"] in (0, 1) and skewed["worstLayer"]["imbalance"] > threshold
            done = wait_for(lambda: (lambda s: (s.get("autoscaling") or {}).get("lastDecision") == "Rebalance"
                                     and s["autoscaling"].get("phase") == "Steady" and s)(_status(env)),
                            timeout_s=180, what="a rebalance to complete")
            auto = done["autoscaling"]
            assert auto["imbalanceBefore"] > threshold and auto["imbalanceAfter"] < threshold
            assert auto["movedCopies"] > 0 and "target" not in auto
            assert auto["slotsPerGroup"] == 3  # (8 experts + 4 spare copies) / 4 groups, per layer
            balanced = wait_for(lambda: (lambda s: s.get("imbalance") is not None and s["imbalance"] < threshold
                                         and s)(_status(env)), timeout_s=120, what="measured imbalance below threshold")
            # moectl rebalance: the operator decides now (any improvement the planner finds is applied)
            dry = _moectl("rebalance", "skewed", "--local", "--dry-run", env=env)
            assert "serving.moe.io/rebalance-requested" in dry.stdout
            r = _moectl("rebalance", "skewed", "--local", "--wait", "--timeout", "120", env=env)
            assert r.stdout.startswith(("rebalanced default/skewed: imbalance", "no rebalance:")), r.stdout
        assert load.failed == 0, load.errors[:5]
        assert load.ok > 20
        after = requests.get(url + "/moe/v1/status", timeout=30).json()
        routed = after["placement"]
        for es in routed.values():  # equal slots: at most 3 copies per group in each layer
            assert all(sum(e.startswith(f"{layer}.") for e in es) <= 3 for layer in (0, 1)), routed
        assert balanced["worstLayer"]["imbalance"] < threshold * 1.5, balanced["worstLayer"]
        for hot in ("0.0", "0.4", "1.0", "1.4"):
            assert sum(hot in es for es in routed.values()) >= 2, routed  # each hot expert replicated
        hosted = {}
        for r in after["replicas"]:
            hosted[r["group"]] = set(r["experts"])
        assert all(hosted[g] == set(es) for g, es in routed.items())  # old copies dropped
        assert "RebalanceStarted" in up.log() and "Rebalanced" in up.log()
        # routing figures are reported: two experts take nearly everything
        routing = after["routing"]
        assert routing["entropy"][0] < 0.5 and routing["activation_rate"] <= 0.5
        assert routing["co_selected"][0][:2] in (["0.0", "0.4"], ["1.0", "1.4"])
        assert balanced["groups"][0]["load"] >= 0
        assert _moectl("rebalance", "nope", "--local", env=env, check=False).returncode == 1
        wide = _moectl("get", "skewed", "--local", "-o", "wide", env=env).stdout
        assert "IMBALANCE" in wide and "Steady (last: " in wide  # Rebalance, or None when the request found nothing better
    finally:
        up.stop()


def test_replicas_scale_on_load_without_restarting_the_running_ones(tmp_path):
    """targetTokensPerSecondPerReplica: the busiest group serves more than one replica's worth, so
    every group goes to maxReplicasPerGroup; Serve adds replicas in place (the first replica of
    each group keeps its process) and requests keep succeeding."""
    env = {**os.environ, "MOE_STATE_DIR": str(tmp_path / "state")}
    make_mixtral(tmp_path / "models" / "even", num_local_experts=4)
    manifest = small_deployment("even", "models/even", groups=2, num_cpus=0.2, autoscaling={
        "mode": "Auto", "imbalanceThreshold": 50, "windowSeconds": 6, "cooldownSeconds": 0,
        "targetTokensPerSecondPerReplica": 5, "minReplicasPerGroup": 1, "maxReplicasPerGroup": 2,
        "metrics": {"scrapeIntervalSeconds": 2}})
    up, url = _moectl_up(tmp_path, manifest, env)
    try:
        up.wait_serving()

        def replicas():
            return {(r["group"], r["replica"]): r["pid"]
                    for r in requests.get(url + "/moe/v1/status", timeout=30).json()["replicas"]}

        first = wait_for(lambda: len(r := replicas()) == 2 and r, what="one replica per group reporting")
        with Load(url, clients=2) as load:
            st = wait_for(lambda: (lambda s: all(g.get("replicas") == 2 and g.get("readyReplicas") == 2
                                                 for g in s.get("groups") or [{}]) and s)(_status(env, "even")),
                          timeout_s=180, what="two replicas per group")
            now = wait_for(lambda: len(r := replicas()) == 4 and r, timeout_s=60, what="four replicas reporting")
        assert load.failed == 0, load.errors[:5]
        assert st["autoscaling"]["lastDecision"] == "ScaleUp" and st["autoscaling"]["lastSetReplicas"] == 2
        for key, pid in first.items():
            assert now.get(key) == pid  # the replicas that ran before still run, in the same process
        assert "ScaleUp" in up.log()
    finally:
        up.stop()
