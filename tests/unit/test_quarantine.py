"""Quarantine (spec.routing.quarantine) in every family's router (`DenseModel.quarantine` and
`pick`, no Ray): a quarantined expert is never chosen, its tokens take their next choice with the
weights the family's router gives it, and an empty quarantine is the family's router exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_family
from moe_workers.model.family import SUPPORTED
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.layers import rms_norm


def _model(tmp_path, family):
    make_family(tmp_path, family, num_experts=8, top_k=2, num_layers=3)
    return InProcessModel(tmp_path)


def _hidden(model, n=256, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, model.cfg.hidden_size, generator=g)


def _expected(dense, layer, x, q):
    """What the family's router gives with expert q left out, computed here from its definition
    (the non-group routers): the next choice in the family's own order, its own weights."""
    cfg, w = dense.cfg, dense.layers[layer]
    if cfg.router == "topk_softmax":  # gpt-oss: top-k of the biased logits, softmax over those k
        logits = F.linear(x, w["gate"], w["gate_bias"])
        logits[:, q] = float("-inf")
        values, indices = logits.topk(cfg.top_k, dim=-1)
        return indices, torch.softmax(values, dim=1)
    probs = torch.softmax(F.linear(x, w["gate"]).float(), dim=-1)  # softmax over every expert, q included
    order = probs.argsort(dim=-1, descending=True)
    indices = torch.stack([row[row != q][:cfg.top_k] for row in order])
    weights = probs.gather(1, indices)
    return indices, weights / weights.sum(-1, keepdim=True) if cfg.norm_topk_prob else weights


@pytest.mark.parametrize("family", SUPPORTED)
def test_a_quarantined_expert_is_never_chosen_and_its_tokens_take_their_next_choice(tmp_path, family):
    model = _model(tmp_path, family)
    dense = model.dense
    layer = model.cfg.sparse_layers[-1]
    x = rms_norm(_hidden(model), dense.layers[layer]["post_norm"], model.cfg.rms_norm_eps)
    base_idx, base_w = dense.pick(layer, x)
    q = int(base_idx[:, 0].mode().values)  # the expert chosen first most often
    touched = (base_idx == q).any(-1)
    assert touched.sum() > 0
    dense.quarantine([f"{layer}.{q}"])
    idx, w = dense.pick(layer, x)
    assert not (idx == q).any() and torch.isfinite(w).all()
    assert all(len(set(row.tolist())) == model.cfg.top_k for row in idx)  # k distinct experts a token
    other_layer = model.cfg.sparse_layers[0]
    if other_layer != layer:  # another layer's router is untouched
        y = rms_norm(_hidden(model, seed=4), dense.layers[other_layer]["post_norm"], model.cfg.rms_norm_eps)
        dense.quarantine([])
        before = dense.pick(other_layer, y)
        dense.quarantine([f"{layer}.{q}"])
        after = dense.pick(other_layer, y)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    if model.cfg.router in ("softmax", "topk_softmax"):
        exp_idx, exp_w = _expected(dense, layer, x, q)
        order, exp_order = idx.sort(-1), exp_idx.sort(-1)
        assert torch.equal(order.values, exp_order.values)
        torch.testing.assert_close(w.gather(1, order.indices), exp_w.gather(1, exp_order.indices))
        # a token that did not choose q is routed exactly as before
        assert torch.equal(idx[~touched], base_idx[~touched]) and torch.equal(w[~touched], base_w[~touched])
    else:  # group-limited: the weights are the family's (scores of the chosen, renormalised where it does)
        if model.cfg.router == "sigmoid_group" and model.cfg.norm_topk_prob:
            torch.testing.assert_close(w.sum(-1), torch.full((len(x),), model.cfg.routed_scaling_factor))
    dense.quarantine([])  # lifted: the family's router exactly, bit for bit
    again = dense.pick(layer, x)
    assert torch.equal(again[0], base_idx) and torch.equal(again[1], base_w)


