"""The Ray REST backend writes only on a change: on a real local Ray, the passes while Serve deploys
and every pass of an unchanged spec after make no Serve config PUT; a changed spec makes exactly one. And
scaling the Ingress applies in place: the shard replicas keep running (same processes) while the
admission gate's capacity follows the new count."""

from __future__ import annotations

import pytest
import requests

from manifests import small_deployment
from moe_operator.backends.ray_rest import RayServeClient
from moe_operator.reconcile import ObjectRef, reconcile, remove_application
from passes import converge
from moe_operator.names import app_name
from moe_operator.settings import Settings
from moe_workers.model.random_init import write_random_mixtral

pytestmark = pytest.mark.ray


def test_steady_passes_make_no_put(ray_head, tmp_path):
    model = write_random_mixtral(tmp_path / "tiny", num_layers=2, num_experts=4, hidden_size=32,
                                 intermediate_size=64, vocab_size=128)
    spec = small_deployment("steady", str(model), groups=2, num_cpus=0.1, autoscaling={"mode": "Off"},
                            route_prefix="/steady")["spec"]
    client = RayServeClient(ray_head.dashboard_url, ray_head.token)
    port = ray_head.serve_http_port
    settings = Settings(allowed_roots=(str(tmp_path),), serve_http_port=port)
    try:
        first = converge(ObjectRef("default", "steady", 1), spec, {}, client, settings)
        assert first.ready and first.passes > 1, first.event  # the first pass applied and did not wait
        assert client.puts == 1
        cluster_before = client.get()["applications"][app_name("default", "steady")]
        for _ in range(3):
            again = reconcile(ObjectRef("default", "steady", 1), spec, first.status, client, settings)
            assert again.ready, again.event
        assert client.puts == 1  # the cluster already ran exactly this config
        cluster_after = client.get()["applications"][app_name("default", "steady")]
        assert cluster_after["last_deployed_time_s"] == cluster_before["last_deployed_time_s"]

        changed = {**spec, "ingress": {**spec["ingress"], "maxBatchSize": 4}}
        res = converge(ObjectRef("default", "steady", 2), changed, first.status, client, settings)
        assert res.ready, res.event
        assert client.puts == 2
        deployed = client.get()["applications"][app_name("default", "steady")]["deployed_app_config"]
        assert deployed["args"]["max_batch_size"] == 4

        url = f"http://127.0.0.1:{port}/steady/moe/v1/status"
        before = requests.get(url, timeout=30).json()
        assert before["admission_capacity"] == 4 + deployed["args"]["max_queued_requests"]  # batch + queue, 1 replica
        scaled = {**changed, "ingress": {**changed["ingress"], "replicas": 2}}
        res = converge(ObjectRef("default", "steady", 3), scaled, res.status, client, settings)
        assert res.ready, res.event
        app = client.get()["applications"][app_name("default", "steady")]
        assert app["deployed_app_config"]["args"] == deployed["args"]  # nothing static changed
        ingress = app["deployments"]["Ingress"]
        assert sum(r["state"] == "RUNNING" for r in ingress["replicas"]) == 2
        after = requests.get(url, timeout=30).json()
        assert sorted(r["pid"] for r in after["replicas"]) == sorted(r["pid"] for r in before["replicas"])
        assert after["admission_capacity"] == 2 * before["admission_capacity"]
    finally:
        remove_application(client, app_name("default", "steady"), port)
