"""The dense part of an MoE model (everything but the routed experts), over a paged KV cache.

One forward *step* processes a flat batch of tokens from many sequences at once: prompt chunks
(prefill, from any position: a cached prefix or an earlier chunk before it) and single decode
tokens side by side. Linear layers and the expert dispatch see all the step's tokens together;
attention reads each sequence's keys through its block table (`kv_cache.PagedKVCache`), per
chunk for prefill and batched over the decode sequences with a position mask. The family (`MoEConfig`) decides the attention variant, the
router, and what runs beside the routed experts here: a dense MLP in layers without experts,
shared experts in layers with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moe_workers.device import host_to_device
from moe_workers.expert_ids import ExpertId

from .checkpoint import Checkpoint
from .config import CheckpointError, MoEConfig
from .kv_cache import GroupPlan, PagedKVCache
from .layers import (apply_rope, attention_mscale, linear, mlp, rms_norm, rope_cos_sin, rope_parameters, route,
                     route_sigmoid_group, route_softmax_group, route_topk_softmax)


@dataclass
class Chunk:
    """Tokens of one sequence in a step: positions start .. start+len(tokens)-1. `slot`: the
    sequence's id in the KV cache (its block tables); `key`: the API key id of its request
    (`serve.auth.key_id`), which routing statistics count expert-tokens by."""

    slot: int
    start: int
    tokens: list[int]
    key: str = "-"


@dataclass
class StepBatch:
    """A step's chunks, flattened. Row i of every (N, ...) tensor is token i of the step."""

    chunks: list[Chunk]
    ids: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    offsets: list[int] = field(init=False)
    last_rows: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        ids, pos, offsets = [], [], []
        for c in self.chunks:
            offsets.append(len(ids))
            ids.extend(c.tokens)
            pos.extend(range(c.start, c.start + len(c.tokens)))
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.positions = torch.tensor(pos, dtype=torch.long)
        self.offsets = offsets
        self.last_rows = torch.tensor([o + len(c.tokens) - 1 for o, c in zip(offsets, self.chunks)], dtype=torch.long)
        self.decode = [i for i, c in enumerate(self.chunks) if len(c.tokens) == 1]
        self.prefill = [i for i, c in enumerate(self.chunks) if len(c.tokens) > 1]
        self.kv: list[GroupPlan] | None = None  # the cache's index tensors, made at the first layer
        self.decode_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def to(self, device: torch.device) -> None:
        """The index tensors onto the dense part's device (once, at embedding)."""
        if self.ids.device != device:
            self.ids, self.positions, self.last_rows = (host_to_device(t, device)
                                                        for t in (self.ids, self.positions, self.last_rows))


def _fuse(w: dict) -> None:
    """One product where several read the same input: q, k and v (with their biases) as one
    [q; k; v] weight, DeepSeek's q_a and kv_a as one, and each SwiGLU MLP's gate and up as one
    [gate; up] (`layers.mlp`). A decode step then makes one call and one pass over x per group
    instead of two or three; each output row is the same dot product as before."""
    if "k" in w:
        parts = [w.pop(c) for c in ("q", "k", "v")]
        biases = [w.pop(f"{c}_bias") for c in ("q", "k", "v")]
        w["qkv"] = torch.cat(parts)
        w["qkv_bias"] = torch.cat(biases) if all(b is not None for b in biases) else None
    if "q_a" in w:
        q_a, kv_a = w.pop("q_a"), w.pop("kv_a")
        w["q_a_kv_a"] = torch.cat((q_a, kv_a))
    for role in ("mlp", "shared"):
        if role + ".gate" in w:
            gate, up, down = (w.pop(f"{role}.{k}") for k in ("gate", "up", "down"))
            w[role] = (torch.cat((gate, up)), down)


# roles a layer may lack (biases, norms, sinks): None where the family has none
_OPTIONAL = ("o_bias", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "sinks")


