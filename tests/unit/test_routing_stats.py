"""Router behaviour figures at the ingress: entropy, activation rate, switching, co-selection."""

import math

import pytest
import torch

from moe_workers.serve.routing_stats import RoutingStats


def test_entropy_uniform_and_concentrated():
    s = RoutingStats(num_layers=2, num_experts=4, max_slots=4)
    uniform = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    one = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])
    s.observe(0, uniform, [0], [0], [4])
    s.observe(1, one, [0], [0], [4])
    w = s.take()
    assert w["entropy"][0] == pytest.approx(1.0)
    assert w["entropy"][1] == pytest.approx(math.log(2) / math.log(4))
    assert w["activation_rate"] == pytest.approx((4 / 4 + 2 / 4) / 2)
    assert s.take()["entropy"] == [None, None]  # a new window


def test_switching_within_a_chunk_and_across_decode_steps():
    s = RoutingStats(num_layers=1, num_experts=8, max_slots=2)
    # prefill of slot 0: top-1 0,0,3,3 -> one switch in three transitions; slot 1: 5,6 -> one in one
    s.observe(0, torch.tensor([[0, 1], [0, 2], [3, 1], [3, 2], [5, 0], [6, 0]]), [0, 1], [0, 0], [4, 2])
    # decode: slot 0 continues with 3 (same), slot 1 with 7 (switch)
    s.observe(0, torch.tensor([[3, 0], [7, 0]]), [0, 1], [4, 2], [1, 1])
    w = s.take()
    assert w["switching_rate"][0] == pytest.approx(3 / 6)
    # a slot reused by a new sequence (start 0) does not compare against the old one
    s.observe(0, torch.tensor([[1, 0]]), [0], [0], [1])
    assert s.take()["switching_rate"] == [None]


def test_co_selection_pairs_are_unordered_and_ranked():
    s = RoutingStats(num_layers=2, num_experts=4, max_slots=1)
    s.observe(1, torch.tensor([[2, 0], [0, 2], [0, 2], [1, 3]]), [0], [0], [4])
    pairs = s.co_selected_pairs()
    assert pairs[0] == ("1.0", "1.2", 3) and pairs[1] == ("1.1", "1.3", 1) and len(pairs) == 2


def test_a_whole_step_at_once_counts_what_layer_by_layer_counts():
    g = torch.Generator().manual_seed(3)
    per_layer = RoutingStats(num_layers=3, num_experts=8, max_slots=4)
    per_step = RoutingStats(num_layers=3, num_experts=8, max_slots=4)
    chunks = [([0, 1, 2], [0, 0, 0], [5, 2, 3]), ([0, 1, 2], [5, 2, 3], [1, 1, 1]), ([3, 1], [0, 3], [2, 1])]
    for slots, starts, lengths in chunks:
        n = sum(lengths)
        picks = torch.stack([torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)]) for _ in range(3)])
        for layer in range(3):
            per_layer.observe(layer, picks[layer], slots, starts, lengths)
        per_step.observe_step([0, 1, 2], picks, slots, starts, lengths)
    assert per_step.co_selected_pairs() == per_layer.co_selected_pairs()
    assert per_step.take() == per_layer.take()
