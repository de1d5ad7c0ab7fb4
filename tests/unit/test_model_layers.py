"""The small-batch forms of grouping and combining give exactly what the general forms give."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_workers.model import layers


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_small_batch_grouping_and_combining_equal_the_general_forms(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, generator=g), -1)
    x = torch.randn(n, 16, generator=g)
    small = layers.group_by_expert(indices)
    outputs = {e: x[rows] * (e + 1) for e, (rows, _) in small.items()}
    combined_small = layers.combine(n, 16, torch.float32, small, outputs, weights)
    saved = layers._SMALL_ROWS
    layers._SMALL_ROWS = -1  # force the general forms (argsort/unique, index_add_)
    try:
        general = layers.group_by_expert(indices)
        combined_general = layers.combine(n, 16, torch.float32, general, outputs, weights)
    finally:
        layers._SMALL_ROWS = saved
    assert list(small) == list(general)
    for e in small:
        assert torch.equal(small[e][0], general[e][0]) and torch.equal(small[e][1], general[e][1])
        assert small[e][0].dtype == general[e][0].dtype == torch.int64
    assert torch.equal(combined_small, combined_general)
