"""One reconcile pass (`moe_operator.reconcile.run_pass`) over each `Backend`, the same cases for
both: the REST backend over the render-only client (a real file-backed Serve config) and the KubeRay
backend over an in-memory apiserver stand-in (`tests/custom_objects.py`; what KubeRay writes into the
RayService's status, the test writes). No Ray, no apiserver."""

from __future__ import annotations

import inspect

import pytest

from custom_objects import MemoryCustomObjects
from manifests import small_deployment
from moe_operator.api import conditions as cond
from moe_operator.backends.kuberay import PLURAL, KubeRayClient
from moe_operator.backends.kuberay_backend import KubeRayBackend
from moe_operator.backends.render_only import RenderOnlyClient
from moe_operator.backends.rest_backend import RestBackend
from moe_operator.backends.serve_backend import Backend, ObjectRef, ingress_placement
from moe_operator.names import app_name
from moe_operator.reconcile import run_pass
from moe_operator.settings import Settings
from moe_workers.model.random_init import write_random_mixtral

OBJ = ObjectRef("default", "m", 1, "uid-m")
APP = app_name(OBJ.namespace, OBJ.name)


def _no_report(url):
    return None  # the app's own report (tiers, swaps) is not read here


class Rest:
    """ray.mode Existing: render-only says an application runs as soon as it is written."""

    def __init__(self, tmp_path, raw):
        self.client = RenderOnlyClient(str(tmp_path / "ray"))
        self.backend, self.spec = RestBackend(self.client), raw
        self.other_mode = {"rayService": OBJ.name}  # what a KubeRay object's status holds

    def writes(self) -> int:
        return self.client.puts

    def run(self, generation: int) -> None:
        pass

    def finish_removal(self) -> None:
        pass  # Serve drops an application from its config at once


class KubeRay:
    """ray.mode KubeRay: the RayService runs once KubeRay says so in its status."""

    def __init__(self, tmp_path, raw):
        self.api = MemoryCustomObjects()
        self.client = KubeRayClient(self.api)
        self.backend = KubeRayBackend(self.client)
        self.spec = {**raw, "ray": {"mode": "KubeRay", "kubeRay": {"image": "registry.example/moe-worker:0.1"}}}
        self.other_mode = {"rayAddress": "http://ray-a:8265"}

    def writes(self) -> int:
        return self.client.writes

    def run(self, generation: int) -> None:
        rayservice = self.api.get_namespaced_custom_object("ray.io", "v1", OBJ.namespace, PLURAL, OBJ.name)
        deployments = {d["name"]: {"status": "HEALTHY"} for d in _deployed(self)["deployments"]}
        ready = {"type": "Ready", "status": "True", "reason": "NonZeroServeEndpoints", "message": "",
                 "observedGeneration": rayservice["metadata"]["generation"],
                 "lastTransitionTime": "2026-12-07T00:00:00Z"}
        self.api.set_status(PLURAL, OBJ.namespace, OBJ.name, {
            "observedGeneration": rayservice["metadata"]["generation"], "numServeEndpoints": 1,
            "conditions": [ready], "activeServiceStatus": {"rayClusterName": "m-x", "applicationStatuses": {
                APP: {"status": "RUNNING", "message": "", "serveDeploymentStatuses": deployments}}}})
        rayservice = self.api.objects[(PLURAL, OBJ.namespace, OBJ.name)]
        rayservice["metadata"]["finalizers"] = ["ray.io/rayservice-finalizer"]  # KubeRay's, on its first look

    def finish_removal(self) -> None:
        self.api.finalize(PLURAL, OBJ.namespace, OBJ.name)  # KubeRay took the Ray cluster down


def _deployed(harness) -> dict:
    return harness.backend.observe(OBJ)


