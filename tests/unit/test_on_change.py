"""What editing each spec field does to a running application, read off the rendered Serve
config (moe_operator.render.on_change), as the API reference shows it."""

from __future__ import annotations

import copy

import pytest
import yaml

from moe_operator.api.validation import parse_spec
from moe_operator.render import on_change as oc

APP = {"name": "default.m", "route_prefix": "/", "import_path": "moe_workers.serve.app:build_app",
       "args": {"model_path": "/models/m", "max_batch_size": 8}, "runtime_env": {"env_vars": {"A": "1"}},
       "deployments": [{"name": "Ingress", "user_config": {"placement": {"ExpertShard-0": ["0.0"]}}},
                       {"name": "ExpertShard-0", "num_replicas": 1, "user_config": {"experts": ["0.0"]}}]}


def _changed(edit) -> dict:
    app = copy.deepcopy(APP)
    edit(app)
    return app


@pytest.mark.parametrize("edit, kind", [
    (lambda a: None, oc.OPERATOR),
    (lambda a: a["deployments"][1].update(num_replicas=3), oc.IN_PLACE),
    (lambda a: a["deployments"][1]["user_config"].update(experts=["0.0", "0.1"]), oc.IN_PLACE),
    (lambda a: a["deployments"][0].update(max_ongoing_requests=8, health_check_period_s=5), oc.IN_PLACE),
    (lambda a: a["args"].update(max_batch_size=16), oc.RESTART),
    (lambda a: a["runtime_env"]["env_vars"].update(A="2"), oc.RESTART),
    (lambda a: a.update(route_prefix="/m"), oc.RESTART),  # not on Serve's in-place list
    (lambda a: a["deployments"][1].update(ray_actor_options={"num_cpus": 2}), oc.RESTART_SOME),  # that one only
    (lambda a: [d.update(ray_actor_options={"num_cpus": 2}) for d in a["deployments"]], oc.RESTART),
    (lambda a: a["deployments"].append({"name": "ExpertShard-1", "user_config": {"experts": []}}), oc.RESTART),
    (lambda a: a["deployments"][1].update(num_replicas=2, ray_actor_options={"num_gpus": 1}), oc.RESTART_SOME),
])
def test_a_change_is_in_place_only_when_every_changed_option_is_lightweight(edit, kind):
    assert oc.classify(APP, _changed(edit)) == kind


def _spec_leaves() -> list[str]:
    crd = yaml.safe_load(open("crds/moedeployments.serving.moe.io.yaml"))
    leaves: list[str] = []

    def walk(schema: dict, path: str) -> None:
        if schema.get("properties"):
            for key, sub in schema["properties"].items():
                walk(sub, f"{path}.{key}" if path else key)
        elif schema.get("type") == "array" and (schema.get("items") or {}).get("properties"):
            walk(schema["items"], path + "[]")
        else:
            leaves.append(path)

    walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"], "")
    return leaves


def test_every_field_of_the_spec_has_a_probe_or_a_stated_effect_and_no_stale_entry():
    leaves = set(_spec_leaves())
    assert not set(oc.PROBES) & set(oc.NOT_RENDERED)
    assert leaves == set(oc.PROBES) | set(oc.NOT_RENDERED), "classify the new field in moe_operator.render.on_change"


@pytest.mark.parametrize("path", sorted(oc.PROBES))
def test_each_probe_is_a_valid_change_of_its_field(path):
    """A probe equal to the field's default would read as "operator only" whatever the field does."""
    before, after = (parse_spec(raw) for raw in oc.probe(path))
    assert before != after


def test_the_fields_users_scale_and_tune_most_apply_in_place_and_model_changes_restart():
    assert oc.on_change("experts.replicasPerGroup") == oc.IN_PLACE
    assert oc.on_change("experts.tiers.hot.budget") == oc.IN_PLACE
    assert oc.on_change("experts.overrides[].weights.path") == oc.IN_PLACE  # a hot-swap
    assert oc.on_change("autoscaling.imbalanceThreshold") == oc.OPERATOR
    assert oc.on_change("model.path") == oc.RESTART
    with pytest.raises(KeyError, match="no probe value"):
        oc.on_change("experts.unknownField")
