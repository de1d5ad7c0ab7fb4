"""The Ingress' expert exchange (moe_workers.serve.dispatch) without Ray: its channel here computes
each group's experts in process (the shards' own `compute_rows`), so what the dispatcher plans,
sends and combines is checked against the in-process model's layer, value for value. (Its reads
of the device: the served step on a fake CUDA device, tests/unit/test_fake_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_family
from moe_workers.model import routes
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import DenseModel
from moe_workers.model.experts import LocalExperts
from moe_workers.serve.dispatch import ExpertDispatcher
from moe_workers.serve.routing import ExpertRouter


class ComputingChannel:
    """An expert channel whose groups are in this process: each part computed by `experts`."""

    def __init__(self, experts: LocalExperts):
        self.experts, self.parts = experts, []

    def exchange(self, layer, parts):
        self.parts.append((layer, parts))
        out = {}
        for group, part in parts.items():
            rows = torch.empty_like(part.x)
            starts = [0]
            for n in part.counts:
                starts.append(starts[-1] + n)
            for i, e in enumerate(part.experts):
                rows[starts[i]:starts[i + 1]] = self.experts.forward(layer, {e: part.x[starts[i]:starts[i + 1]]})[e]
            out[group] = rows
        return out


def _placement(cfg, groups=2):
    """Experts split over `groups` groups, expert 0 of each layer replicated on every group."""
    out = {f"g{g}": [] for g in range(groups)}
    for layer in cfg.sparse_layers:
        for e in range(cfg.num_experts):
            for g in range(groups):
                if e % groups == g or e == 0:
                    out[f"g{g}"].append(f"{layer}.{e}")
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_family(path, "qwen3_moe", hidden_size=64, num_layers=3, num_experts=8, top_k=2)
    return path


@pytest.mark.parametrize("tokens", [1, 5, 40])  # decode rows (Python-int plan) and a larger step (on the device)
def test_the_exchange_gives_the_in_process_layer(qwen, tokens):
    ckpt = Checkpoint(qwen)
    cfg = ckpt.config
    dense, experts = DenseModel(cfg, ckpt.dense_state()), LocalExperts(ckpt, cfg.dtype)
    channel = ComputingChannel(experts)
    d = ExpertDispatcher(channel, dense.pick, cfg.sparse_layers, cfg.num_experts)
    d.configure(ExpertRouter(_placement(cfg)), prefetch_lookahead=1)
    assert (tokens * cfg.top_k <= routes.SMALL) == (tokens < 40)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
    layer = cfg.sparse_layers[0]
    indices, weights = dense.pick(layer, x)
    with torch.inference_mode():
        served = d(layer, x, indices, weights)
        local = experts.moe(layer, x, indices, weights)
    torch.testing.assert_close(served, local, atol=0, rtol=0)
    _, parts = channel.parts[-1]
    sent = {e: n for p in parts.values() for e, n in zip(p.experts, p.counts)}
    want = {e: int((indices == e).sum()) for e in range(cfg.num_experts) if (indices == e).any()}
    assert sent == want  # every routed row sent once, to one copy
    first = indices.gather(1, weights.argmax(1, keepdim=True)).flatten()
    top1 = {e: t for p in parts.values() for e, t in zip(p.experts, p.top1)}
    assert top1 == {e: int((first == e).sum()) for e in want}
    # hints: the next sparse layer's router on the same rows, each to the groups hosting its pick
    nxt, _ = dense.pick(layer + 1, x)
    hinted = {pair for p in parts.values() for pair in p.prefetch}
    assert {e for _, e in hinted} == set(nxt.flatten().tolist())
    assert all(a == layer + 1 for a, _ in hinted)


@pytest.mark.parametrize("n,k,e", [(1, 2, 8), (4, 2, 8), (16, 8, 64), (40, 4, 32)])
def test_the_plan_counts_each_tokens_largest_weight_as_its_first_choice(n, k, e):
    """The router's ranking the shards' policy is told: per expert, the tokens whose largest weight
    is its (DeepSeek's routers return their k unsorted, so slot 0 is not always the first), in
    both plans (Python ints up to routes.SMALL rows, counts on the device past it)."""
    g = torch.Generator().manual_seed(n * k)
    indices = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    want: dict[int, int] = {}
    for t in range(n):
        best = max(range(k), key=lambda s: weights[t, s].item())
        want[indices[t, best].item()] = want.get(indices[t, best].item(), 0) + 1
    plan = ExpertDispatcher(None, None, [0], e).plan(0, torch.zeros(n, 4), indices, weights)
    assert plan.first == want
    assert plan.counts == {x: int((indices == x).sum()) for x in range(e) if (indices == x).any()}
