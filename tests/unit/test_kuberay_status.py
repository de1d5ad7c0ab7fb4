"""The RayService status mapped to the MoEDeployment's conditions (no cluster).

Each status below is written the way KubeRay (1.3 and later; 1.5.0 seen on the test node) writes it: conditions with its
reasons, `observedGeneration`, and the Serve applications per cluster under
`activeServiceStatus` / `pendingServiceStatus` as the Ray dashboard reports them.
"""

from __future__ import annotations

import pytest

from moe_operator.api import conditions as cond
from moe_operator.backends.kuberay_status import service_state

APP = "default.kr"
HEALTHY = {"Ingress": {"status": "HEALTHY"}, "ExpertShard-0": {"status": "HEALTHY"},
           "ExpertShard-1": {"status": "HEALTHY"}}


def rs(status: dict, generation: int = 2) -> dict:
    return {"metadata": {"name": "kr", "namespace": "default", "generation": generation}, "status": status}


def ready(status: str, reason: str, message: str = "") -> dict:
    return {"type": "Ready", "status": status, "reason": reason, "message": message, "observedGeneration": 2,
            "lastTransitionTime": "2026-11-30T00:00:00Z"}


def upgrade(status: str, reason: str) -> dict:
    return {"type": "UpgradeInProgress", "status": status, "reason": reason, "message": "",
            "observedGeneration": 2, "lastTransitionTime": "2026-11-30T00:00:00Z"}


def active(app_status: str, deployments: dict | None = None, message: str = "", cluster: str = "kr-x7k2p") -> dict:
    return {"rayClusterName": cluster, "applicationStatuses": {APP: {
        "status": app_status, "message": message, "serveDeploymentStatuses": deployments or {}}}}


def running_status(**overrides) -> dict:
    status = {"observedGeneration": 2, "serviceStatus": "Running", "numServeEndpoints": 1,
              "conditions": [ready("True", "NonZeroServeEndpoints", "Number of serve endpoints is greater than 0"),
                             upgrade("False", "NoPendingCluster")],
              "activeServiceStatus": active("RUNNING", HEALTHY)}
    status.update(overrides)
    return status


def test_running_with_every_deployment_healthy_is_ready():
    s = service_state(rs(running_status()), APP)
    assert s.ready and s.reason == cond.SERVING and not s.degraded and not s.progressing


def test_fresh_rayservice_without_status_waits_for_kuberay():
    s = service_state(rs({}, generation=1), APP)
    assert not s.ready and s.reason == cond.WAITING_FOR_KUBERAY and s.progressing
    assert "generation 1" in s.message


def test_initializing_cluster_before_the_app_is_reported_is_deploying():
    status = {"observedGeneration": 2, "conditions": [
        ready("False", "Initializing", "Waiting for the RayCluster to become ready"), upgrade("False", "Initializing")],
        "activeServiceStatus": {}, "pendingServiceStatus": {}}
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.DEPLOYING and s.progressing
    assert "Initializing" in s.message


def test_deploying_app_with_updating_deployments_is_deploying():
    status = running_status(conditions=[ready("False", "Initializing"), upgrade("False", "Initializing")],
                            activeServiceStatus=active("DEPLOYING", {**HEALTHY, "ExpertShard-1": {"status": "UPDATING"}}))
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.DEPLOYING and "ExpertShard-1" in s.message and not s.degraded


def test_failed_first_deploy_keeps_serves_message():
    msg = "Failed to import: ModuleNotFoundError: No module named 'moe_workers'"
    status = running_status(conditions=[ready("False", "Initializing", "Waiting for applications"),
                                        upgrade("False", "Initializing")],
                            activeServiceStatus=active("DEPLOY_FAILED", {}, msg))
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.DEPLOY_FAILED and "ModuleNotFoundError" in s.message
    assert not s.terminal  # KubeRay keeps trying; so do we


