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


def test_steps_counted_in_batches_count_what_step_by_step_counts(monkeypatch):
    """Decode steps kept and counted FLUSH_STEPS at a time give the figures of counting each step
    as it comes: sequences continuing across steps, slots freed and reused by new sequences
    (start 0), prefill and decode chunks in one step, a take() in the middle of a batch."""
    import moe_workers.serve.routing_stats as rs

    g = torch.Generator().manual_seed(11)
    steps = []
    pos = {}  # slot -> tokens cached
    for i in range(40):
        chunks = []
        for slot in range(3):
            if i % 7 == slot:  # this slot's sequence ends; a new one starts there with a prompt
                pos.pop(slot, None)
            start = pos.get(slot, 0)
            length = 1 if start else 1 + int(torch.randint(0, 4, (1,), generator=g))
            chunks.append((slot, start, length))
            pos[slot] = start + length
        n = sum(c[2] for c in chunks)
        picks = torch.stack([torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(n)]) for _ in range(4)])
        steps.append((picks, [c[0] for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks]))

    def run(flush_steps: int) -> list:
        monkeypatch.setattr(rs, "FLUSH_STEPS", flush_steps)
        s = RoutingStats(num_layers=5, num_experts=6, max_slots=3)
        windows = []
        for i, (picks, slots, starts, lengths) in enumerate(steps):
            s.observe_step([0, 1, 3, 4], picks, slots, starts, lengths)
            if i == 25:
                windows.append(s.take())
        windows.append(s.take())
        return [windows, s.co_selected_pairs()]

    one_by_one = run(1)
    assert one_by_one[0][0]["switching_rate"][1] is not None and one_by_one[0][0]["switching_rate"][2] is None
    assert run(8) == one_by_one
    assert run(64) == one_by_one


def test_expert_tokens_per_layer_and_per_key_id():
    s = RoutingStats(num_layers=2, num_experts=4, max_slots=4)
    picks = torch.tensor([[[0, 1], [0, 2], [3, 1]], [[1, 2], [1, 3], [1, 0]]])  # (layers, tokens, k)
    s.observe_step([0, 1], picks, [0, 1], [0, 0], [2, 1], keys=["k1", "k2"])
    s.observe_step([0, 1], picks[:, :1], [1], [1], [1])  # a chunk without a key: "-"
    w = s.take()
    assert w["selected"] == {0: [3, 3, 1, 1], 1: [1, 4, 2, 1]}
    assert w["keys"]["k1"] == {0: [2, 1, 1, 0], 1: [0, 2, 1, 1]}
    assert w["keys"]["k2"] == {0: [0, 1, 0, 1], 1: [1, 1, 0, 0]}
    assert w["keys"]["-"] == {0: [1, 1, 0, 0], 1: [0, 1, 1, 0]}
    assert s.take()["keys"] == {}


def test_keys_past_the_cap_are_counted_together(monkeypatch):
    import moe_workers.serve.routing_stats as rs
    monkeypatch.setattr(rs, "MAX_KEYS", 2)
    s = RoutingStats(num_layers=1, num_experts=2, max_slots=4)
    s.observe_step([0], torch.tensor([[[0, 1], [0, 1], [1, 0]]]), [0, 1, 2], [0, 0, 0], [1, 1, 1], keys=["a", "b", "c"])
    assert sorted(s.take()["keys"]) == ["a", "b", rs.OTHER_KEYS]


def test_steps_flushed_in_the_step_threads_inference_mode_are_counted_on_by_take():
    """The engine observes inside its step's inference mode and a full buffer is counted there; a
    key's counts first made then must still take the metrics thread's later counts (an inference
    tensor cannot be updated in place outside inference mode: every window after it failed)."""
    from moe_workers.serve.routing_stats import FLUSH_STEPS

    stats = RoutingStats(2, 4, 4)
    picks = torch.tensor([[[0, 1]], [[2, 3]]])
    with torch.inference_mode():
        for _ in range(FLUSH_STEPS):  # the last one counts the buffer, in inference mode
            stats.observe_step([0, 1], picks.clone(), [0], [0], [1], ["k1"])
    with torch.inference_mode():
        stats.observe_step([0, 1], picks.clone(), [0], [1], [1], ["k1"])  # pending, counted by take()
    w = stats.take()
    assert w["keys"]["k1"] == {0: [65, 65, 0, 0], 1: [0, 0, 65, 65]}
    assert w["selected"] == {0: [65, 65, 0, 0], 1: [0, 0, 65, 65]}
