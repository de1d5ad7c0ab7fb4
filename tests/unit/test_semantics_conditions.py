"""Semantic checks beyond the schema, the conditions helper, and manifest loading (no cluster)."""

from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from invalid_manifests import VALID
from moe_operator.api import conditions as cond
from moe_operator.api.semantics import validate_semantics
from moe_operator.api.validation import parse_spec
from moe_operator.standalone.runner import load_manifest
from moe_workers.model.random_init import write_random_mixtral


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("roots")
    write_random_mixtral(root / "m", num_layers=2, num_experts=4, hidden_size=32, intermediate_size=64)
    return root


def _spec(model_dir, **experts):
    raw = copy.deepcopy(VALID["spec"])
    raw["model"]["path"] = str(model_dir / "m")
    raw["experts"]["overrides"] = [{"expert": "1.3", "weights": {"path": str(model_dir / "p.safetensors")}}]
    raw["experts"].update(experts)
    return parse_spec(raw)


def test_valid_spec_passes(model_dir):
    facts, problems, _ = validate_semantics(_spec(model_dir), [str(model_dir)])
    assert problems == [] and facts.num_experts == 4 and facts.expert_bytes() == 3 * 32 * 64 * 4


@pytest.mark.parametrize("mutate,needle", [
    (lambda s, d: s.model.__setattr__("path", "/etc"), "outside the allowed model roots"),
    (lambda s, d: s.model.__setattr__("path", str(d)), "has no readable config.json"),
    (lambda s, d: s.experts.overrides[0].__setattr__("expert", "2.0"), "overrides[0].expert 2.0 does not exist: the model has 2 layers x 4 routed experts"),
    (lambda s, d: s.experts.overrides[0].__setattr__("expert", "1.4"), "does not exist"),
    (lambda s, d: s.experts.overrides[0].weights.__setattr__("path", "/tmp/x.safetensors"), "outside the allowed weight roots"),
    (lambda s, d: s.experts.tiers.hot.__setattr__("budget", "1Ki"), "smaller than one token's experts in a shard group: 2 experts"),
    # 2 layers x (k + v) x 2 KV heads x 8 dims x 4 bytes = 256 bytes a token; 512 tokens at the model's context
    (lambda s, d: s.ingress.__setattr__("kv_cache_budget", "64Ki"),
     "spec.ingress.kvCacheBudget: KV cache budget 65536 bytes holds 15 blocks of 16 tokens (4096 bytes each); "
     "one sequence of 512 tokens needs 32 (135168 bytes with the null block)"),
])
def test_semantic_problems_name_what_to_fix(model_dir, mutate, needle):
    spec = _spec(model_dir)
    mutate(spec, model_dir)
    _, problems, _ = validate_semantics(spec, [str(model_dir)])
    assert any(needle in p for p in problems), problems


def test_the_kv_budget_fits_when_maxmodellen_is_lowered(model_dir):
    spec = _spec(model_dir)
    spec.ingress.kv_cache_budget = "64Ki"
    spec.model.max_model_len = 224  # 14 blocks: the 15 the budget holds are enough
    assert validate_semantics(spec, [str(model_dir)])[1] == []


def test_model_shape_stands_in_for_an_unreadable_config_and_must_agree_with_a_readable_one(model_dir):
    from moe_operator.api.models import ModelShape

    shape = ModelShape(num_layers=2, num_experts=4, top_k=2, hidden_size=32, intermediate_size=64, dtype="float32")
    spec = _spec(model_dir)
    spec.model.shape = shape
    assert validate_semantics(spec, [str(model_dir)])[1] == []  # agrees with config.json
    spec.model.shape = shape.model_copy(update={"num_experts": 8})
    _, problems, _ = validate_semantics(spec, [str(model_dir)])
    assert problems == [f"spec.model.shape disagrees with {model_dir / 'm'}/config.json: num_experts 8 (config.json: 4)"]
    # not readable here (on the Ray Pods): the shape gives the facts, and its checks still apply
    spec.model.path = str(model_dir / "on-the-pods")
    spec.model.shape = shape
    facts, problems, _ = validate_semantics(spec, [str(model_dir)])
    assert problems == [] and facts.num_experts == 4
    spec.experts.overrides[0].expert = "1.4"
    assert "1.4 does not exist" in validate_semantics(spec, [str(model_dir)])[1][0]


