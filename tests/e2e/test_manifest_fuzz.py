"""Generated MoEDeployment manifests through the real apiserver (server-side dry run) and through
the operator's parser: they agree, and the parser raises nothing but its own validation error.

Agreement: what the apiserver refuses, the parser refuses too; what the parser accepts (after
pruning unknown fields and nulls exactly as the apiserver does), the apiserver accepts. The
parser may refuse more (rules the schema and its CEL cannot say; those become Ready=False InvalidSpec).
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client, config

from invalid_manifests import VALID
from moe_operator.api.models import GROUP, PLURAL, VERSION
from moe_operator.api.pruning import prune, spec_schema
from moe_operator.api.validation import SpecError, parse_spec

pytestmark = pytest.mark.k8s

PATHS = [
    "model.path", "model.dtype", "model.maxModelLen", "model.servedModelName", "ingress.replicas", "ingress.numCpus",
    "ingress.kvCacheBudget", "ingress.maxRequestBytes", "ingress.maxBatchSize", "ingress.routePrefix",
    "experts.groups", "experts.replicasPerGroup", "experts.numCpus", "experts.tiers.hot.budget",
    "experts.tiers.warm.budget", "experts.tiers.warm.pinned", "experts.tiers.cold.path", "experts.tiers.cold.budget",
    "experts.tiers.policy", "experts.tiers.prefetch.lookaheadLayers", "experts.tiers.prefetch.enabled",
    "experts.overrides.0.expert", "experts.overrides.0.weights.path", "experts.overrides.0.weights.sha256",
    "autoscaling.mode", "autoscaling.imbalanceThreshold", "autoscaling.redundantExpertSlots",
    "autoscaling.maxMovesPerStep", "ray.mode", "ray.address", "experts.replicas_per_group", "unknownField",
    "experts.tiers", "ingress",
]
_VALUES = (
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64])
    | st.floats(-1e20, 1e20, allow_nan=False) | st.text(max_size=12)
    | st.sampled_from(["1Gi", "-1Gi", " 1Gi", "1e400", "9" * 400, "0.5", "1n", "0", "+2Mi", "1.5Gi", "1e-9",
                       "/models/a\x00b", "/models/m", "models/m", "3.1", "0.0", "Auto", "LRU", "/w.safetensors",
                       "http://ray:8265", "a" * 64, "/x"])
    | st.lists(st.integers(0, 3), max_size=2) | st.dictionaries(st.sampled_from(["budget", "path", "x"]),
                                                                 st.sampled_from(["1Gi", "/p", 3]), max_size=2)
)


def _mutate(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    node = doc["spec"]
    *parents, last = path.split(".")
    for p in parents:
        if isinstance(node, list):
            node = node[int(p)]
        else:
            nxt = node.get(p)
            if not isinstance(nxt, (dict, list)):
                nxt = node[p] = {}
            node = nxt
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


@pytest.fixture(scope="module")
def api(crd_installed):
    return client.CustomObjectsApi(config.new_client_from_config(config_file=str(crd_installed.kubeconfig)))


def _apiserver_accepts(api, doc) -> tuple[bool, str]:
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, doc, dry_run="All")
        return True, ""
    except client.ApiException as err:
        assert err.status in (400, 422), (err.status, err.body)
        return False, err.body


def _parser_accepts(doc) -> tuple[bool, str]:
    pruned, _ = prune(copy.deepcopy(doc["spec"]), spec_schema(), "spec")
    try:
        parse_spec(pruned)  # anything but SpecError fails the test
        return True, ""
    except SpecError as err:
        return False, str(err)


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), _VALUES), min_size=1, max_size=3))
def test_generated_manifests_apiserver_and_parser_agree(api, edits):
    doc = copy.deepcopy(VALID)
    doc["metadata"]["name"] = "fuzz"
    for path, value in edits:
        doc = _mutate(doc, path, value)
    server, why_server = _apiserver_accepts(api, doc)
    parser, why_parser = _parser_accepts(doc)
    if not server:
        assert not parser, f"the apiserver refused but the parser accepted {edits}: {why_server}"
    if parser:
        assert server, f"the parser accepted but the apiserver refused {edits}: {why_server}"