def test_failed_in_place_update_is_not_ready_although_kuberay_says_ready():
    # once the cluster has served, KubeRay's Ready stays True on endpoints alone
    status = running_status(activeServiceStatus=active("DEPLOY_FAILED", {**HEALTHY, "ExpertShard-1": {
        "status": "UNHEALTHY", "message": "replica failed its health check"}}, "Deploying ExpertShard-1 failed"))
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.DEPLOY_FAILED and "Deploying ExpertShard-1 failed" in s.message
    assert s.degraded.startswith("ExpertShard-1 UNHEALTHY")


def test_unhealthy_app_names_the_deployment():
    status = running_status(activeServiceStatus=active("UNHEALTHY", {**HEALTHY, "ExpertShard-0": {
        "status": "UNHEALTHY", "message": "The deployment failed to start 3 times in a row"}}))
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.UNHEALTHY
    assert s.degraded == "ExpertShard-0 UNHEALTHY: The deployment failed to start 3 times in a row"


def test_unhealthy_deployment_of_a_running_app_is_not_ready():
    status = running_status(activeServiceStatus=active("RUNNING", {**HEALTHY, "Ingress": {"status": "UNHEALTHY"}}))
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.UNHEALTHY and s.degraded == "Ingress UNHEALTHY"


def test_upgrade_in_progress_is_progressing_not_ready():
    status = running_status(conditions=[ready("True", "NonZeroServeEndpoints"),
                                        upgrade("True", "BothActivePendingClustersExist")],
                            pendingServiceStatus=active("DEPLOYING", {}, cluster="kr-9fz2q"))
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.UPGRADING and s.progressing
    assert "kr-9fz2q" in s.message and "DEPLOYING" in s.message


def test_a_pending_cluster_whose_app_failed_is_a_failed_deploy_not_an_upgrade():
    """A first deploy runs on a pending cluster too: its failure must surface (Warning, retried
    slowly) with Serve's message, not read as an upgrade in progress."""
    msg = "Failed to import: ModuleNotFoundError: No module named 'moe_workers'"
    for conditions in ([ready("False", "Initializing"), upgrade("True", "BothActivePendingClustersExist")],
                       [ready("False", "Initializing"), upgrade("False", "Initializing")]):
        status = running_status(conditions=conditions, activeServiceStatus={},
                                pendingServiceStatus=active("DEPLOY_FAILED", {}, msg, cluster="kr-9fz2q"))
        s = service_state(rs(status), APP)
        assert not s.ready and s.reason == cond.DEPLOY_FAILED and not s.progressing, s
        assert "kr-9fz2q" in s.message and "ModuleNotFoundError" in s.message


def test_a_first_cluster_comes_up_as_the_pending_one_and_that_is_deploying():
    """As KubeRay 1.5.0 wrote it on the test node (tests/e2e/test_kuberay_node.py): a new RayService's
    first cluster is the pending one, with no active cluster, UpgradeInProgress False/Initializing."""
    status = {"observedGeneration": 2,
              "conditions": [ready("False", "Initializing", "RayService is initializing"),
                             upgrade("False", "Initializing")],
              "pendingServiceStatus": active("DEPLOYING", {"Ingress": {"status": "UPDATING"}}, cluster="kr-zsmgg")}
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.DEPLOYING and s.progressing, s
    assert s.message == ("KubeRay is starting the Ray cluster kr-zsmgg of RayService kr; application DEPLOYING "
                         "(Initializing: RayService is initializing)")


def test_pending_cluster_without_the_condition_is_an_upgrade_too():
    status = running_status(pendingServiceStatus={"rayClusterName": "kr-9fz2q"})
    assert service_state(rs(status), APP).reason == cond.UPGRADING


def test_status_of_an_older_generation_is_not_concluded_from():
    s = service_state(rs(running_status(observedGeneration=2), generation=3), APP)
    assert not s.ready and s.reason == cond.WAITING_FOR_KUBERAY
    assert "generation 3" in s.message and "generation 2" in s.message