def test_symlink_out_of_root_is_refused(model_dir, tmp_path):
    (model_dir / "escape").symlink_to("/etc")
    spec = _spec(model_dir)
    spec.model.path = str(model_dir / "escape")
    _, problems, _ = validate_semantics(spec, [str(model_dir)])
    assert "outside the allowed model roots" in problems[0]


def test_condition_transition_time_moves_only_on_status_change():
    c = cond.set_condition([], cond.READY, False, cond.DEPLOYING, "x", 1, now="t1")
    c = cond.set_condition(c, cond.READY, False, cond.DEPLOYING, "y", 2, now="t2")
    assert c[0]["lastTransitionTime"] == "t1" and c[0]["message"] == "y" and c[0]["observedGeneration"] == 2
    c = cond.set_condition(c, cond.READY, True, cond.SERVING, "ok", 2, now="t3")
    assert c[0]["lastTransitionTime"] == "t3" and c[0]["status"] == "True"
    c = cond.set_condition(c, cond.PROGRESSING, True, cond.DEPLOYING, "", 2, now="t4")
    assert [x["type"] for x in c] == ["Ready", "Progressing"]


def test_load_manifest_resolves_relative_paths_and_reports_errors(tmp_path):
    doc = copy.deepcopy(VALID)
    doc["spec"]["model"]["path"] = "models/m"
    doc["spec"]["experts"]["overrides"][0]["weights"]["path"] = "patches/e.safetensors"
    doc["spec"]["experts"]["tiers"]["cold"] = {"path": "cache"}
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(doc))
    m = load_manifest(f)
    assert m.problems == [] and m.spec.model.path == str(tmp_path / "models" / "m")
    assert m.spec.experts.tiers.cold.path == str(tmp_path / "cache")
    assert m.spec.experts.overrides[0].weights.path == str(tmp_path / "patches" / "e.safetensors")
    doc["spec"]["experts"]["groups"] = 0
    f.write_text(yaml.safe_dump(doc))
    assert load_manifest(f).problems == ["spec.experts.groups: Input should be greater than or equal to 1"]
    f.write_text("kind: Something\n")
    assert "expected exactly one MoEDeployment" in load_manifest(f).problems[0]


@pytest.mark.parametrize("where,value,problem", [
    (("spec",), "/path", "spec: must be of type object, got str"),
    (("spec", "model"), "/path", "spec.model: must be of type object, got string"),
    (("spec", "experts"), 3, "spec.experts: must be of type object, got integer"),
    (("spec", "experts", "tiers"), -1, "spec.experts.tiers: must be of type object, got integer"),
    (("spec", "experts", "tiers", "cold"), "x", "spec.experts.tiers.cold: must be of type object, got string"),
    (("spec", "experts", "overrides"), {"a": 1}, "spec.experts.overrides: must be of type array, got object"),
    (("spec", "experts", "overrides", 0), 7, "spec.experts.overrides[0]: must be of type object, got integer"),
    (("spec", "experts", "overrides", 0, "weights"), [], "spec.experts.overrides[0].weights: must be of type object, "
                                                        "got array"),
    (("spec", "experts", "groups"), True, "spec.experts.groups: must be of type integer, got boolean"),
    (("spec", "experts", "overrides", 0), None, "spec.experts.overrides[0]: must be of type object, got null"),
    (("metadata", "name"), "Fuzz", "metadata.name: 'Fuzz' is not a valid name"),
    (("metadata", "name"), "a/b", "metadata.name: 'a/b' is not a valid name"),
    (("metadata", "name"), "a\x00b", "metadata.name: 'a\\x00b' is not a valid name"),
    (("metadata",), "m", "metadata: must be of type object, got str"),
])
def test_a_badly_shaped_manifest_is_refused_naming_the_path_before_any_field_is_read(tmp_path, where, value, problem):
    """`moectl up` used to resolve relative paths before checking types: a scalar where a mapping
    belongs was an AttributeError and a traceback (and ended a running `moectl up`)."""
    doc = copy.deepcopy(VALID)
    doc["metadata"] = {"name": "m"}
    node = doc
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(doc))
    m = load_manifest(f)
    assert m.spec is None and len(m.problems) == 1 and m.problems[0].startswith(problem), m.problems


