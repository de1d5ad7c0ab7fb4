"""Experts held in one process: weights per (layer, expert), computed per dispatch."""

from __future__ import annotations

import torch

from . import grouped, native, routes
from .checkpoint import Checkpoint
from .layers import combine, expert_forward, group_by_expert


# rows an expert (on average over the layer's experts) for which the CPU takes grouped GEMM over
# the per-expert loop: past the C kernels' few rows and below where one GEMM an expert runs well.
# bench/grouped.py (2-core EPYC, bf16): Qwen3-30B-A3B prefill 512 (32 rows an expert) grouped 1.69x
# the loop; batch 16 / 64 (1 / 4 rows, C kernels) 0.57 / 0.67; DeepSeek-V3 shape, 32 experts,
# batch 64 (16 rows) 0.86, prefill 512 (128 rows) 0.81
GROUPED_CPU_ROWS = (native.ROWS_MAX, 64)


class LocalExperts:
    """All (or some) routed experts of a checkpoint in this process, in compute layout.

    With every expert of a layer here, the layer's experts are one (E, ...) tensor per part
    (`grouped.stack`; each expert's weights are views of it): on a GPU a layer runs as grouped
    GEMM with its routing on the device (`grouped.moe`, no host read); on the CPU a decode step's
    rows go through the C kernels and larger steps through `compute_rows`."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, experts: list[tuple[int, int]] | None = None,
                 device: torch.device | str = "cpu"):
        cfg = self.cfg = ckpt.config
        self.device = torch.device(device)
        ids = experts if experts is not None else [(l, e) for l in cfg.sparse_layers for e in range(cfg.num_experts)]
        self.weights: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.stacked: dict[int, dict[str, torch.Tensor]] = {}
        for layer in dict.fromkeys(l for l, _ in ids):
            mine = [e for l, e in ids if l == layer]
            loaded = [{k: t.contiguous() for k, t in ckpt.expert(layer, e, dtype=dtype).items()} for e in mine]
            if mine == list(range(cfg.num_experts)):
                self.stacked[layer] = {k: t.to(self.device) for k, t in grouped.stack(loaded).items()}
                loaded = [{k: t[e] for k, t in self.stacked[layer].items()} for e in mine]
            else:
                loaded = [{k: t.to(self.device) for k, t in w.items()} for w in loaded]
            self.weights.update({(layer, e): w for e, w in zip(mine, loaded)})

    def grouped(self, layer: int, x: torch.Tensor, indices: torch.Tensor) -> bool:
        """Whether this layer's step runs as grouped GEMM (see the class)."""
        if layer not in self.stacked or not grouped.applies(self.device, x.dtype):
            return False
        if self.device.type != "cpu":
            return True
        rows = indices.numel()
        low, high = GROUPED_CPU_ROWS
        return low < rows / min(self.cfg.num_experts, rows) <= high

    def forward(self, layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{expert: its tokens' hidden states} -> {expert: its outputs}, through `compute_rows`."""
        experts = list(inputs)
        counts = [inputs[e].shape[0] for e in experts]
        out = self._compute(layer, experts, counts, torch.cat([inputs[e] for e in experts]))
        return dict(zip(experts, out.split(counts)))

    def moe(self, layer: int, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.grouped(layer, x, indices):
            return grouped.moe(self.cfg, x, indices, weights, self.stacked[layer])
        if indices.numel() <= routes.SMALL:  # decode: the routing in Python ints
            r = routes.route(indices)
            experts = list(r.by_expert)
            out = self._compute(layer, experts, [len(r.by_expert[e]) for e in experts], routes.gather(x, r, experts))
            return routes.combine(r, r.order(experts), out, weights, x.dtype)
        groups = group_by_expert(indices)
        experts = list(groups)
        counts = [groups[e][0].numel() for e in experts]
        out = self._compute(layer, experts, counts, x[torch.cat([groups[e][0] for e in experts])])
        return combine(x.shape[0], x.shape[1], x.dtype, groups, dict(zip(experts, out.split(counts))), weights)

    def _compute(self, layer: int, experts: list[int], counts: list[int], rows: torch.Tensor) -> torch.Tensor:
        """`counts[i]` rows for experts[i] of `layer`, concatenated in that order -> their outputs."""
        out = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        compute_rows(self.weights, [(layer, e) for e in experts], counts, rows, out, self.cfg)
        return out


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
    few = [i for i, n in enumerate(counts) if 0 < n <= native.ROWS_MAX]  # these in one native call where it applies
    if not few or not native_rows(
            cfg, [xd[starts[i]:starts[i + 1]] for i in few], [weights[keys[i]] for i in few],
            [od[starts[i]:starts[i + 1]] for i in few]):
        few = []
    done = set(few)
    for i, (key, n) in enumerate(zip(keys, counts)):
        if i not in done:
            expert_forward(cfg, xd[starts[i]:starts[i] + n], weights[key], out=od[starts[i]:starts[i] + n])
    if od is not out:
        out.copy_(od)


def native_rows(cfg, xs: list[torch.Tensor], ws: list[dict[str, torch.Tensor]], outs: list[torch.Tensor]) -> bool:
    """A decode step's SwiGLU experts, up to `native.ROWS_MAX` bfloat16 rows each on the CPU,
    through the C kernels (`native.swiglu_rows`, gpt_oss' clamped SwiGLU with biases through
    `native.gptoss_rows`: every expert's gate/up rows in one call, then its down rows, each weight
    row read once for all of its expert's rows, split across torch's threads) instead of products
    and element-wise ops per expert in Python; the same values within bfloat16's rounding, and a
    row's values do not depend on how many rows share its expert. False, with nothing done, where
    they do not apply: another dtype or device, more rows, no C compiler."""
    if not xs or xs[0].dtype != torch.bfloat16 or xs[0].device.type != "cpu":
        return False
    gpt_oss = cfg.expert_act == "gpt_oss"
    parts = [(w["gate_up"], w["gate_up_bias"], w["down"], w["down_bias"]) if gpt_oss else (w["w1"], w["w3"], w["w2"])
             for w in ws]
    if any(not 0 < x.shape[0] <= native.ROWS_MAX for x in xs) or any(
            t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous() for p in parts for t in p):
        return False
    if native.library() is None:
        return False
    if gpt_oss:
        native.gptoss_rows(xs, *([p[k] for p in parts] for k in range(4)), cfg.swiglu_alpha, cfg.swiglu_limit,
                           cfg.experts_out_in, outs)
    else:
        native.swiglu_rows(xs, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], outs)
    return True