@pytest.mark.parametrize("reason", ["InitializingTimeout", "ValidationFailed"])
def test_terminal_kuberay_reasons_are_terminal(reason):
    msg = "RayService failed to become ready within the configured timeout of 10m0s"
    status = {"observedGeneration": 2, "conditions": [ready("False", reason, msg)],
              "activeServiceStatus": {}, "pendingServiceStatus": {}}
    s = service_state(rs(status), APP)
    assert not s.ready and s.terminal and s.reason == cond.DEPLOY_FAILED
    assert reason in s.message and msg in s.message
    # terminal even when a newer generation was written: KubeRay keeps it until the RayService changes
    assert service_state(rs(status, generation=5), APP).terminal


def test_running_app_without_serve_endpoints_is_not_ready():
    status = running_status(conditions=[ready("False", "ZeroServeEndpoints", "Number of serve endpoints dropped to 0"),
                                        upgrade("False", "NoPendingCluster")])
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.NO_SERVE_ENDPOINTS and "dropped to 0" in s.message


def test_another_apps_status_does_not_count_for_ours():
    status = running_status(activeServiceStatus={"rayClusterName": "kr-x", "applicationStatuses": {
        "other.app": {"status": "RUNNING", "serveDeploymentStatuses": HEALTHY}}})
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.DEPLOYING and APP in s.message


# Ray Serve's own words (deployment_state.py) for a replica its scheduler cannot place
NOT_PLACED = ("Deployment 'Ingress' in application 'default.kr' has 1 replicas that have taken more than 30s to be "
              "scheduled. This may be due to waiting for the cluster to auto-scale or for a runtime environment to "
              "be installed. Resources required for each replica: {\"CPU\": 1.0}, total resources available: "
              "{\"CPU\": 0.99}. Use `ray status` for more details.")


def test_a_replica_ray_cannot_place_is_unschedulable_with_what_it_needs_and_what_there_is():
    deployments = {**HEALTHY, "Ingress": {"status": "UPDATING", "message": NOT_PLACED}}
    s = service_state(rs(running_status(activeServiceStatus=active("DEPLOYING", deployments),
                                        conditions=[ready("False", "Initializing")])), APP)
    assert not s.ready and s.reason == cond.UNSCHEDULABLE
    assert 'Ingress: Resources required for each replica: {"CPU": 1.0}, total resources available: {"CPU": 0.99}' \
        in s.message and "ray status" not in s.message


def test_the_rest_backend_raises_unschedulable_from_the_same_message():
    from moe_operator.backends.serve_status import unschedulable, unschedulable_message

    app = {"status": "DEPLOYING", "deployments": {"Ingress": {"status": "UPDATING", "message": NOT_PLACED},
                                                   "ExpertShard-0": {"status": "UPDATING", "message": ""}}}
    assert [name for name, _ in unschedulable(app)] == ["Ingress"]
    assert unschedulable_message("default.kr", app).startswith("Ray cannot place every replica of default.kr: Ingress:")
    slow_init = {"deployments": {"Ingress": {"status": "UPDATING", "message": (
        "Deployment 'Ingress' in application 'x' has 1 replicas that have taken more than 30s to initialize.")}}}
    assert unschedulable_message("x", slow_init) is None  # placed, only slow: still Deploying
    # the same words for a worker slow to start while the CPUs are there (seen on a loaded
    # 2-core machine, 5 s after a redeploy): only slow, not unschedulable
    slow_start = {"deployments": {"ExpertShard-0": {"status": "UPDATING", "message": NOT_PLACED.replace(
        'total resources available: {"CPU": 0.99}', 'total resources available: {"CPU": 4.99}')}}}
    assert unschedulable(slow_start) == [] and unschedulable_message("x", slow_start) is None