def test_a_quarantine_changes_the_output_and_lifting_it_restores_it(tmp_path):
    model = _model(tmp_path, "mixtral")
    prompt = list(range(5, 30))
    base = model.prompt_logits(prompt)
    model.dense.quarantine([f"{layer}.{e}" for layer in model.cfg.sparse_layers for e in (0, 1, 2)])
    assert not torch.allclose(model.prompt_logits(prompt), base)
    model.dense.quarantine([])
    assert torch.equal(model.prompt_logits(prompt), base)


def test_an_expert_that_is_not_routed_is_refused_by_name(tmp_path):
    model = _model(tmp_path, "mixtral")
    for bad in ("7.0", "0.8", "zero"):
        with pytest.raises(ValueError, match=bad):
            model.dense.quarantine([bad])
    assert model.dense.excluded == {}  # nothing half applied


# --- spec.routing.quarantine against the model (api/semantics.check_quarantine; the schema's part) ---

def _routing_spec(model_path, quarantine, share=None):
    import copy

    from invalid_manifests import VALID
    from moe_operator.api.validation import parse_spec

    raw = copy.deepcopy(VALID["spec"])
    raw["model"]["path"] = str(model_path)
    raw["experts"].pop("overrides", None)
    raw["routing"] = {"quarantine": quarantine, **({"maxQuarantinedShare": share} if share else {})}
    return parse_spec(raw)


def _problems(spec, root):
    from moe_operator.api.semantics import validate_semantics

    return validate_semantics(spec, [str(root)])[1]


@pytest.fixture(scope="module")
def mixtral_8(tmp_path_factory):
    root = tmp_path_factory.mktemp("q-roots")
    make_family(root / "m", "mixtral", num_experts=8, top_k=2, num_layers=3)
    return root


@pytest.mark.parametrize("quarantine,share,needle", [
    (["3.0"], None, "spec.routing.quarantine[0] 3.0 does not exist: the model has 3 layers x 8 routed experts"),
    (["1.2", "1.8"], None, "spec.routing.quarantine[1] 1.8 does not exist"),
    (["1.0", "1.1", "1.2"], None, "takes 3 of layer 1's 8 experts out; spec.routing.maxQuarantinedShare (0.25) allows 2"),
    ([f"2.{e}" for e in range(4)], 0.5, None),  # half a layer, allowed when asked for
])
def test_a_quarantine_the_model_cannot_take_is_refused_naming_the_entry(mixtral_8, quarantine, share, needle):
    problems = _problems(_routing_spec(mixtral_8 / "m", quarantine, share), mixtral_8)
    if needle is None:
        assert problems == []
    else:
        assert any(needle in p for p in problems), problems


def test_a_group_limited_router_keeps_candidates_in_every_group_it_may_choose(tmp_path):
    # DeepSeek-V3's router: 16 experts in 4 groups of 4, a group scored by its two best, the best 2
    # groups chosen, then the top-2 experts in them
    make_family(tmp_path / "m", "deepseek_v3", num_experts=16, top_k=2, num_layers=2,
                config_overrides={"n_group": 4, "topk_group": 2, "first_k_dense_replace": 0})
    ok = _problems(_routing_spec(tmp_path / "m", ["1.0", "1.1", "1.4"], 0.5), tmp_path)
    assert ok == [], ok
    bad = _problems(_routing_spec(tmp_path / "m", ["1.0", "1.1", "1.2"], 0.5), tmp_path)
    assert any("leaves layer 1 a group of experts with 1 candidates (its router scores a group by its best 2)" in p
               for p in bad), bad


def test_the_schema_refuses_a_repeated_expert_and_a_share_out_of_range():
    from pydantic import ValidationError

    from moe_operator.api.models import RoutingSpec

    with pytest.raises(ValidationError, match=r"entry \[1\] quarantines expert 1.2 again \(first at \[0\]\)"):
        RoutingSpec.model_validate({"quarantine": ["1.2", "1.2"]})
    for share in (0, 0.75):
        with pytest.raises(ValidationError, match="maxQuarantinedShare|max_quarantined_share"):
            RoutingSpec.model_validate({"maxQuarantinedShare": share})
    with pytest.raises(ValidationError, match="not an expert id"):
        RoutingSpec.model_validate({"quarantine": ["1.x"]})
