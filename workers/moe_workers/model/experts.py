"""Experts held in one process: weights per (layer, expert), computed per dispatch."""

from __future__ import annotations

import torch

from . import native, routes
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
        """{expert: its tokens' hidden states} -> {expert: its outputs}; the experts with one row
        in one native call (`native_rows`), the rest one by one."""
        single = [e for e, x in inputs.items() if x.shape[0] == 1]
        out: dict[int, torch.Tensor] = {}
        if len(single) > 1:
            rows = torch.empty(len(single), next(iter(inputs.values())).shape[1], dtype=inputs[single[0]].dtype)
            if native_rows(self.cfg, [inputs[e] for e in single], [self.weights[(layer, e)] for e in single],
                           list(rows.split(1))):
                out.update(zip(single, rows.split(1)))
        return {e: out[e] if e in out else expert_forward(self.cfg, x, self.weights[(layer, e)])
                for e, x in inputs.items()}

    def moe(self, layer: int, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if indices.numel() <= routes.SMALL:  # decode: the routing in Python ints
            r = routes.route(indices)
            experts = list(r.by_expert)
            xs = [routes.gather(x, r, [e]) for e in experts]
            ws = [self.weights[(layer, e)] for e in experts]
            out = torch.empty(len(experts), x.shape[1], dtype=x.dtype, device=x.device)
            if native_rows(self.cfg, xs, ws, list(out.split(1))):
                outputs = out
            else:
                outputs = [expert_forward(self.cfg, xe, w) for xe, w in zip(xs, ws)]
                outputs = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
            return routes.combine(r, r.order(experts), outputs, weights, x.dtype)
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
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    single = [i for i, n in enumerate(counts) if n == 1]  # these in one native call where it applies
    if len(single) < 2 or not native_rows(cfg, [xd[starts[i]:starts[i] + 1] for i in single],
                                          [weights[keys[i]] for i in single], [od[starts[i]:starts[i] + 1] for i in single]):
        single = []
    done = set(single)
    for i, (key, n) in enumerate(zip(keys, counts)):
        if i not in done:
            expert_forward(cfg, xd[starts[i]:starts[i] + n], weights[key], out=od[starts[i]:starts[i] + n])
    if od is not out:
        out.copy_(od)


def native_rows(cfg, xs: list[torch.Tensor], ws: list[dict[str, torch.Tensor]], outs: list[torch.Tensor]) -> bool:
    """A decode step's SwiGLU experts, one bfloat16 row each on the CPU, through the C kernels
    (`native.swiglu_rows`: every expert's gate/up rows in one call, then its down rows, split
    across the torch threads) instead of three products and two element-wise ops per expert in
    Python; the same values within bfloat16's rounding. False, with nothing done, where they do
    not apply: gpt_oss' activation, another dtype or device, several rows, no C compiler."""
    if not xs or cfg.expert_act == "gpt_oss" or xs[0].dtype != torch.bfloat16 or xs[0].device.type != "cpu":
        return False
    parts = [(w["w1"], w["w3"], w["w2"]) for w in ws]
    if any(x.shape[0] != 1 for x in xs) or any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous()
                                               for p in parts for t in p):
        return False
    if native.library() is None:
        return False
    native.swiglu_rows([x[0] for x in xs], [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts],
                       [o[0] for o in outs])
    return True
