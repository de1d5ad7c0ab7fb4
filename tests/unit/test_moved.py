"""A served object is not moved to another Ray cluster or ray.mode: the pass refuses (Ready=False,
InvalidSpec, the field named) and the application keeps serving where it is (render-only backend:
the Serve config each "cluster" holds is a real file; no Ray needed)."""

from __future__ import annotations

import json

import pytest

from manifests import small_deployment
from moe_operator.api import conditions as cond
from moe_operator.backends.render_only import RenderOnlyClient
from moe_operator.reconcile import ObjectRef, moved, reconcile, reconcile_kuberay
from moe_operator.settings import Settings
from moe_workers.model.random_init import write_random_mixtral


def _apps(client: RenderOnlyClient) -> list[str]:
    try:
        return [a["name"] for a in json.loads((client._file()).read_text())["applications"]]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    model = write_random_mixtral(root / "tiny", num_layers=2, num_experts=4, hidden_size=32, intermediate_size=64,
                                 vocab_size=128)
    return (small_deployment("m", str(model), groups=2, num_cpus=0.1, autoscaling={"mode": "Off"})["spec"],
            Settings(allowed_roots=(str(root),)))


def test_a_served_object_pointed_at_another_cluster_keeps_serving_where_it_is(spec, tmp_path):
    raw, settings = spec
    a, b = RenderOnlyClient(str(tmp_path / "a")), RenderOnlyClient(str(tmp_path / "b"))
    first = reconcile(ObjectRef("default", "m", 1), raw, {}, a, settings, fetch=lambda url: None)
    assert first.ready, first.event
    assert first.status["rayAddress"] == a.dashboard_url and _apps(a) == ["default.m"]

    res = reconcile(ObjectRef("default", "m", 2), raw, first.status, b, settings, fetch=lambda url: None)
    assert not res.ready and res.event[:2] == ("Warning", cond.INVALID_SPEC)
    assert res.event[2].startswith(f"spec.ray.address: the application serves on the Ray cluster {a.dashboard_url}; "
                                   f"moving it to {b.dashboard_url} is not supported")
    assert _apps(b) == [] and _apps(a) == ["default.m"]  # nothing written anywhere; the old one serves
    assert res.status["rayAddress"] == a.dashboard_url and res.status["endpoint"] == first.status["endpoint"]

    back = reconcile(ObjectRef("default", "m", 3), raw, res.status, a, settings, fetch=lambda url: None)
    assert back.ready, back.event  # the address set back: serving again, Ready


def test_a_served_object_cannot_change_its_ray_mode(spec):
    raw, settings = spec
    kuberay = {**raw, "ray": {"mode": "KubeRay", "kubeRay": {"image": "img:1"}}}
    res = reconcile_kuberay(ObjectRef("default", "m", 2, "uid-1"), kuberay, {"rayAddress": "http://ray-a:8265"},
                            None, settings)  # refused before any RayService is read or written
    assert not res.ready and res.event[1] == cond.INVALID_SPEC and res.event[2].startswith("spec.ray.mode:")


@pytest.mark.parametrize("status, mode, address, field", [
    ({}, "Existing", "http://a:8265", None),  # never deployed
    ({"rayAddress": "http://a:8265"}, "Existing", "http://a:8265/", None),  # the same cluster
    ({"rayAddress": "http://a:8265"}, "Existing", "http://b:8265", "spec.ray.address"),
    ({"rayAddress": "http://a:8265"}, "KubeRay", None, "spec.ray.mode"),
    ({"rayService": "m"}, "Existing", "http://a:8265", "spec.ray.mode"),
    ({"rayService": "m"}, "KubeRay", None, None),
])
def test_moved_names_the_field_that_would_move_a_served_object(status, mode, address, field):
    why = moved(status, mode, address)
    assert (why.split(":")[0] if why else None) == field
