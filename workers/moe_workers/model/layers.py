"""Mixtral building blocks, computed the way Hugging Face transformers computes them.

Precision choices follow transformers' modeling_mixtral: RMSNorm in float32 then cast back,
rotary cos/sin in float32, router softmax in float32 with top-k renormalisation, and each
expert's weighted contribution cast to the hidden dtype before it is accumulated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (N, head_dim) for integer positions (N,)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, head_dim); cos/sin: (N, head_dim)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def route(x: torch.Tensor, gate: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router: (indices (N, k), renormalised float32 weights (N, k))."""
    probs = torch.softmax(F.linear(x, gate).float(), dim=-1)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return indices, weights


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU expert: w2(silu(w1 x) * w3 x), written into `out` when given.

    The activation and the product are computed in place and the last matmul writes straight
    into `out`: two (rows, intermediate) temporaries instead of four plus a copy. Same values
    as the out-of-place form (same kernels, same order); a prefill step allocates gigabytes
    less, and fresh large allocations cost page faults."""
    gate = F.linear(x, w1)
    F.silu(gate, inplace=True)
    gate.mul_(F.linear(x, w3))
    if out is None:
        return F.linear(gate, w2)
    return torch.mm(gate, w2.t(), out=out)


def group_by_expert(indices: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{expert: (token rows, top-k slot)} for the (N, k) router indices, experts ascending."""
    if indices.numel() <= _SMALL_ROWS:  # decode: a few Python ints beat argsort/unique/split
        k = indices.shape[1]
        buckets: dict[int, tuple[list[int], list[int]]] = {}
        for pos, e in enumerate(indices.reshape(-1).tolist()):
            rows, slots = buckets.setdefault(e, ([], []))
            rows.append(pos // k)
            slots.append(pos % k)
        dev = indices.device
        return {e: (torch.tensor(buckets[e][0], device=dev), torch.tensor(buckets[e][1], device=dev))
                for e in sorted(buckets)}
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    k = indices.shape[1]
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for e, chunk in zip(experts.tolist(), torch.split(order, counts.tolist())):
        out[e] = (chunk // k, chunk % k)
    return out


def combine(
    num_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    groups: dict[int, tuple[torch.Tensor, torch.Tensor]],
    outputs: dict[int, torch.Tensor],
    weights: torch.Tensor,
) -> torch.Tensor:
    """Sum of weighted expert outputs per token, accumulated in ascending expert order."""
    result = torch.zeros(num_tokens, hidden, dtype=dtype, device=weights.device)
    for e in sorted(groups):
        rows, slots = groups[e]
        contribution = (outputs[e] * weights[rows, slots, None]).to(dtype)
        if rows.numel() <= _SMALL_ROWS:
            result[rows] += contribution  # an expert's rows are distinct: the same additions as index_add_
        else:
            result.index_add_(0, rows, contribution)
    return result


# index_add_ runs an OpenMP parallel region whatever its size: with two intra-op threads on a
# machine whose other core is busy (shard replicas, Ray), a decode step's index_add_ waits for the
# second thread to be scheduled, measured at 28 ms for one row (5 us on an idle machine). Below
# this many rows the gather / add / scatter form is used, which runs on the calling thread.
_SMALL_ROWS = 64
