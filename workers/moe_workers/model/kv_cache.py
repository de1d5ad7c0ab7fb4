"""The paged KV cache's memory: keys and values in fixed-size blocks, read through block tables.

`kv_groups` splits a model's layers into groups of one attention kind and equal size (full
attention; a sliding window), so that one block of the pool holds one group's layers for
`block_size` tokens and every group draws from the same pool (`kv_blocks.KVCacheManager` keeps
the tables). Layer `l` is index `i` of its group; its keys are `k[i]`, of shape (heads,
blocks, block_size, dim), whatever group it is in.

`plan(batch)` turns a step's chunks into the index tensors attention uses (once a step, not
once a layer): where each new token's keys go (`slots`), and for each group the blocks each
chunk reads with the position the first one starts at. A decode step reads its sequences'
blocks as one padded (B, blocks) table.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .config import CheckpointError, MoEConfig
from .kv_blocks import (DEFAULT_BLOCK_SIZE, NULL_BLOCK, KVCacheManager, KVGroup, NoFreeBlocks, block_bytes,
                        budget_problem, kv_groups, kv_layout, token_numel)


def bytes_per_block(cfg: MoEConfig, block_size: int, dtype: torch.dtype) -> int:
    """One block of the pool: one group's layers, `block_size` tokens of keys and values."""
    return block_bytes(cfg, block_size, torch.tensor([], dtype=dtype).element_size())


def bytes_per_token(cfg: MoEConfig, dtype: torch.dtype) -> int:
    """Keys and values of one token over every layer (what a full-attention cache holds per token)."""
    return cfg.num_layers * token_numel(cfg) * torch.tensor([], dtype=dtype).element_size()


@dataclass
class GroupPlan:
    """One group's reads and writes for a step (its layers share them)."""

    slots: torch.Tensor  # (N,) flat block * block_size + offset of each new token's keys
    prefill: list[tuple[torch.Tensor, torch.Tensor]]  # per prefill chunk (batch.prefill order): (1, n) blocks, (m, L) mask
    decode_blocks: torch.Tensor | None = None  # (B, n) the decode chunks' blocks, NULL_BLOCK-padded
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, L): which of those positions each decode token reads
    decode_tables: list[list[int]] | None = None  # the decode chunks' whole block tables (the flex path's input)
    decode_qpos: list[int] | None = None  # each decode token's position
    flex_mask: object = None  # the flex path's BlockMask over the pool, made at its first layer