class DenseModel:
    """Embeddings, attention, norms, routers, dense and shared MLPs and lm_head of a checkpoint,
    on `device` (the ingress' GPU when Ray assigned it one; the CPU otherwise)."""

    def __init__(self, cfg: MoEConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        dt = cfg.dtype

        def get(name: str, dtype: torch.dtype | None = dt) -> torch.Tensor:
            try:
                t = state[name]
            except KeyError:
                raise CheckpointError(f"checkpoint: tensor {name} is missing") from None
            return (t.to(dtype) if dtype is not None else t).contiguous().to(self.device)  # converted on the host first

        self.embed_tokens = get("model.embed_tokens.weight")
        self.final_norm = get("model.norm.weight")
        if "lm_head.weight" in state:
            self.lm_head = get("lm_head.weight")
        elif cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            raise CheckpointError("checkpoint: tensor lm_head.weight is missing")
        self.layers = []
        deepseek = cfg.router in ("sigmoid_group", "softmax_group")
        for i in range(cfg.num_layers):
            # the names and roles from the config's one table (`Arch.layer_tensors`), the checker's too
            w: dict = dict.fromkeys(_OPTIONAL)
            for role, (name, _) in cfg.layer_tensors(i).items():
                if role == "gate" and deepseek:  # transformers computes DeepSeek's router in float32
                    w[role] = get(name, None).float()
                else:
                    w[role] = get(name, torch.float32 if role == "correction" else dt)
            _fuse(w)
            self.layers.append(w)
        inv_freq, self.rope_scaling = rope_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_params,
                                                      cfg.max_position_embeddings)
        self.inv_freq = inv_freq.to(self.device)
        # spec.routing.quarantine: per sparse layer, a bool mask over its experts (True: not a
        # candidate of its router); replaced whole by `quarantine()`, so a step reads one or the other
        self.excluded: dict[int, torch.Tensor] = {}
        # spec.routing.capacityFactor: None routes exactly; else each expert takes at most
        # factor x tokens x top_k / experts of a forward call's choices (`pick_within_capacity`)
        self.capacity_factor: float | None = None
        self.rerouted: dict[int, int] = {}  # per layer, tokens routed again for capacity (a counter)
        self.mla_absorb = True  # latent attention decodes absorbed (False: expanded, for the bench)
        self._absorb: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, w in enumerate(self.layers if cfg.mla else []):
            wkv = w["kv_b"].view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            self._absorb[i] = (wkv[:, :cfg.qk_nope_head_dim].contiguous(),
                               wkv[:, cfg.qk_nope_head_dim:].transpose(1, 2).contiguous())
        if cfg.mla:
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            self.scaling = qk ** -0.5 * attention_mscale(cfg.rope_params)
        else:
            self.scaling = cfg.head_dim ** -0.5

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype | None = None) -> "DenseModel":
        cfg = ckpt.config if dtype is None else ckpt.config.with_dtype(dtype)
        return cls(cfg, ckpt.dense_state())

    def nbytes(self) -> int:
        tensors = [self.embed_tokens, self.final_norm]
        for layer in self.layers:
            for t in layer.values():
                tensors.extend(t if isinstance(t, tuple) else [t])
        if self.lm_head is not self.embed_tokens:
            tensors.append(self.lm_head)
        tensors.extend(t for pair in self._absorb.values() for t in pair)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # -- one step, in pieces the drivers (in-process and served) call in order ----------------

    def embed(self, batch: StepBatch) -> torch.Tensor:
        batch.to(self.device)
        batch.cos, batch.sin = rope_cos_sin(batch.positions, self.inv_freq, self.cfg.dtype, self.rope_scaling)
        return F.embedding(batch.ids, self.embed_tokens)

    def attention(self, layer: int, h: torch.Tensor, batch: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """h + self-attention(input_layernorm(h)); writes this step's keys/values into the cache."""
        if self.cfg.mla:
            return self._latent_attention(layer, h, batch, cache)
        cfg, w = self.cfg, self.layers[layer]
        x = rms_norm(h, w["in_norm"], cfg.rms_norm_eps)
        n = x.shape[0]
        kv = cfg.num_kv_heads * cfg.head_dim
        q, k, v = linear(x, w["qkv"], w["qkv_bias"]).split([cfg.num_heads * cfg.head_dim, kv, kv], dim=-1)
        if cfg.qk_norm == "full":  # olmoe: over the whole projection
            q, k = rms_norm(q, w["q_norm"], cfg.rms_norm_eps), rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":  # qwen3_moe: per head
            q, k = rms_norm(q, w["q_norm"], cfg.rms_norm_eps), rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, batch.cos, batch.sin)
        k = apply_rope(k, batch.cos, batch.sin)
        out = self._attend(layer, q, k, v, batch, cache, lambda kk, vv: (kk, vv), w["sinks"])
        return h + linear(out.reshape(n, cfg.num_heads * cfg.head_dim), w["o"], w["o_bias"])

    def _latent_attention(self, layer: int, h: torch.Tensor, batch: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """DeepSeek's multi-head latent attention: the cache keeps the normed KV latent and the
        roped shared key. Prefill expands keys and values from them (kv_b_proj); decode attends
        in the latent space (`mla_absorb`), which reads r + d numbers a cached token instead of
        expanding heads x (nope + v) of them."""
        cfg, w = self.cfg, self.layers[layer]
        nope, rope_dim, vdim, heads = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.num_heads
        x = rms_norm(h, w["in_norm"], cfg.rms_norm_eps)
        n = x.shape[0]
        if cfg.q_lora_rank:  # q_a and kv_a read x in one product (`_fuse`)
            q_a, latent, k_rot = linear(x, w["q_a_kv_a"]).split([cfg.q_lora_rank, cfg.kv_lora_rank, rope_dim], dim=-1)
            q = linear(rms_norm(q_a, w["q_a_norm"], 1e-6), w["q_b"])
        else:
            q = linear(x, w["q"])
            latent, k_rot = linear(x, w["kv_a"]).split([cfg.kv_lora_rank, rope_dim], dim=-1)
        q = q.view(n, heads, nope + rope_dim)
        q_pass, q_rot = q[..., :nope], q[..., nope:]
        latent = rms_norm(latent, w["kv_a_norm"], 1e-6)
        rotate = _rope_interleaved if cfg.rope_interleave else apply_rope
        q_rot = rotate(q_rot, batch.cos, batch.sin)
        k_rot = rotate(k_rot.view(n, 1, rope_dim), batch.cos, batch.sin)
        query = torch.cat((q_pass, q_rot), dim=-1)

        def expand(lat: torch.Tensor, kr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """(B, 1, T, r) latent + (B, 1, T, d) shared key -> keys (B, H, T, nope+d), values (B, H, T, v)."""
            b, _, t, _ = lat.shape
            kv = linear(lat[:, 0], w["kv_b"]).view(b, t, heads, nope + vdim).transpose(1, 2)
            keys = torch.cat((kv[..., :nope], kr.expand(b, heads, t, rope_dim)), dim=-1)
            return keys, kv[..., nope:]

        def absorbed(qd: torch.Tensor, lat: torch.Tensor, kr: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            """Decode in the latent space (DeepSeek's inference code): the query through kv_b's
            key part, attention over the cached latent itself, then kv_b's value part; nothing
            is expanded per cached token. qd (B, H, nope+d), lat (B, 1, L, r), kr (B, 1, L, d)."""
            uk, uv = self._absorbed(layer)
            q_lat = torch.bmm(qd[..., :nope].transpose(0, 1), uk).transpose(0, 1)  # (B, H, r)
            scores = (torch.matmul(q_lat, lat[:, 0].transpose(1, 2))
                      + torch.matmul(qd[..., nope:], kr[:, 0].transpose(1, 2))) * self.scaling  # (B, H, L)
            scores = scores.masked_fill(~mask[:, 0], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(lat.dtype)
            out_lat = torch.matmul(probs, lat[:, 0])  # (B, H, r)
            return torch.bmm(out_lat.transpose(0, 1), uv).transpose(0, 1)  # (B, H, v)

        out = self._attend(layer, query, latent.view(n, 1, -1), k_rot, batch, cache, expand, None,
                           absorbed if self.mla_absorb else None)
        return h + linear(out.reshape(n, heads * vdim), w["o"], w["o_bias"])

    def _absorbed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head for absorbed decode, made at load: (H, nope, r) for the
        query, (H, r, v) for the output (a copy of kv_b, small beside the layer's projections)."""
        return self._absorb[layer]

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                cache: PagedKVCache, expand, sinks: torch.Tensor | None, decode=None) -> torch.Tensor:
        """Writes k, v (N, heads, dim) into the cache, then attends each token to its sequence's
        cached positions (causal; within the layer's sliding window when it has one), read
        through its block table. `expand` turns cached (B, heads, T, dim) keys/values into the
        attention's; `decode` (latent attention), if given, attends the decode rows itself."""
        if batch.kv is None:  # once a step: every layer of a group reads the same blocks
            batch.kv = cache.plan(batch)
            batch.decode_rows = host_to_device(torch.tensor([batch.offsets[i] for i in batch.decode], dtype=torch.long),
                                               q.device)
        plan = batch.kv[cache.group_of(layer)]
        cache.write(layer, batch.kv, k, v)  # first: a token attends to itself
        n, heads = q.shape[0], q.shape[1]
        out = None
        for (blocks, mask), i in zip(plan.prefill, batch.prefill):
            c, o = batch.chunks[i], batch.offsets[i]
            m = len(c.tokens)
            qi = q[o:o + m].transpose(0, 1).unsqueeze(0)          # (1, H, m, d)
            ki, vi = expand(*cache.gather(layer, blocks))
            oi = self._sdpa(qi, ki, vi, mask, sinks)
            if out is None:
                out = q.new_empty(n, heads, oi.shape[-1])
            out[o:o + m] = oi[0].transpose(0, 1)
        if batch.decode:
            rows = batch.decode_rows
            # FlexAttention over the pool where the cache reads that way (None: it does not)
            od = cache.flex_decode(layer, q[rows], batch.kv, self.scaling) if decode is None and sinks is None else None
            if od is not None:
                pass
            elif decode is not None:
                od = decode(q[rows], *cache.gather(layer, plan.decode_blocks), plan.decode_mask)  # (B, H, dv)
            else:
                kd, vd = expand(*cache.gather(layer, plan.decode_blocks))  # (B, KVH, L, d)
                od = decode_attention(q[rows], kd, vd, plan.decode_mask, self.scaling, sinks)
            if out is None:
                out = q.new_empty(n, heads, od.shape[-1])
            out[rows] = od
        return out

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              sinks: torch.Tensor | None) -> torch.Tensor:
        if sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        # gpt_oss: each head's softmax also spans a learned sink logit, whose share is dropped
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        logits = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        b, h, m, _ = logits.shape
        combined = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(b, h, m, 1).to(logits.dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v)

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(post_attention_layernorm(h), top-k expert indices, their weights); indices and
        weights are None in a layer without routed experts."""
        cfg, w = self.cfg, self.layers[layer]
        x = rms_norm(h, w["post_norm"], cfg.rms_norm_eps)
        if "gate" not in w:
            return x, None, None
        if self.capacity_factor is None:
            indices, weights = self.pick(layer, x)
        else:
            indices, weights, rerouted = self.pick_within_capacity(layer, x, self.capacity_factor)
            self.rerouted[layer] = self.rerouted.get(layer, 0) + rerouted
        return x, indices, weights

    def pick_within_capacity(self, layer: int, x: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The router with each expert taking at most ceil(factor x tokens x top_k / experts) of
        these tokens' choices (spec.routing.capacityFactor), GShard's rule: choices are served in
        order of rank (every token's first choice, then the seconds, ...) and of position; a token
        one of whose choices found its expert full is routed again by its family's router with the
        full experts left out (the choices it kept stay candidates), so that choice goes to its
        next-best expert with room and the weights are the family's for the new set. Repeated until
        every choice fits (each round fills at least one more expert). A token that cannot find
        top-k experts with room (with few experts, or a group-limited router whose groups have
        none left) keeps its choice over capacity.
        Returns (indices, weights, the tokens routed again)."""
        indices, weights = self.pick(layer, x)
        n, k, e = indices.shape[0], indices.shape[1], self.cfg.num_experts
        if n == 0:
            return indices, weights, 0
        capacity = max(1, math.ceil(factor * n * k / e))
        excluded = self.excluded.get(layer)
        dev = indices.device
        load = torch.zeros(e, dtype=torch.long, device=dev)
        placed = torch.zeros(n, k, dtype=torch.bool, device=dev)  # a choice that has its place
        rerouted = torch.zeros(n, dtype=torch.bool, device=dev)
        todo = torch.arange(n, device=dev)
        for _ in range(e + 1):
            choice, done = indices[todo], placed[todo]
            waiting = (~done).t().reshape(-1)
            flat = choice.t().reshape(-1)  # rank-major: every token's first choice, then the seconds
            queue = F.one_hot(flat, e) * waiting.unsqueeze(-1)  # only choices still waiting queue
            position = (queue.cumsum(0) * queue).sum(-1) - 1 + load[flat]
            fits = ((position < capacity) & waiting).view(k, -1).t()
            load += torch.bincount(choice[fits], minlength=e)
            done = done | fits
            placed[todo] = done
            whole = done.all(-1)
            if bool(whole.all()):
                break
            over = todo[~whole]
            kept = torch.zeros(len(over), e, dtype=torch.bool, device=dev)
            kept.scatter_(1, indices[over], placed[over])  # a placed choice stays a candidate
            mask = (load >= capacity).unsqueeze(0) & ~kept
            if excluded is not None:
                mask = mask | excluded
            if bool(((~mask).sum(-1) < k).any()):
                break  # a token has fewer than top-k experts with room: these keep their choice
            new_idx, new_w = self._pick(layer, x[over], mask)
            stuck = mask.gather(1, new_idx).any(-1)  # a group-limited router found no top-k with room
            if bool(stuck.any()):  # these keep their choice, over capacity where it did not fit
                keep = over[stuck]
                load += torch.bincount(indices[keep][~placed[keep]], minlength=e)
                placed[keep] = True
                over, kept, mask = over[~stuck], kept[~stuck], mask[~stuck]
                new_idx, new_w = new_idx[~stuck], new_w[~stuck]
                if len(over) == 0:
                    break
            now = kept.gather(1, new_idx)
            lost = kept & ~torch.zeros_like(kept).scatter_(1, new_idx, True)  # a placed choice it gave up
            load -= lost.sum(0)
            indices[over], weights[over], placed[over] = new_idx, new_w.to(weights.dtype), now
            rerouted[over] = True
            todo = over
        return indices, weights, int(rerouted.sum())

    def quarantine(self, experts: list[str]) -> None:
        """Take the experts (ids `L.E`, checked by the operator against the model) out of their
        routers' candidates from the next step on; [] restores every router exactly."""
        masks: dict[int, torch.Tensor] = {}
        for eid in experts:
            e = ExpertId.parse(eid)
            if not 0 <= e.layer < self.cfg.num_layers or "gate" not in self.layers[e.layer] \
                    or not 0 <= e.expert < self.cfg.num_experts:
                raise ValueError(f"quarantine: {eid} is not a routed expert of this model")
            mask = masks.setdefault(e.layer, torch.zeros(self.cfg.num_experts, dtype=torch.bool))
            mask[e.expert] = True
        self.excluded = {layer: mask.to(self.device) for layer, mask in masks.items()}

    def pick(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router of a sparse layer on normed hidden states x: (indices, weights)."""
        return self._pick(layer, x, self.excluded.get(layer))

    def _pick(self, layer: int, x: torch.Tensor, excluded: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's router with `excluded` ((E,) or per token (N, E), True: not a candidate)."""
        cfg, w = self.cfg, self.layers[layer]
        if cfg.router == "topk_softmax":
            return route_topk_softmax(x, w["gate"], w["gate_bias"], cfg.top_k, excluded)
        if cfg.router == "sigmoid_group":
            return route_sigmoid_group(x, w["gate"], w["correction"], cfg.top_k, cfg.n_group, cfg.topk_group,
                                       cfg.norm_topk_prob, cfg.routed_scaling_factor, excluded)
        if cfg.router == "softmax_group":
            return route_softmax_group(x, w["gate"], cfg.top_k, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor,
                                       excluded)
        return route(x, w["gate"], cfg.top_k, cfg.norm_topk_prob, excluded)

    def local(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """What this layer computes here beside the routed experts: the dense MLP of a layer
        without experts, the (gated) shared expert of one with them, or None."""
        w = self.layers[layer]
        if "mlp" in w:
            return mlp(x, *w["mlp"])
        if "shared" in w:
            out = mlp(x, *w["shared"])
            if "shared_gate" in w:
                out = torch.sigmoid(linear(x, w["shared_gate"])) * out
            return out
        return None

    @staticmethod
    def residual(h: torch.Tensor, moe: torch.Tensor | None, local: torch.Tensor | None) -> torch.Tensor:
        """h + the layer's MLP output: routed experts' plus shared, in transformers' order."""
        if moe is None:
            return h + local
        return h + (moe if local is None else moe + local)

    def logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:
            h = h[rows]
        return linear(rms_norm(h, self.final_norm, self.cfg.rms_norm_eps), self.lm_head)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope over interleaved pairs (x0, x1), (x2, x3), ... as transformers computes it."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, (B, H, d), over (B, KVH, L, d) keys and values (a gather's views
    of (KVH, B, L, d) copies), `mask` (B, 1, 1, L): the query heads of each KV head as one
    matmul, in that layout, with no copy of the keys (torch's SDPA repeats them per query head
    for GQA and ran 2.5x slower here at Mixtral's dims). Softmax in float32; gpt_oss' sink, as
    DenseModel._sdpa computes it."""
    b, h, d = q.shape
    kvh = k.shape[1]
    rep = h // kvh
    qt = q.view(b, kvh, rep, d).transpose(0, 1)                                  # (KVH, B, rep, d)
    scores = torch.matmul(qt, k.transpose(0, 1).transpose(2, 3)) * scale         # (KVH, B, rep, L)
    if sinks is None:
        scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # the sink's share of each head's softmax is dropped
        scores = scores.masked_fill(~mask[:, 0], torch.finfo(scores.dtype).min)
        sink = sinks.reshape(kvh, 1, rep, 1).expand(kvh, b, rep, 1).to(scores.dtype)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    out = torch.matmul(probs.to(v.dtype), v.transpose(0, 1))                     # (KVH, B, rep, dv)
    return out.transpose(0, 1).reshape(b, h, -1)
