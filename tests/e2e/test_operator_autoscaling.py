"""Autoscaling through the kopf operator on the real apiserver + etcd and a local Ray: the
autoscale timer reads load from the app's own report (metrics source Direct without scrape URLs),
decides, writes status.autoscaling.target, and drives the make-before-break change through the
reconcile pass; the finished target is removed from status (merge patch with null) and an Event
records it. No request fails meanwhile."""

from __future__ import annotations

import json

import pytest
import requests

from checkpoints import make_skewed_mixtral
from load_clients import Load
from manifests import SKEW_AUTOSCALING, small_deployment
from operator_proc import Operator
from waiting import wait_for

pytestmark = pytest.mark.ray


def test_operator_rebalances_a_skewed_deployment(crd_installed, ray_head, tmp_path):
    k8s = crd_installed
    roots = tmp_path / "models"
    make_skewed_mixtral(roots / "skewed", num_local_experts=8, hot_experts=(0, 4))
    threshold = 1.5
    manifest = small_deployment("skewed", str(roots / "skewed"), groups=4, num_cpus=0.2, route_prefix="/skew",
                                autoscaling={**SKEW_AUTOSCALING, "imbalanceThreshold": threshold})
    log = open(tmp_path / "operator.log", "w+")
    op = Operator(k8s, ray_head, str(roots), log)
    op.start()
    try:
        k8s.kubectl("apply", "-f", "-", input=json.dumps(manifest))

        def status():
            return k8s.kubectl_json("get", "moed", "skewed").get("status") or {}

        st = wait_for(lambda: (s := status()).get("endpoint") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in s.get("conditions", [])) and s,
            timeout_s=300, what="Ready=True")
        endpoint = st["endpoint"].removesuffix("/v1")
        with Load(endpoint) as load:
            done = wait_for(lambda: (a := status().get("autoscaling") or {}).get("lastDecision") == "Rebalance"
                            and a.get("phase") == "Steady" and a, timeout_s=240, what="a rebalance to complete")
            assert "target" not in done and done["imbalanceBefore"] > threshold > done["imbalanceAfter"]
            wait_for(lambda: (i := status().get("imbalance")) is not None and i < threshold, timeout_s=120,
                     what="measured imbalance below the threshold")
        assert load.failed == 0, load.errors[:5]
        routed = requests.get(endpoint + "/moe/v1/status", timeout=30).json()["placement"]
        assert all(sum(e in es for es in routed.values()) >= 2 for e in ("0.0", "0.4", "1.0", "1.4")), routed
        reasons = {e["reason"] for e in k8s.kubectl_json(
            "get", "events", "--field-selector", "involvedObject.name=skewed")["items"]}
        assert {"RebalanceStarted", "Rebalanced"} <= reasons
        progressing = next(c for c in status()["conditions"] if c["type"] == "Progressing")
        assert progressing["status"] == "False"
        k8s.kubectl("delete", "moed", "skewed", "--wait=true", "--timeout=180s")
    finally:
        op.kill()