def test_placement_group_bundles_are_summed_and_unreadable_figures_count_as_short():
    from moe_operator.backends.serve_status import short_of_resources

    def words(required, available):
        return (f"... to be scheduled. Resources required for each replica: {required}, total resources "
                f"available: {available}. Use `ray status` for more details.")
    assert short_of_resources(words('[{"CPU": 1.0}, {"CPU": 1.0}]', '{"CPU": 1.5}'))
    assert not short_of_resources(words('[{"CPU": 1.0}, {"CPU": 1.0}]', '{"CPU": 2.0}'))
    assert short_of_resources(words('{"CPU": 1.0, "GPU": 1.0}', '{"CPU": 8.0}'))  # no GPU at all
    assert short_of_resources(words("UNKNOWN", "UNKNOWN"))
    assert short_of_resources("has 1 replicas that have taken more than 5s to be scheduled")


# Serve's message for a deployment whose replicas raise in their constructor (ray 2.60's wording)
START_FAILED = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor "
                "or initial health check failing. See controller logs for details. Error:\n"
                "ray::ServeReplica:default.kr:Ingress.initialize_and_get_metadata() (pid=4123, ip=10.0.0.5)\n"
                '  File "/app/moe_workers/serve/ingress.py", line 120, in __init__\n'
                "    self.cache = PagedKVCache.for_budget(cfg, ...)\n"
                "moe_workers.model.family.CheckpointError: KV cache budget 67108864 bytes holds 15 blocks of 16 tokens "
                "(4096 bytes each); one sequence of 32768 tokens needs 2048 (8392704 bytes with the null block); "
                "raise kvCacheBudget or lower maxModelLen")


def test_a_replica_that_cannot_start_names_the_deployment_and_its_exception():
    status = running_status(conditions=[ready("False", "Initializing"), upgrade("False", "Initializing")],
                            activeServiceStatus=active("DEPLOY_FAILED", {**HEALTHY, "Ingress": {
                                "status": "DEPLOY_FAILED", "message": START_FAILED}},
                                "Failed to update the deployments ['Ingress']."))
    s = service_state(rs(status), APP)
    assert not s.ready and s.reason == cond.REPLICA_START_FAILED
    assert s.message == (f"application {APP} DEPLOY_FAILED: replicas of {APP} fail in their constructor: Ingress: "
                         "CheckpointError: KV cache budget 67108864 bytes holds 15 blocks of 16 tokens (4096 bytes "
                         "each); one sequence of 32768 tokens needs 2048 (8392704 bytes with the null block); raise "
                         "kvCacheBudget or lower maxModelLen")


def test_the_exception_line_of_a_traceback():
    from moe_operator.backends.serve_status import exception_line

    assert exception_line("Traceback...\n  File x\nModuleNotFoundError: No module named 'moe_workers'\n") \
        == "ModuleNotFoundError: No module named 'moe_workers'"
    assert exception_line("a\nb.c.OutOfMemoryError\n") == "OutOfMemoryError"
    assert exception_line("ValueError: first\nDuring handling...\nRuntimeError: second") == "RuntimeError: second"
    assert exception_line("no exception here\nlast words") == "last words"
    assert exception_line("RuntimeError: Traceback (most recent call last):\n  File x\n"
                          "Exception: expected ident at line 1 column 2") == "Exception: expected ident at line 1 column 2"


def test_start_failures_back_off_from_30_to_300_seconds():
    from moe_operator.api.conditions import set_condition
    from moe_operator.reconcile import start_retry_s
    from moe_workers.rfc3339 import format_rfc3339

    assert start_retry_s([], 1000.0) == 30
    deploying = set_condition([], cond.READY, False, cond.DEPLOYING, "x", 1, now=format_rfc3339(1000))
    assert start_retry_s(deploying, 1100.0) == 30  # the first start failure
    failed = set_condition(deploying, cond.READY, False, cond.REPLICA_START_FAILED, "y", 1, now=format_rfc3339(1100))
    assert failed[0]["lastTransitionTime"] == format_rfc3339(1000)  # still False since then
    assert [start_retry_s(failed, t) for t in (1010.0, 1090.0, 1500.0, 9000.0)] == [30, 90, 300, 300]
