"""Experts held in one process: weights per (layer, expert), computed per dispatch."""

from __future__ import annotations

import torch

from . import routes
from .checkpoint import Checkpoint
from .layers import combine, expert_forward, group_by_expert


class LocalExperts:
    """All (or some) routed experts of a checkpoint in this process, in compute layout."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, experts: list[tuple[int, int]] | None = None,
                 device: torch.device | str = "cpu"):
        cfg = self.cfg = ckpt.config
        ids = experts if experts is not None else [(l, e) for l in cfg.sparse_layers for e in range(cfg.num_experts)]
        self.weights = {eid: {k: t.contiguous().to(device) for k, t in ckpt.expert(*eid, dtype=dtype).items()}
                        for eid in ids}

    def forward(self, layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{expert: its tokens' hidden states} -> {expert: its outputs}."""
        return {e: expert_forward(self.cfg, x, self.weights[(layer, e)]) for e, x in inputs.items()}

    def moe(self, layer: int, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if indices.numel() <= routes.SMALL:  # decode: the routing in Python ints
            r = routes.route(indices)
            experts = list(r.by_expert)
            outputs = [expert_forward(self.cfg, routes.gather(x, r, [e]), self.weights[(layer, e)]) for e in experts]
            return routes.combine(r, r.order(experts), torch.cat(outputs) if len(outputs) > 1 else outputs[0],
                                  weights, x.dtype)
        groups = group_by_expert(indices)
        outputs = self.forward(layer, {e: x[rows] for e, (rows, _) in groups.items()})
        return combine(x.shape[0], x.shape[1], x.dtype, groups, outputs, weights)


def compute_rows(weights: dict, keys: list[tuple[int, int]], counts: list[int], x: torch.Tensor,
                 out: torch.Tensor, cfg) -> None:
    """`counts[i]` rows of x for expert keys[i], written into out. The rows go to the weights'
    device and back when they differ (rows from the socket into a GPU hot tier); rows that came
    on a device link are already there."""
    device = next(iter(weights[keys[0]].values())).device if keys else x.device
    xd = x if x.device == device else x.to(device, non_blocking=True)
    od = out if out.device == device else torch.empty_like(xd)
    start = 0
    for key, n in zip(keys, counts):
        expert_forward(cfg, xd[start:start + n], weights[key], out=od[start:start + n])
        start += n
    if od is not out:
        out.copy_(od)
