"""A replica that raises in its constructor reaches the user: on a real local Ray, the condition
names the deployment and the exception (Serve keeps it in the deployment's message, never in the
application's), the retry backs off, and a fixed spec deploys at once."""

from __future__ import annotations

import pytest

from manifests import small_deployment
from moe_operator.api import conditions as cond
from moe_operator.backends.ray_rest import RayServeClient
from moe_operator.names import app_name
from moe_operator.reconcile import ObjectRef, remove_application
from passes import converge
from moe_operator.settings import Settings
from moe_workers.model.random_init import write_random_mixtral

pytestmark = pytest.mark.ray


def test_a_constructor_error_is_the_condition_and_a_fixed_spec_deploys(ray_head, tmp_path):
    model = write_random_mixtral(tmp_path / "tiny", num_layers=2, num_experts=4, hidden_size=32,
                                 intermediate_size=64, vocab_size=128)
    (model / "tokenizer.json").write_text("this is not a tokenizer")  # nothing before deploying reads it
    spec = small_deployment("broken", str(model), groups=2, num_cpus=0.1, autoscaling={"mode": "Off"},
                            route_prefix="/broken")["spec"]
    client = RayServeClient(ray_head.dashboard_url, ray_head.token)
    port = ray_head.serve_http_port
    settings = Settings(allowed_roots=(str(tmp_path),), serve_http_port=port)
    try:
        res = converge(ObjectRef("default", "broken", 1), spec, {}, client, settings)
        ready = next(c for c in res.status["conditions"] if c["type"] == cond.READY)
        assert not res.ready and ready["reason"] == cond.REPLICA_START_FAILED, ready
        assert "replicas of default.broken fail in their constructor: Ingress: Exception:" in ready["message"]
        assert ready["message"].endswith("retrying in 30 s") and res.retry_after_s == 30
        assert res.event[0] == "Warning"

        (model / "tokenizer.json").unlink()  # the fix: token ids only
        fixed = {**spec, "ingress": {**spec["ingress"], "maxBatchSize": 4}}
        res = converge(ObjectRef("default", "broken", 2), fixed, res.status, client, settings)
        assert res.ready, res.event
    finally:
        remove_application(client, app_name("default", "broken"), port)