def test_empty_paths_and_yaml_numbers_read_as_kubectl_reads_them(tmp_path):
    doc = copy.deepcopy(VALID)
    doc["metadata"] = {"name": "m"}
    doc["spec"]["experts"]["tiers"]["cold"] = {"path": ""}
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert [p.split(":")[0] for p in load_manifest(f).problems] == ["spec.experts.tiers.cold.path"]
    doc["spec"]["experts"]["tiers"]["cold"] = {"path": "/cache"}
    text = yaml.safe_dump(doc).replace("groups: 2", "groups: 2e+0")
    assert "groups: 2e+0" in text
    f.write_text(text)
    # a number (YAML 1.2 and go-yaml read it so), not the string PyYAML made of it
    assert load_manifest(f).problems == ["spec.experts.groups: must be of type integer, got number"]


def test_standalone_examples_load(tmp_path):
    """examples/standalone/*.yaml are for `moectl up` (relative paths allowed): its parser accepts them."""
    import glob

    paths = sorted(glob.glob("examples/standalone/*.yaml"))
    assert paths
    for path in paths:
        m = load_manifest(__import__("pathlib").Path(path))
        assert m.problems == [] and m.spec.model.path.startswith("/")


def test_within_roots_resolves_links_and_does_not_match_name_prefixes(tmp_path):
    """The one path check the operator and the shards share."""
    from moe_workers.paths import within_roots

    root = tmp_path / "models"
    (root / "m").mkdir(parents=True)
    (tmp_path / "models2").mkdir()
    (root / "out").symlink_to(tmp_path / "models2")
    (tmp_path / "models2" / "in").symlink_to(root / "m")
    assert within_roots(root / "m" / "w.safetensors", [str(root)]) == (root / "m" / "w.safetensors").resolve()
    assert within_roots(root, [str(root)]) == root.resolve()
    assert within_roots(tmp_path / "models2" / "w.safetensors", [str(root)]) is None  # a name prefix, not a child
    assert within_roots(root / "out" / "w.safetensors", [str(root)]) is None  # a link leading out
    assert within_roots(tmp_path / "models2" / "in", [str(root)]) == (root / "m").resolve()  # a link leading in
    assert within_roots(root / "m", []) is None


@pytest.mark.parametrize("status,expected", [
    ({"conditions": [{"type": "Ready", "status": "False", "reason": "RayUnreachable"}]}, True),
    ({"conditions": [{"type": "Ready", "status": "False", "reason": "InvalidSpec"}]}, True),
    # once served, the app may still be in Ray whatever the condition says now
    ({"endpoint": "http://x:8000/v1", "conditions": [{"type": "Ready", "status": "False", "reason": "RayUnreachable"}]},
     False),
    # a failed deploy wrote a Serve config: Ray must confirm the removal
    ({"conditions": [{"type": "Ready", "status": "False", "reason": "DeployFailed"}]}, False),
    ({"conditions": [{"type": "Ready", "status": "False", "reason": "Deploying"}]}, False),
    ({}, False), (None, False),
])
def test_delete_needs_nothing_from_ray_only_when_nothing_was_deployed(status, expected):
    from moe_operator.reconcile import never_deployed

    assert never_deployed(status) is expected


