"""Opt-in expert capacity (spec.routing.capacityFactor; `DenseModel.pick_within_capacity`, no Ray):
each expert takes at most ceil(factor x tokens x top_k / experts) choices of a call, an overflowing
choice goes to the token's next-best expert with room (GShard's rule) with the weights its family's
router gives the new set, tokens that fit keep their routing bit for bit, and unset routes exactly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_family, make_skewed_mixtral
from moe_workers.model.family import SUPPORTED
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.layers import rms_norm


def _normed(model, layer, n=96, seed=5, skew=False):
    h = torch.randn(n, model.cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    if skew:
        h[:, 0] = 4.0 * model.cfg.hidden_size ** 0.5  # the dimension make_skewed_mixtral's hot router rows read
    return rms_norm(h, model.dense.layers[layer]["post_norm"], model.cfg.rms_norm_eps)


def _checked(model, layer, x, factor):
    dense, cfg = model.dense, model.cfg
    base_idx, base_w = dense.pick(layer, x)
    idx, w, rerouted = dense.pick_within_capacity(layer, x, factor)
    n, k, e = len(x), cfg.top_k, cfg.num_experts
    capacity = max(1, math.ceil(factor * n * k / e))
    load = torch.bincount(idx.reshape(-1), minlength=e)
    assert int(load.max()) <= capacity, (load.tolist(), capacity)
    assert all(len(set(row.tolist())) == k for row in idx)  # k distinct experts a token
    changed = (idx != base_idx).any(-1) | (w != base_w).any(-1)
    assert int(changed.sum()) == rerouted
    assert torch.equal(idx[~changed], base_idx[~changed]) and torch.equal(w[~changed], base_w[~changed])
    return base_idx, idx, w, changed, capacity


def test_skewed_routing_is_spread_within_capacity_and_the_weights_are_the_familys(tmp_path):
    make_skewed_mixtral(tmp_path, hot_experts=(0, 4), num_local_experts=8, num_hidden_layers=2)
    model = InProcessModel(tmp_path)
    x = _normed(model, 1, skew=True)
    base_idx, idx, w, changed, capacity = _checked(model, 1, x, 1.25)
    assert changed.sum() > len(x) // 2  # nearly every token wanted experts 0 and 4
    # the queue is served by rank, then position: of the tokens whose first choice was a hot expert,
    # those that kept it are the first ones
    for hot in (0, 4):
        firsts = torch.nonzero(base_idx[:, 0] == hot).flatten()
        kept = [bool((idx[t] == hot).any()) for t in firsts.tolist()]
        assert sum(kept) > 0 and kept == sorted(kept, reverse=True), kept
    # the weights of a token routed again: its family's (softmax over all experts, then the
    # chosen ones renormalised), for the experts it has now
    probs = torch.softmax(F.linear(x, model.dense.layers[1]["gate"]).float(), dim=-1)
    want = probs.gather(1, idx)
    want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(w[changed], want[changed])
    # each choice moved goes to the best expert with room: never to one ranked below an expert
    # that ends the call with room to spare
    load = torch.bincount(idx.reshape(-1), minlength=model.cfg.num_experts)
    spare = load < capacity
    for i in torch.nonzero(changed).flatten().tolist():
        worst_taken = probs[i, idx[i]].min()
        better_unused = spare & (probs[i] > worst_taken)
        better_unused[idx[i]] = False
        assert not better_unused.any(), (i, idx[i].tolist())


@pytest.mark.parametrize("family", SUPPORTED)
def test_every_family_keeps_its_experts_within_capacity(tmp_path, family):
    make_family(tmp_path, family, num_experts=8, top_k=2, num_layers=2)
    model = InProcessModel(tmp_path)
    layer = model.cfg.sparse_layers[-1]
    x = _normed(model, layer, skew=False)
    _checked(model, layer, x, 1.25)
    # at 1.0 there is room for every choice and none to spare: a token a group-limited router
    # cannot place keeps its choice; every token still has k distinct experts
    idx, _, _ = model.dense.pick_within_capacity(layer, x, 1.0)
    assert all(len(set(row.tolist())) == model.cfg.top_k for row in idx)


def test_a_large_factor_or_none_routes_exactly(tmp_path):
    make_skewed_mixtral(tmp_path, num_local_experts=8, num_hidden_layers=2)
    model = InProcessModel(tmp_path)
    x = _normed(model, 1)
    base = model.dense.pick(1, x)
    idx, w, rerouted = model.dense.pick_within_capacity(1, x, 100.0)
    assert rerouted == 0 and torch.equal(idx, base[0]) and torch.equal(w, base[1])
    prompt = list(range(5, 40))
    plain = model.prompt_logits(prompt)
    model.dense.capacity_factor = 1.0
    assert not torch.equal(model.prompt_logits(prompt), plain) and sum(model.dense.rerouted.values()) > 0
    model.dense.capacity_factor = None
    assert torch.equal(model.prompt_logits(prompt), plain)
