"""Where an application stands after the REST backend applied it, read once from Serve's status
(`rest_backend.app_state`, pure), and which Events a pass posts (`reconcile.outcome_events`, pure).
Serve's own words as in tests/unit/test_kuberay_status.py."""

from __future__ import annotations

from moe_operator.api import conditions as cond
from moe_operator.backends.rest_backend import DEPLOYING_RETRY_S, app_state
from moe_operator.reconcile import Result, outcome_events

APP = "default.kr"
NOW = 1_796_000_000.0
NOT_PLACED = ("Deployment 'Ingress' in application 'default.kr' has 1 replicas that have taken more than 30s to be "
              "scheduled. This may be due to waiting for the cluster to auto-scale or for a runtime environment to "
              "be installed. Resources required for each replica: {\"CPU\": 1.0}, total resources available: "
              "{\"CPU\": 0.99}. Use `ray status` for more details.")
START_FAILED = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor "
                "or initial health check failing. See controller logs for details. Error:\n"
                "ray::ServeReplica:default.kr:Ingress.initialize_and_get_metadata() (pid=4123, ip=10.0.0.5)\n"
                "ValueError: the KV cache budget holds no block")


def _cluster(status: str, deployments: dict | None = None, message: str = "") -> dict:
    return {"applications": {APP: {"status": status, "message": message, "deployments": deployments or {}}}}


def test_running_serves_and_deploying_is_under_way_with_a_short_retry():
    assert app_state(_cluster("RUNNING"), APP, [], NOW).ready
    for status in ("DEPLOYING", "NOT_STARTED"):
        s = app_state(_cluster(status), APP, [], NOW)
        assert not s.ready and s.reason == cond.DEPLOYING and s.retry_s == DEPLOYING_RETRY_S and not s.warning
        assert s.progress == f"application {APP} is {status}"
    s = app_state({"applications": {}}, APP, [], NOW)  # applied, not listed yet
    assert s.reason == cond.DEPLOYING


def test_an_app_that_served_stays_ready_while_a_change_rolls_out():
    serving = cond.set_condition([], cond.READY, True, cond.SERVING, "m", 1)
    s = app_state(_cluster("DEPLOYING"), APP, serving, NOW)
    assert s.ready and s.reason == cond.DEPLOYING and s.progress and s.retry_s == DEPLOYING_RETRY_S


def test_failures_are_warnings_with_their_reason_and_retry():
    s = app_state(_cluster("DEPLOY_FAILED", {"Ingress": {"status": "UNHEALTHY", "message": START_FAILED}}), APP, [], NOW)
    assert (s.ready, s.reason, s.retry_s, s.warning) == (False, cond.REPLICA_START_FAILED, 30, True)
    assert s.message == (f"replicas of {APP} fail in their constructor: Ingress: ValueError: the KV cache budget "
                         "holds no block; retrying in 30 s")
    s = app_state(_cluster("DEPLOY_FAILED", message="import failed"), APP, [], NOW)
    assert (s.reason, s.retry_s, s.warning) == (cond.DEPLOY_FAILED, 30, True) and "import failed" in s.message
    s = app_state(_cluster("DEPLOYING", {"Ingress": {"status": "UPDATING", "message": NOT_PLACED}}), APP, [], NOW)
    assert (s.reason, s.retry_s, s.warning) == (cond.UNSCHEDULABLE, 15, True)
    assert s.message.startswith(f"Ray cannot place every replica of {APP}: Ingress:")


def test_a_start_failure_backs_off_as_long_as_ready_has_been_false():
    failing = [{"type": cond.READY, "status": "False", "reason": cond.REPLICA_START_FAILED,
                "lastTransitionTime": "2026-11-30T00:00:00Z"}]
    s = app_state(_cluster("DEPLOY_FAILED", {"Ingress": {"status": "UNHEALTHY", "message": START_FAILED}}), APP,
                  failing, NOW)
    assert s.retry_s == 300 and s.message.endswith("retrying in 300 s")


def _status(generation: int, ok: bool, reason: str) -> dict:
    return {"observedGeneration": generation,
            "conditions": cond.set_condition([], cond.READY, ok, reason, "m", generation, now="2026-12-07T00:00:00Z")}


def test_a_pass_posts_its_outcome_only_when_it_is_news():
    deploying = Result(_status(2, False, cond.DEPLOYING), ("Normal", cond.DEPLOYING, "m"), 2)
    assert outcome_events({}, deploying) == [deploying.event]  # the first outcome
    assert outcome_events(_status(2, False, cond.DEPLOYING), deploying) == []  # retried while Ray deploys
    assert outcome_events(_status(1, False, cond.DEPLOYING), deploying) == [deploying.event]  # a new generation
    serving = Result(_status(2, True, cond.SERVING), ("Normal", cond.SERVING, "m"), None, True,
                     events=[("Normal", cond.HOT_SWAP_SERVING, "expert 1.1")])
    assert outcome_events(_status(2, False, cond.DEPLOYING), serving) == [serving.event] + serving.events
    assert outcome_events(_status(2, True, cond.SERVING), serving) == serving.events  # steady: only what happened