def test_family_facts_unsupported_types_and_contradicting_tensors(model_dir):
    """The operator (no torch) reads a family's facts from config.json and the safetensors
    headers: sparse layers and expert bytes as the family lays them out; an unsupported
    model_type is UnsupportedModel naming what is supported; a tensor that contradicts the
    config is InvalidSpec naming the file and the tensor."""
    import json

    from moe_workers.model.random_init import write_random_checkpoint

    root = model_dir / "families"
    write_random_checkpoint(root / "ds", "deepseek_v3", num_layers=3, num_experts=4, hidden_size=32,
                            intermediate_size=16, num_heads=4, num_kv_heads=4, vocab_size=64)
    write_random_checkpoint(root / "oss", "gpt_oss", num_layers=2, num_experts=4, hidden_size=32,
                            intermediate_size=16, num_heads=4, num_kv_heads=2, vocab_size=64)
    spec = _spec(model_dir)
    spec.experts.overrides = []
    spec.model.path = str(root / "ds")
    facts, problems, reason = validate_semantics(spec, [str(model_dir)])
    assert problems == [] and facts.family == "deepseek_v3" and facts.layers == (1, 2)
    assert facts.expert_bytes() == 3 * 32 * 16 * 4
    spec.model.path = str(root / "oss")
    facts, _, _ = validate_semantics(spec, [str(model_dir)])
    assert facts.expert_bytes() == (32 * 32 + 32 + 16 * 32 + 32) * 4  # gate_up + bias, down + bias

    spec = _spec(model_dir)
    spec.model.path = str(root / "ds")
    spec.experts.overrides[0].expert = "0.1"  # layer 0 is dense (first_k_dense_replace)
    _, problems, reason = validate_semantics(spec, [str(model_dir)])
    assert reason == "InvalidSpec" and "0.1 does not exist: layer 0 of this deepseek_v3 model is a dense MLP" in problems[0]

    cfg_file = root / "oss" / "config.json"
    raw = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**raw, "model_type": "jamba"}))
    spec.model.path = str(root / "oss")
    _, problems, reason = validate_semantics(spec, [str(model_dir)])
    assert reason == "UnsupportedModel" and "model_type 'jamba' is not supported (supported: mixtral, qwen3_moe" in problems[0]
    spec.model.family = "gpt_oss"  # the spec's override reads it as gpt_oss
    assert validate_semantics(spec, [str(model_dir)])[1] == []
    cfg_file.write_text(json.dumps({**raw, "intermediate_size": 20}))
    spec.model.family = None
    _, problems, reason = validate_semantics(spec, [str(model_dir)])
    assert reason == "InvalidSpec" and "model.safetensors: tensor model.layers.0.mlp.experts.down_proj has shape (4, 16, 32), config.json implies (4, 20, 32)" in problems[0]


def test_placement_covers_only_sparse_layers():
    from moe_operator.planner.initial import current_placement, initial_placement, placement_problem

    p = initial_placement((1, 2, 3), 4, 2)
    assert sorted({e.split(".")[0] for es in p.values() for e in es}) == ["1", "2", "3"]
    assert placement_problem(p, (1, 2, 3), 4, 2) is None
    assert "outside the model" in placement_problem(initial_placement(4, 4, 2), (1, 2, 3), 4, 2)
    assert current_placement((1, 2, 3), 4, 2, initial_placement(4, 4, 2)) == p  # a stale one is replanned


def _unsupported(model_dir):
    import json as _json

    bad = model_dir / "unsupported"
    if not bad.exists():
        bad.mkdir()
        cfg = _json.loads((model_dir / "m" / "config.json").read_text())
        (bad / "config.json").write_text(_json.dumps({**cfg, "model_type": "jamba"}))
    return bad


@pytest.mark.parametrize("case", ["valid", "outside-roots", "no-config", "unsupported", "override-and-budget",
                                  "shape-disagrees-and-override"])
