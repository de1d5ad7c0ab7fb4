"""MoE building blocks, computed the way Hugging Face transformers computes them.

Precision choices follow transformers' modeling files (mixtral, qwen2/3_moe, olmoe, deepseek_v3,
gpt_oss): RMSNorm in float32 then cast back, rotary cos/sin in float32 (scaled by YaRN's
attention factor when configured), routers in float32, and each expert's weighted contribution
cast to the hidden dtype before it is accumulated.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import native


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except a decode step's few bf16 rows on the CPU (up to `native.ROWS_MAX`): there
    the C kernel (`native.matvec`, each row of w read once for all of x's rows, w's rows split over
    torch's threads) reads the weights at 19-30 GB/s for one row where torch's matrix-vector
    product reads them at 6-16 and F.linear at 11-19 (2 cores, AMD EPYC; `bench/realshape.py --only
    kernels`); one row through torch.mv where there is no C compiler. Same products, summed in
    another order: within bf16's rounding of F.linear."""
    if not (x.dim() == 2 and x.shape[0] <= native.ROWS_MAX and x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return F.linear(x, w, bias)
    if w.dtype == torch.bfloat16 and w.is_contiguous() and native.library() is not None:
        y = native.matvec(w, x, torch.empty(x.shape[0], w.shape[0], dtype=x.dtype))
    elif x.shape[0] == 1:
        y = torch.mv(w, x[0]).unsqueeze(0)
    else:
        return F.linear(x, w, bias)
    return y if bias is None else y.add_(bias)


def in_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w for weights in transformers' [in, out] layout (gpt-oss' bf16 experts). One bf16 row on
    the CPU goes through the C kernel, which reads each row of w once, in order (26-30 GB/s where
    torch's x @ w reads this layout at 10-12; `bench/realshape.py --only kernels`); else torch."""
    if (x.dim() == 2 and x.shape[0] == 1 and x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu"
            and w.device.type == "cpu" and w.is_contiguous() and native.library() is not None):
        return native.vecmat(x[0], w, torch.empty(1, w.shape[1], dtype=x.dtype))
    return x @ w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(head_dim: int, theta: float, params: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, the factor cos/sin are scaled by): plain rope, or YaRN as
    transformers' _compute_yarn_parameters computes it."""
    if params.get("rope_type", "default") != "yarn":
        return rope_inv_freq(head_dim, theta), 1.0
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
                            if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def attention_mscale(params: dict) -> float:
    """DeepSeek's softmax scale correction under YaRN (mscale_all_dim), squared as transformers applies it."""
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(params["factor"], params["mscale_all_dim"])
        return m * m
    return 1.0


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (N, head_dim) for integer positions (N,)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scaling == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, head_dim); cos/sin: (N, head_dim)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


# Every router takes `excluded`: None (the family's router exactly), or a bool tensor over the
# layer's experts, True for a quarantined one (spec.routing.quarantine). An excluded expert is
# never among the candidates of the top-k choice, so its tokens take their next choice; the
# weights are then computed from the chosen experts' scores as the family does (renormalised over
# the k chosen where it renormalises, a softmax over the k chosen logits for gpt-oss).


def route(x: torch.Tensor, gate: torch.Tensor, top_k: int, norm: bool = True,
          excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router (mixtral, qwen, olmoe): (indices (N, k), float32 weights (N, k)),
    renormalised over the k when `norm`."""
    probs = torch.softmax(F.linear(x, gate).float(), dim=-1)
    if excluded is not None:
        probs = probs.masked_fill(excluded, float("-inf"))
    weights, indices = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return indices, weights


def route_topk_softmax(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int,
                       excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt_oss: top-k of the biased logits, then a softmax over those k only."""
    logits = F.linear(x, gate, bias)
    if excluded is not None:
        logits = logits.masked_fill(excluded, float("-inf"))
    values, indices = torch.topk(logits, top_k, dim=-1)
    return indices, torch.softmax(values, dim=1, dtype=values.dtype)


def route_sigmoid_group(x: torch.Tensor, gate: torch.Tensor, correction: torch.Tensor, top_k: int, n_group: int,
                        topk_group: int, norm: bool, scale: float,
                        excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; the correction bias steers the choice only; experts are
    chosen within the `topk_group` groups whose two best biased scores sum highest; weights are
    the unbiased scores, renormalised when `norm`, times `scale`."""
    scores = F.linear(x.float(), gate.float()).sigmoid()
    n, e = scores.shape
    choice = scores + correction
    if excluded is not None:  # the biased choice, not the scores: the bias would make it a candidate again
        choice = choice.masked_fill(excluded, float("-inf"))
    group_scores = choice.view(n, n_group, e // n_group).topk(2 if e // n_group > 1 else 1, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return indices, weights * scale


def route_softmax_group(x: torch.Tensor, gate: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                        scale: float, excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax scores; with groups, only the `topk_group` groups whose best score is
    highest compete (the rest scored 0); weights are the scores times `scale`, not renormalised."""
    scores = F.linear(x.float(), gate.float()).softmax(dim=-1, dtype=torch.float32)
    if excluded is not None:  # a group is ranked by its best expert still a candidate
        scores = scores.masked_fill(excluded, float("-inf"))
    if n_group > 1:
        n, e = scores.shape
        group_scores = scores.view(n, n_group, e // n_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
        if excluded is not None:  # the 0 fill of the groups left out would make it a candidate again
            scores = scores.masked_fill(excluded, float("-inf"))
    weights, indices = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return indices, weights * scale


def mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP (dense layers, shared experts): down(silu(gate x) * up x), gate and up
    stacked as one [gate; up] weight (one product over x)."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU expert: w2(silu(w1 x) * w3 x), written into `out` when given.

    The activation and the product are computed in place and the last matmul writes straight
    into `out`: two (rows, intermediate) temporaries instead of four plus a copy. Same values
    as the out-of-place form (same kernels, same order); a prefill step allocates gigabytes
    less, and fresh large allocations cost page faults."""
    gate = linear(x, w1)
    F.silu(gate, inplace=True)
    gate.mul_(linear(x, w3))
    if out is None:
        return linear(gate, w2)
    if gate.shape[0] <= native.ROWS_MAX:  # `linear`'s decode-rows path, as without `out`
        return out.copy_(linear(gate, w2))
    return torch.mm(gate, w2.t(), out=out)


def expert_forward(cfg, x: torch.Tensor, w: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One routed expert of the model's family on rows x (its parts: `cfg.expert_parts()`)."""
    if cfg.expert_act == "gpt_oss":
        return gpt_oss_expert(x, w, cfg.swiglu_alpha, cfg.swiglu_limit, out, out_in=cfg.experts_out_in)
    return expert_mlp(x, w["w1"], w["w2"], w["w3"], out=out)


def gpt_oss_expert(x: torch.Tensor, w: dict[str, torch.Tensor], alpha: float, limit: float,
                   out: torch.Tensor | None = None, out_in: bool = False) -> torch.Tensor:
    """gpt_oss' clamped SwiGLU with biases; gate and up interleaved in gate_up's columns.
    `out_in`: the weights in [out, in] (decoded from mxfp4) instead of transformers' [in, out]."""
    gate_up = linear(x, w["gate_up"], w["gate_up_bias"]) if out_in else in_out(x, w["gate_up"]) + w["gate_up_bias"]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    result = linear(act, w["down"], w["down_bias"]) if out_in else in_out(act, w["down"]) + w["down_bias"]
    if out is None:
        return result
    out.copy_(result)
    return out


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
