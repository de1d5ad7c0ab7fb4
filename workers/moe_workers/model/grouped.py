"""A layer's routed experts with the routing kept on the device: rows sorted by expert, each
product over all experts in one grouped GEMM (`F.grouped_mm`), the combine by index, and no value
read by the host (vLLM's fused MoE, SGLang's, and torch's grouped GEMM do it so).

The per-expert loop (`experts.compute_rows`) needs each expert's row count on the host: on a GPU
that is a wait for the device every layer, and about six kernel launches per active expert. Here
a layer is a fixed number of kernels whatever the routing: argsort, bincount and cumsum of the
router's picks, one gather of the rows, three grouped products (two for gpt_oss) and the combine.

The combine gives what `layers.combine` gives from the same expert outputs: each (token, slot)
output times its float32 weight, cast to the hidden dtype, summed per token in ascending expert
order. The products themselves may sum in another order than one F.linear per expert: equal
within the dtype's rounding (tests/unit/test_grouped.py).

`F.grouped_mm` takes bfloat16 on CUDA (compute capability 8.0 or newer) and any float dtype on
the CPU; `applies()` says where this path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped GEMM runs for these weights (CUDA's kernel is bfloat16 only)."""
    return hasattr(F, "grouped_mm") and (device.type == "cpu" or dtype == torch.bfloat16)


def stack(experts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One layer's experts (every expert, in id order) as (E, ...) tensors per part."""
    return {name: torch.stack([w[name] for w in experts]) for name in experts[0]}


def sort_rows(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For (N, k) router picks: the (token, slot) pairs in expert order (flat positions, N * k),
    each sorted row's expert, and the int32 end offset of each expert's rows (E,)."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # a count per expert into E slots (bincount's length depends on the values: a host read)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    return order, flat[order], ends


def _mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, out_in: bool) -> torch.Tensor:
    """x's rows by their expert's w: (E, out, in) weights when out_in, else (E, in, out)."""
    return F.grouped_mm(x, w.transpose(1, 2) if out_in else w, offs=ends)


def experts(cfg, x: torch.Tensor, w: dict[str, torch.Tensor], ends: torch.Tensor,
            expert_of_row: torch.Tensor) -> torch.Tensor:
    """The routed experts of the model's family on rows x sorted by expert (`sort_rows`)."""
    if cfg.expert_act == "gpt_oss":
        out_in = cfg.experts_out_in
        gate_up = _mm(x, w["gate_up"], ends, out_in) + w["gate_up_bias"][expert_of_row]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=cfg.swiglu_limit)
        up = up.clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))
        return _mm(act, w["down"], ends, out_in) + w["down_bias"][expert_of_row]
    gate = _mm(x, w["w1"], ends, True)
    F.silu(gate, inplace=True)
    gate.mul_(_mm(x, w["w3"], ends, True))
    return _mm(gate, w["w2"], ends, True)


def combine(order: torch.Tensor, outputs: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """(N, hidden): `outputs` row i is the output for flat (token, slot) position order[i]; each
    times its weight, cast to `dtype`, summed per token in ascending expert order."""
    n, k = indices.shape
    contributions = (outputs * weights.reshape(-1)[order, None]).to(dtype)
    by_slot = torch.empty_like(contributions).index_copy_(0, order, contributions).view(n, k, -1)
    if k == 1:
        return by_slot[:, 0]
    ascending = torch.argsort(indices, dim=1, stable=True)
    ordered = by_slot.gather(1, ascending[..., None].expand(n, k, by_slot.shape[2]))
    first, *rest = ordered.unbind(1)
    for c in rest:
        first = first + c
    return first


def moe(cfg, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """A sparse layer's routed output for hidden states x (N, hidden): no host read."""
    order, expert_of_row, ends = sort_rows(indices, w[next(iter(w))].shape[0])
    rows = x[order // indices.shape[1]]
    return combine(order, experts(cfg, rows, w, ends, expert_of_row), indices, weights, x.dtype)