def _mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(..., q, k) causal mask of queries at `qpos` over keys at `kpos`, within the window."""
    mask = kpos[..., None, :] <= qpos[..., :, None]
    if window:
        mask &= kpos[..., None, :] > qpos[..., :, None] - window
    return mask


class PagedKVCache:
    """Keys/values of every layer in blocks of `block_size` tokens, and the manager of its tables.

    `allocate()` starts a sequence without prefix lookup (the in-process model and tests);
    `reserve(seq, total, computed)` gives it blocks as it grows. The engine uses the manager's
    admission (prefix hits) and preemption itself."""

    def __init__(self, cfg: MoEConfig, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 prefix_caching: bool = True, attention: str | None = None):
        """`attention`: how decode reads the blocks: "gather" (copy each sequence's blocks, then
        SDPA: the faster on CPU, bench/engine.py --only attention) or "flex" (FlexAttention over
        the pool with a block mask, no copy: the CUDA path, not yet run on a GPU; it falls back to
        gather if it fails). Default: flex on CUDA, gather elsewhere."""
        dtype = dtype or cfg.dtype
        self.attention = attention or ("flex" if torch.device(device).type == "cuda" else "gather")
        if self.attention not in ("gather", "flex"):
            raise ValueError(f"attention {self.attention!r}: expected gather or flex")
        self.flex_error = ""  # why the flex path fell back to gather
        self.cfg = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.groups = kv_groups(cfg)
        self.layer_slot = {layer: (g, i) for g, grp in enumerate(self.groups) for i, layer in enumerate(grp.layers)}
        (kh, kd), (vh, vd) = kv_layout(cfg)
        per_group = len(self.groups[0].layers)
        # head-major (heads, blocks, block_size, dim): a gather of a sequence's blocks is one
        # index_select of whole block rows per head, and lands as (heads, B, L, dim), what the
        # attention matmuls read without another copy. Zeros, not empty: padded reads are
        # masked, and a masked NaN would still poison softmax
        self.k = [torch.zeros((kh, num_blocks, block_size, kd), dtype=dtype, device=device) for _ in range(per_group)]
        self.v = [torch.zeros((vh, num_blocks, block_size, vd), dtype=dtype, device=device) for _ in range(per_group)]
        self.manager = KVCacheManager(num_blocks, block_size, [g.window for g in self.groups], prefix_caching)
        self._next_seq = 0
        self._local = threading.local()  # gather buffers, one pair per thread (micro-batches run in threads)

    @classmethod
    def for_budget(cls, cfg: MoEConfig, budget_bytes: int, max_len: int, block_size: int = DEFAULT_BLOCK_SIZE,
                   dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                   prefix_caching: bool = True) -> "PagedKVCache":
        """As many blocks as `budget_bytes` holds; refused when that is not one sequence of
        `max_len` tokens (the manager's count: windowed layers hold their window only)."""
        dtype = dtype or cfg.dtype
        elem = torch.tensor([], dtype=dtype).element_size()
        problem = budget_problem(cfg, budget_bytes, block_size, elem, max_len)
        if problem:
            raise CheckpointError(problem)
        blocks = budget_bytes // block_bytes(cfg, block_size, elem)
        return cls(cfg, int(blocks), block_size, dtype, device, prefix_caching)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def allocate(self) -> int:
        """A new sequence id, holding no blocks yet."""
        seq = self._next_seq
        self._next_seq += 1
        self.manager.start(seq)
        return seq

    def reserve(self, seq: int, total: int, computed: int) -> None:
        self.manager.allocate(seq, total, computed)

    def release(self, seq: int) -> None:
        self.manager.free(seq)

    # -- a step's reads and writes -------------------------------------------------------

    def plan(self, batch) -> list[GroupPlan]:
        """Index tensors and masks for `batch` (a StepBatch), one GroupPlan per group."""
        bs, device = self.block_size, self.k[0].device
        plans = []
        for g, grp in enumerate(self.groups):
            tables = [self.manager.table(c.slot, g) for c in batch.chunks]
            slots = [t[p // bs] * bs + p % bs for t, c in zip(tables, batch.chunks)
                     for p in range(c.start, c.start + len(c.tokens))]
            prefill = []
            for i in batch.prefill:
                c = batch.chunks[i]
                first, end = self._span(grp.window, c.start, c.start + len(c.tokens))
                blocks = torch.tensor([tables[i][first:end]], dtype=torch.long)
                qpos = torch.arange(c.start, c.start + len(c.tokens))
                mask = _mask(qpos, torch.arange(first * bs, end * bs), grp.window)
                prefill.append((blocks.to(device), mask.to(device)))
            plan = GroupPlan(torch.tensor(slots, dtype=torch.long, device=device), prefill)
            if batch.decode:
                rows, bases, qpos = [], [], []
                for i in batch.decode:
                    c = batch.chunks[i]
                    first, end = self._span(grp.window, c.start, c.start + 1)
                    rows.append(tables[i][first:end])
                    bases.append(first * bs)
                    qpos.append(c.start)
                width = max(len(r) for r in rows)
                kpos = torch.tensor(bases)[:, None] + torch.arange(width * bs)[None, :]
                mask = _mask(torch.tensor(qpos)[:, None], kpos, grp.window)  # (B, 1, L)
                plan.decode_blocks = torch.tensor([r + [NULL_BLOCK] * (width - len(r)) for r in rows],
                                                  dtype=torch.long, device=device)
                plan.decode_mask = mask[:, None].to(device)
                plan.decode_tables = [tables[i] for i in batch.decode]
                plan.decode_qpos = qpos
            plans.append(plan)
        return plans

    def _span(self, window: int | None, start: int, end: int) -> tuple[int, int]:
        """Block indices [first, last) that queries at positions start..end-1 read."""
        first = 0 if window is None else max(0, start - window + 1) // self.block_size
        return first, -(-end // self.block_size)

    def write(self, layer: int, plan: list[GroupPlan], k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's (N, heads, dim) keys and values of `layer` into their blocks."""
        g, i = self.layer_slot[layer]
        slots = plan[g].slots
        for pool, new in ((self.k[i], k), (self.v[i], v)):
            pool.view(pool.shape[0], -1, pool.shape[3]).index_copy_(1, slots, new.transpose(0, 1).to(pool.dtype))

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` ((B, n) block ids) as (B, heads, n * block_size, dim):
        a view of one (heads, B, L, dim) copy (index_select of whole blocks: a memcpy per block
        and head, where advanced indexing ran 5x slower here)."""
        _, i = self.layer_slot[layer]
        b, n = blocks.shape
        flat = blocks.reshape(-1)
        out = []
        for which, pool in enumerate((self.k[i], self.v[i])):
            heads, _, bs, dim = pool.shape
            dest = self._workspace(which, heads * b * n * bs * dim, pool).view(heads, b * n, bs * dim)
            torch.index_select(pool.view(heads, self.num_blocks, bs * dim), 1, flat, out=dest)
            out.append(dest.view(heads, b, n * bs, dim).transpose(0, 1))
        return out[0], out[1]

    def _workspace(self, which: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """This thread's gather buffer for keys (0) or values (1), kept between layers and steps:
        a fresh one a layer cost 3x the copy itself in page faults here. Valid until this
        thread's next gather (attention reads it at once)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = [None, None]
        buf = bufs[which]
        if buf is None or buf.numel() < numel:
            buf = bufs[which] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def group_of(self, layer: int) -> int:
        return self.layer_slot[layer][0]

    def flex_decode(self, layer: int, q: torch.Tensor, plan: list[GroupPlan], scale: float) -> torch.Tensor | None:
        """Decode attention of (B, H, d) queries straight over the pool (FlexAttention: a block
        mask keeps each query to its own blocks, shared prefix blocks included, within its
        position and window), (B, H, d) out; None when the flex path is off or failed (the caller
        gathers instead)."""
        if self.attention != "flex":
            return None
        g, i = self.layer_slot[layer]
        gp = plan[g]
        try:
            if gp.flex_mask is None:
                gp.flex_mask = _flex_block_mask(gp.decode_tables, gp.decode_qpos, self.groups[g].window,
                                                self.num_blocks, self.block_size, q.device)
            k, v = self.k[i], self.v[i]
            kf = k.view(1, k.shape[0], -1, k.shape[3])  # (1, KVH, blocks * bs, d): the pool as one sequence
            vf = v.view(1, v.shape[0], -1, v.shape[3])
            out = _flex(q.device.type == "cuda")(q.transpose(0, 1).unsqueeze(0), kf, vf, block_mask=gp.flex_mask, scale=scale,
                          enable_gqa=True)
            return out[0].transpose(0, 1)
        except Exception as err:  # noqa: BLE001 - an unsupported build or device: gather from now on
            self.attention, self.flex_error = "gather", f"{type(err).__name__}: {err}"
            return None


_FLEX: dict[bool, object] = {}


def _flex(dynamic: bool = False):
    """flex_attention compiled (once per process): with dynamic shapes on CUDA, where a step's
    batch changes every step; static on the CPU, where inductor's C++ code for dynamic flex
    shapes did not compile here (torch 2.13)."""
    if dynamic not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX[dynamic]


def _flex_block_mask(tables: list[list[int]], qpos: list[int], window: int | None, num_blocks: int,
                     block_size: int, device):
    """A BlockMask over (B queries) x (the whole pool): query b reads pool block p where p is its
    table's logical block j, at positions j * block_size + offset <= its own (and within the window)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b = len(tables)
    logical = torch.full((b, num_blocks), -1, dtype=torch.long)
    for row, table in enumerate(tables):
        for j, blk in enumerate(table):
            if blk != NULL_BLOCK:
                logical[row, blk] = j
    logical, pos = logical.to(device), torch.tensor(qpos, dtype=torch.long, device=device)

    def mask_mod(_b, _h, q_idx, kv_idx):
        j = logical[q_idx, kv_idx // block_size]
        at = j * block_size + kv_idx % block_size
        ok = (j >= 0) & (at <= pos[q_idx])
        if window:
            ok = ok & (at > pos[q_idx] - window)
        return ok

    return create_block_mask(mask_mod, 1, None, b, num_blocks * block_size, device=device,
                             BLOCK_SIZE=(16, block_size))


__all__ = ["DEFAULT_BLOCK_SIZE", "GroupPlan", "KVGroup", "NoFreeBlocks", "PagedKVCache", "bytes_per_block",
           "bytes_per_token", "kv_groups", "kv_layout"]
