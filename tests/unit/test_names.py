"""The names, labels and annotations users and their tools see: one module holds them all."""

from __future__ import annotations

from moe_operator import names


def test_the_contract_strings_stay_what_the_docs_say():
    assert names.app_name("team-a", "mixtral") == "team-a.mixtral"
    assert names.serve_service("team-a", "mixtral") == "mixtral-serve-svc.team-a.svc"
    assert names.worker_selector("mixtral") == "serving.moe.io/moedeployment=mixtral,ray.io/node-type=worker"
    assert names.FINALIZER == "serving.moe.io/cleanup"
    assert names.REBALANCE_ANNOTATION == "serving.moe.io/rebalance-requested"
    assert (names.MANIFEST_ANNOTATION, names.OWNER_ANNOTATION) == ("serving.moe.io/manifest", "serving.moe.io/moectl-up")
    assert names.RENDERED_SPEC_ANNOTATION == "serving.moe.io/rendered-spec"


def test_the_worker_selector_matches_the_labels_rendered_on_the_worker_pods():
    import yaml

    from moe_operator.api.validation import parse_spec
    from moe_operator.render.rayservice import render_rayservice

    spec = parse_spec(yaml.safe_load(open("examples/moedeployment-kuberay.yaml"))["spec"])
    rs = render_rayservice("default", "kr", "uid-1", spec, {"name": "default.kr"})
    labels = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    key, value = names.worker_selector("kr").split(",")[0].split("=")
    assert labels[key] == value == "kr" and labels["app.kubernetes.io/managed-by"] == names.MANAGED_BY
