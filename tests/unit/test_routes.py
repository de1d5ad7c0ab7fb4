"""Decode-size routing (`model.routes`) gives bit for bit what `layers.group_by_expert` +
`layers.combine` give, whatever order the expert outputs come back in."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_workers.model import layers, routes


def _case(n: int, k: int, seed: int, dtype: torch.dtype, experts: int = 8):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.topk(torch.randn(experts, generator=g), k).indices for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, generator=g), -1)  # the router's weights stay float32
    x = torch.randn(n, 16, generator=g).to(dtype)
    # an expert's output depends on the expert and on the row, as a real one does
    scale = {e: torch.randn(16, generator=g).to(dtype) for e in range(experts)}
    return indices, weights, x, scale


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 32), k=st.integers(1, 4), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), groups=st.integers(1, 4))
def test_route_and_combine_equal_the_reference_forms(n, k, seed, dtype, groups):
    indices, weights, x, scale = _case(n, k, seed, dtype)
    reference = layers.group_by_expert(indices)
    ref_out = {e: x[rows] * scale[e] for e, (rows, _) in reference.items()}
    expected = layers.combine(n, 16, dtype, reference, ref_out, weights)

    r = routes.route(indices)
    assert list(r.by_expert) == list(reference)
    for e, (rows, slots) in reference.items():
        assert r.by_expert[e] == list(zip(rows.tolist(), slots.tolist()))
    # experts dealt to groups in a random order, as the router may (hottest first, replicas)
    order_experts = list(r.by_expert)
    random.Random(seed).shuffle(order_experts)
    parts = [order_experts[i::groups] for i in range(groups)]
    outputs = torch.cat([routes.gather(x, r, part) * torch.cat([scale[e].expand(len(r.by_expert[e]), 16)
                                                                 for e in part])
                         for part in parts if part])
    order = [pair for part in parts for pair in r.order(part)]
    got = routes.combine(r, order, outputs, weights, dtype)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)


def test_gather_gives_each_expert_its_rows_in_token_order():
    indices = torch.tensor([[3, 1], [1, 2], [3, 2]])
    x = torch.arange(3.0).unsqueeze(1).expand(3, 4)
    r = routes.route(indices)
    assert r.counts() == {1: 2, 2: 2, 3: 2}
    assert routes.gather(x, r, [3, 1])[:, 0].tolist() == [0.0, 2.0, 0.0, 1.0]
    assert r.order([3, 1]) == [(0, 0), (2, 0), (0, 1), (1, 0)]


def test_one_token_is_sent_once_per_expert_without_a_gather():
    x = torch.randn(1, 8)
    r = routes.route(torch.tensor([[5, 2]]))
    assert routes.gather(x, r, [5]) is x
    both = routes.gather(x, r, [2, 5])
    assert both.shape == (2, 8) and torch.equal(both[0], x[0]) and torch.equal(both[1], x[0])


def test_combine_refuses_an_order_that_misses_a_pair():
    r = routes.route(torch.tensor([[0, 1]]))
    try:
        routes.combine(r, [(0, 0)], torch.zeros(1, 4), torch.ones(1, 2), torch.float32)
    except KeyError:
        return
    raise AssertionError("a missing (token, slot) output must not be combined as if it were there")
