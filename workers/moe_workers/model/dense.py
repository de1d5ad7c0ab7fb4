"""The dense part of a Mixtral model (everything but the experts), with a slot KV cache.

One forward *step* processes a flat batch of tokens from many sequences at once: prompt chunks
(prefill) and single decode tokens side by side. Linear layers and the expert dispatch see all
the step's tokens together; attention is per sequence (prefill) or batched over the decode
sequences with a length mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .checkpoint import Checkpoint
from .config import CheckpointError, MoEConfig
from .layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, route


class KVCache:
    """Preallocated keys/values: (layers, slots, kv_heads, max_len, head_dim), one slot per sequence."""

    def __init__(self, cfg: MoEConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(cfg: MoEConfig, max_len: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * cfg.num_layers * cfg.num_kv_heads * max_len * cfg.head_dim * elem

    @classmethod
    def for_budget(cls, cfg: MoEConfig, budget_bytes: int, max_len: int, dtype: torch.dtype,
                   max_slots: int | None = None, device: torch.device | str = "cpu") -> "KVCache":
        per_slot = cls.bytes_per_slot(cfg, max_len, dtype)
        slots = budget_bytes // per_slot
        if slots < 1:
            raise CheckpointError(
                f"KV cache budget {budget_bytes} bytes holds no sequence of {max_len} tokens "
                f"(one needs {per_slot} bytes); raise kvCacheBudget or lower maxModelLen")
        if max_slots is not None:
            slots = min(slots, max_slots)
        return cls(cfg, int(slots), max_len, dtype, device)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)


@dataclass
class Chunk:
    """Tokens of one sequence in a step: positions start .. start+len(tokens)-1."""

    slot: int
    start: int
    tokens: list[int]


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

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def to(self, device: torch.device) -> None:
        """The index tensors onto the dense part's device (once, at embedding)."""
        if self.ids.device != device:
            self.ids, self.positions, self.last_rows = (t.to(device) for t in (self.ids, self.positions, self.last_rows))


class DenseModel:
    """Embeddings, attention, norms, routers and lm_head of a Mixtral checkpoint, on `device`
    (the ingress' GPU when Ray assigned it one; the CPU otherwise)."""

    def __init__(self, cfg: MoEConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        dt = cfg.dtype

        def get(name: str) -> torch.Tensor:
            try:
                return state[name].to(dt).contiguous().to(self.device)  # converted on the host first
            except KeyError:
                raise CheckpointError(f"checkpoint: tensor {name} is missing") from None

        self.embed_tokens = get("model.embed_tokens.weight")
        self.final_norm = get("model.norm.weight")
        if "lm_head.weight" in state:
            self.lm_head = get("lm_head.weight")
        elif cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            raise CheckpointError("checkpoint: tensor lm_head.weight is missing")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "q": get(p + "self_attn.q_proj.weight"),
                "k": get(p + "self_attn.k_proj.weight"),
                "v": get(p + "self_attn.v_proj.weight"),
                "o": get(p + "self_attn.o_proj.weight"),
                "in_norm": get(p + "input_layernorm.weight"),
                "post_norm": get(p + "post_attention_layernorm.weight"),
                "gate": get(p + "block_sparse_moe.gate.weight"),
            })
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta).to(self.device)
        self.scaling = cfg.head_dim ** -0.5

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype | None = None) -> "DenseModel":
        cfg = ckpt.config if dtype is None else ckpt.config.with_dtype(dtype)
        return cls(cfg, ckpt.dense_state())

    def nbytes(self) -> int:
        tensors = [self.embed_tokens, self.final_norm] + [t for layer in self.layers for t in layer.values()]
        if self.lm_head is not self.embed_tokens:
            tensors.append(self.lm_head)
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- one step, in pieces the drivers (in-process and served) call in order ----------------

    def embed(self, batch: StepBatch) -> torch.Tensor:
        batch.to(self.device)
        batch.cos, batch.sin = rope_cos_sin(batch.positions, self.inv_freq, self.cfg.dtype)
        return F.embedding(batch.ids, self.embed_tokens)

    def attention(self, layer: int, h: torch.Tensor, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        """h + self-attention(input_layernorm(h)); writes this step's keys/values into the cache."""
        cfg, w = self.cfg, self.layers[layer]
        x = rms_norm(h, w["in_norm"], cfg.rms_norm_eps)
        n = x.shape[0]
        q = F.linear(x, w["q"]).view(n, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, w["k"]).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, w["v"]).view(n, cfg.num_kv_heads, cfg.head_dim)
        q = apply_rope(q, batch.cos, batch.sin)
        k = apply_rope(k, batch.cos, batch.sin)
        out = torch.empty_like(q)
        ck, cv = cache.k[layer], cache.v[layer]
        for i, c in enumerate(batch.chunks):  # write keys/values first: decode attends to itself
            o, m = batch.offsets[i], len(c.tokens)
            ck[c.slot, :, c.start:c.start + m] = k[o:o + m].transpose(0, 1)
            cv[c.slot, :, c.start:c.start + m] = v[o:o + m].transpose(0, 1)
        for i in batch.prefill:
            c, o = batch.chunks[i], batch.offsets[i]
            m, total = len(c.tokens), c.start + len(c.tokens)
            qi = q[o:o + m].transpose(0, 1).unsqueeze(0)          # (1, H, m, d)
            ki = ck[c.slot, :, :total].unsqueeze(0)                # (1, KVH, total, d)
            vi = cv[c.slot, :, :total].unsqueeze(0)
            mask = torch.ones(m, total, dtype=torch.bool, device=h.device).tril(diagonal=c.start)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scaling, enable_gqa=True)
            out[o:o + m] = oi[0].transpose(0, 1)
        if batch.decode:
            idx = batch.decode
            rows = torch.tensor([batch.offsets[i] for i in idx], device=h.device)
            slots = torch.tensor([batch.chunks[i].slot for i in idx], device=h.device)
            lengths_list = [batch.chunks[i].start + 1 for i in idx]
            lengths = torch.tensor(lengths_list, device=h.device)
            longest = max(lengths_list)  # from the host: no device round trip
            kd = ck[slots, :, :longest]                            # (B, KVH, L, d)
            vd = cv[slots, :, :longest]
            qd = q[rows].unsqueeze(2)                              # (B, H, 1, d)
            mask = (torch.arange(longest, device=h.device)[None, :] < lengths[:, None])[:, None, None, :]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=self.scaling, enable_gqa=True)
            out[rows] = od[:, :, 0]
        return h + F.linear(out.reshape(n, cfg.num_heads * cfg.head_dim), w["o"])

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post_attention_layernorm(h), top-k expert indices, their weights)."""
        w = self.layers[layer]
        x = rms_norm(h, w["post_norm"], self.cfg.rms_norm_eps)
        indices, weights = route(x, w["gate"], self.cfg.top_k)
        return x, indices, weights

    def logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:
            h = h[rows]
        return F.linear(rms_norm(h, self.final_norm, self.cfg.rms_norm_eps), self.lm_head)