@pytest.fixture(scope="module")
def raw_and_settings(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    model = write_random_mixtral(root / "tiny", num_layers=2, num_experts=4, hidden_size=32, intermediate_size=64,
                                 vocab_size=128)
    raw = small_deployment("m", str(model), groups=2, num_cpus=0.1, autoscaling={"mode": "Off"})["spec"]
    return raw, Settings(allowed_roots=(str(root),))


@pytest.fixture(params=[Rest, KubeRay], ids=["rest", "kuberay"])
def harness(request, tmp_path, raw_and_settings):
    raw, settings = raw_and_settings
    h = request.param(tmp_path, raw)
    h.settings = settings
    return h


def _pass(h, status: dict, generation: int = 1, spec: dict | None = None):
    obj = ObjectRef(OBJ.namespace, OBJ.name, generation, OBJ.uid)
    return run_pass(obj, spec or h.spec, status, h.backend, h.settings, fetch=_no_report)


def _ready(status: dict) -> dict:
    return cond.get_condition(status["conditions"], cond.READY)


def test_a_first_pass_applies_once_then_serves_and_steady_passes_write_nothing(harness):
    assert harness.backend.observe(OBJ) is None
    first = _pass(harness, {})
    assert harness.writes() == 1
    deployed = harness.backend.observe(OBJ)
    assert deployed["name"] == APP and ingress_placement(deployed) == first.placement
    assert first.status["endpoint"].endswith("/v1") and first.status["observedGeneration"] == 1
    harness.run(1)
    res = _pass(harness, first.status)
    assert res.ready and _ready(res.status)["reason"] == cond.SERVING, res.event
    assert [(g["name"], g["replicas"], g["readyReplicas"]) for g in res.status["groups"]] == [
        ("ExpertShard-0", 1, 1), ("ExpertShard-1", 1, 1)]
    assert res.status["replicas"] == 1
    assert cond.get_condition(res.status["conditions"], cond.DEGRADED)["status"] == "False"
    again = _pass(harness, res.status)
    assert again.ready and again.status == res.status and harness.writes() == 1


def test_a_spec_change_writes_exactly_once(harness):
    res = _pass(harness, {})
    harness.run(1)
    res = _pass(harness, res.status)
    changed = {**harness.spec, "ingress": {**harness.spec["ingress"], "maxBatchSize": 4}}
    res = _pass(harness, res.status, 2, changed)
    assert harness.writes() == 2 and harness.backend.observe(OBJ)["args"]["max_batch_size"] == 4
    harness.run(2)
    res = _pass(harness, res.status, 2, changed)
    assert res.ready and res.status["observedGeneration"] == 2 and harness.writes() == 2


def test_a_served_object_of_the_other_mode_is_refused_and_nothing_is_written(harness):
    res = _pass(harness, dict(harness.other_mode))
    assert not res.ready and res.event[:2] == ("Warning", cond.INVALID_SPEC) and res.retry_after_s is None
    assert res.event[2].startswith("spec.ray.mode:")
    assert harness.writes() == 0 and harness.backend.observe(OBJ) is None


def test_an_invalid_spec_is_refused_before_the_backend_is_asked(harness):
    bad = {**harness.spec, "model": {"path": "/etc"}}
    res = _pass(harness, {}, spec=bad)
    assert not res.ready and res.event[1] == cond.INVALID_SPEC and harness.writes() == 0


def test_delete_is_asked_until_the_application_is_gone(harness):
    _pass(harness, {})
    harness.run(1)
    under_way = [harness.backend.delete(OBJ) for _ in range(2)]  # as the finalizer asks, a turn at a time
    # REST: the first ask removes it from Serve's config, the next sees it gone; KubeRay's finalizer
    # holds the RayService until its Ray cluster is down: not gone meanwhile
    assert under_way == ([False, False] if isinstance(harness, KubeRay) else [False, True])
    harness.finish_removal()
    assert harness.backend.delete(OBJ) is True and harness.backend.observe(OBJ) is None
    assert harness.backend.delete(OBJ) is True  # asked again once gone: still gone, nothing raised


METHODS = [n for n, v in vars(Backend).items() if inspect.isfunction(v) and not n.startswith("_")]


def _params(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("impl", [RestBackend, KubeRayBackend])
def test_each_backend_has_every_member_of_the_protocol_with_its_parameters(impl):
    assert sorted(METHODS) == ["apply", "base_url", "degraded", "delete", "groups", "observe", "record", "refusal",
                               "serving_message"]
    for name in METHODS:
        assert _params(getattr(impl, name)) == _params(getattr(Backend, name)), name
    assert {"mode", "api_key_digests"} <= set(impl.__dataclass_fields__)


class _Rolling(RenderOnlyClient):
    """render-only, with Serve's status of every application set by the test (DEPLOYING while a change rolls out)."""

    app_status = "RUNNING"

    def get(self) -> dict:
        cluster = super().get()
        for app in cluster["applications"].values():
            app["status"] = self.app_status
        return cluster


def test_a_change_rolling_out_keeps_ready_and_the_observed_generation_until_serve_runs_it(tmp_path, raw_and_settings):
    raw, settings = raw_and_settings
    client = _Rolling(str(tmp_path / "ray"))
    backend = RestBackend(client)
    res = run_pass(ObjectRef("default", "m", 1), raw, {}, backend, settings, fetch=_no_report)
    assert res.ready and res.status["observedGeneration"] == 1
    client.app_status = "DEPLOYING"
    changed = {**raw, "ingress": {**raw["ingress"], "maxBatchSize": 4}}
    rolling = run_pass(ObjectRef("default", "m", 2), changed, res.status, backend, settings, fetch=_no_report)
    progressing = cond.get_condition(rolling.status["conditions"], cond.PROGRESSING)
    assert rolling.ready and (progressing["status"], progressing["reason"]) == ("True", cond.DEPLOYING)
    assert rolling.status["observedGeneration"] == 1 and rolling.retry_after_s is not None and client.puts == 2
    client.app_status = "RUNNING"
    done = run_pass(ObjectRef("default", "m", 2), changed, rolling.status, backend, settings, fetch=_no_report)
    assert done.ready and done.status["observedGeneration"] == 2 and done.retry_after_s is None and client.puts == 2
    assert cond.get_condition(done.status["conditions"], cond.PROGRESSING)["status"] == "False"
    # the first deploy is not Ready while Serve deploys it, and observes no generation yet
    client.app_status = "DEPLOYING"
    other = {**raw, "ingress": {**raw["ingress"], "routePrefix": "/n"}}
    first = run_pass(ObjectRef("default", "n", 1), other, {}, backend, settings, fetch=_no_report)
    assert not first.ready and first.event[1] == cond.DEPLOYING and "observedGeneration" not in first.status