def test_the_composed_chain_gives_the_first_reason_and_every_message_in_order(model_dir, case):
    """The whole chain of checks, as the operator runs it: exact reason and messages, in order; a
    model the chain cannot read stops it (nothing else can be judged)."""
    from moe_operator.api.models import ModelShape

    spec, m = _spec(model_dir), model_dir / "m"
    budget_msg = ("spec.experts.tiers.hot.budget (1024 bytes) is smaller than one token's experts in a shard "
                  "group: 2 experts of a layer x 24576 bytes = 49152 bytes; raise the budget or add groups")
    if case == "valid":
        expected = ("", [])
    elif case == "outside-roots":
        spec.model.path = "/etc"
        spec.experts.tiers.hot.budget = "1Ki"  # not judged: the model cannot be read
        expected = (cond.INVALID_SPEC, [f"spec.model.path /etc is outside the allowed model roots ({model_dir})"])
    elif case == "no-config":
        spec.model.path = str(model_dir)
        expected = (cond.INVALID_SPEC, [f"spec.model.path {model_dir} has no readable config.json (expected a "
                                        "Hugging Face layout directory)"])
    elif case == "unsupported":
        spec.model.path = str(_unsupported(model_dir))
        spec.experts.overrides[0].expert = "9.0"  # not judged
        _, problems, reason = validate_semantics(spec, [str(model_dir)])
        assert reason == cond.UNSUPPORTED_MODEL and len(problems) == 1 and "jamba" in problems[0]
        return
    elif case == "override-and-budget":
        spec.experts.overrides[0].expert = "1.4"
        spec.experts.tiers.hot.budget = "1Ki"
        expected = (cond.INVALID_SPEC, ["spec.experts.overrides[0].expert 1.4 does not exist: the model has 2 "
                                        "layers x 4 routed experts", budget_msg])
    else:
        spec.model.shape = ModelShape(num_layers=3, num_experts=4, top_k=2, hidden_size=32, intermediate_size=64,
                                      dtype="float32")
        spec.experts.overrides[0].weights.path = "/tmp/x.safetensors"
        expected = (cond.INVALID_SPEC, [f"spec.model.shape disagrees with {m}/config.json: num_layers 3 "
                                        "(config.json: 2)",
                                        "spec.experts.overrides[0].weights.path /tmp/x.safetensors is outside the "
                                        "allowed weight roots"])
    _, problems, reason = validate_semantics(spec, [str(model_dir)])
    assert (reason, problems) == expected


_SHAPES = (st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(-1e3, 1e3, allow_nan=False)
           | st.text(max_size=8) | st.lists(st.integers(0, 3) | st.none() | st.text(max_size=3), max_size=2)
           | st.dictionaries(st.sampled_from(["path", "budget", "x"]), st.sampled_from(["1Gi", "/p", 3, None]),
                             max_size=2))
_WHERE = [("spec",), ("spec", "model"), ("spec", "model", "path"), ("spec", "experts"), ("spec", "experts", "tiers"),
          ("spec", "experts", "tiers", "cold"), ("spec", "experts", "tiers", "cold", "path"),
          ("spec", "experts", "overrides"), ("spec", "experts", "overrides", 0),
          ("spec", "experts", "overrides", 0, "weights"), ("spec", "experts", "overrides", 0, "weights", "path"),
          ("spec", "ingress"), ("spec", "ingress", "kvCacheBudget"), ("spec", "ray"), ("metadata",),
          ("metadata", "name"), ("metadata", "namespace")]


@settings(max_examples=300, deadline=None)
@given(edits=st.lists(st.tuples(st.sampled_from(_WHERE), _SHAPES), min_size=1, max_size=3))
@example(edits=[(("spec", "model", "path"), "\x00")])  # a relative path with a NUL byte crashed moectl up
def test_generated_shapes_never_raise_and_each_problem_names_a_path(tmp_path_factory, edits):
    """What `moectl up` reads: any shape at any of these places is a spec or a list of problems,
    each starting with the path it is about, never an exception."""
    doc = copy.deepcopy(VALID)
    doc["metadata"] = {"name": "m"}
    for where, value in edits:
        node = doc
        for key in where[:-1]:
            child = node[key] if isinstance(node, list) and isinstance(key, int) and key < len(node) else (
                node.get(key) if isinstance(node, dict) else None)
            if not isinstance(child, (dict, list)) or (isinstance(child, list) and not child):
                break
            node = child
        else:
            last = where[-1]
            if isinstance(node, dict) or (isinstance(node, list) and isinstance(last, int) and last < len(node)):
                node[last] = value
    f = tmp_path_factory.mktemp("fuzz") / "m.yaml"
    f.write_text(yaml.safe_dump(doc))
    m = load_manifest(f)
    assert (m.spec is None) == bool(m.problems)
    for p in m.problems:
        assert p.split(":")[0].split("[")[0].split(".")[0] in ("spec", "metadata"), p
