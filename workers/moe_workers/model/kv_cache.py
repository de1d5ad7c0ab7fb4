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

import logging
import threading
from dataclasses import dataclass

import torch

from moe_workers.device import host_to_device

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
    decode_rows: list[list[int]] | None = None  # the blocks each decode token reads (the flex path's input)
    decode_bases: list[int] | None = None  # the position each one's first block starts at
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
        the pool with a block mask made from the block tables, no copy: the CUDA path, not yet run
        on a GPU). Default: flex on CUDA, gather elsewhere. Should flex fail (an unsupported build
        or device), decode gathers from then on: logged once, counted (`attention_fallbacks`) and
        shown by `attention_path()`, which the Ingress' status reports."""
        dtype = dtype or cfg.dtype
        self.attention = attention or ("flex" if torch.device(device).type == "cuda" else "gather")
        if self.attention not in ("gather", "flex"):
            raise ValueError(f"attention {self.attention!r}: expected gather or flex")
        self.configured_attention = self.attention
        self.flex_error = ""  # why the flex path fell back to gather
        self.attention_fallbacks = 0
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
        # the flex path's map of pool block -> its logical index in the tables that hold it (one
        # index whatever sequence holds it: a shared prefix block sits at the same position in
        # each), per group; written for the step's blocks only
        self._logical = ([torch.full((num_blocks,), -1, dtype=torch.int32, device=device) for _ in self.groups]
                         if self.attention == "flex" else [])
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
                prefill.append((host_to_device(blocks, device), host_to_device(mask, device)))
            plan = GroupPlan(host_to_device(torch.tensor(slots, dtype=torch.long), device), prefill)
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
                plan.decode_blocks = host_to_device(torch.tensor([r + [NULL_BLOCK] * (width - len(r)) for r in rows],
                                                                 dtype=torch.long), device)
                plan.decode_mask = host_to_device(mask[:, None], device)
                plan.decode_rows, plan.decode_bases, plan.decode_qpos = rows, bases, qpos
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

    def attention_path(self) -> dict:
        """Which way decode reads the cache now, and why it changed if it did (the status')."""
        return {"configured": self.configured_attention, "running": self.attention,
                "fallbacks": self.attention_fallbacks, "error": self.flex_error}

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
                gp.flex_mask = flex_block_mask(gp.decode_rows, gp.decode_bases, gp.decode_qpos, self.groups[g].window,
                                               self.block_size, self._logical[g])
            k, v = self.k[i], self.v[i]
            kf = k.view(1, k.shape[0], -1, k.shape[3])  # (1, KVH, blocks * bs, d): the pool as one sequence
            vf = v.view(1, v.shape[0], -1, v.shape[3])
            b = q.shape[0]
            qf = q.transpose(0, 1).unsqueeze(0)  # (1, H, B, d): the step's queries as one sequence
            rows = gp.flex_mask.seq_lengths[0]
            if rows > b:  # padded to whole query blocks; the padding reads nothing
                qf = torch.nn.functional.pad(qf, (0, 0, 0, rows - b))
            cuda = q.device.type == "cuda"
            out = _flex(cuda)(qf, kf, vf, block_mask=gp.flex_mask, scale=scale, enable_gqa=True,
                              kernel_options=flex_kernel_options(self.block_size) if cuda else None)
            return out[0, :, :b].transpose(0, 1)
        except Exception as err:  # noqa: BLE001 - an unsupported build or device: gather from now on
            self.attention, self.flex_error = "gather", f"{type(err).__name__}: {err}"
            self.attention_fallbacks += 1
            log.warning("flex attention failed, decode gathers the KV blocks from now on: %s", self.flex_error[:500])
            return None


log = logging.getLogger(__name__)

FLEX_Q_BLOCK = 16  # queries a block of the mask (and the kernel's BLOCK_M): the smallest tile flex takes

_FLEX: dict[bool, object] = {}


def flex_kernel_options(block_size: int) -> dict:
    """What the CUDA kernel is told (vLLM's flex backend does the same): the main flex kernel,
    never the flex-decoding one (whose BLOCK_M, max(next_pow2(B x G), 16), must divide the mask's
    16 and stops compiling past a few sequences, then raises from B >= 128), with tiles equal to
    the mask's blocks: 16 queries by one KV block."""
    return {"BACKEND": "TRITON", "BLOCK_M": FLEX_Q_BLOCK, "BLOCK_N": block_size}


def _flex(dynamic: bool = False):
    """flex_attention compiled (once per process): with dynamic shapes on CUDA, where a step's
    batch changes every step; static on the CPU, where inductor's C++ code for dynamic flex
    shapes did not compile here (torch 2.13)."""
    if dynamic not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX[dynamic]


def flex_block_mask(rows: list[list[int]], bases: list[int], qpos: list[int], window: int | None, block_size: int,
                    logical: torch.Tensor):
    """A BlockMask for B decode queries over the pool, made from the blocks each reads (`rows`,
    the first one starting at position `bases[b]`): each block of 16 queries lists the union of
    its queries' blocks (BlockMask.from_kv_blocks), so the kernel visits only blocks in use and
    building it costs their number, not the pool's. Within a listed block, the mask keeps query
    b to its own blocks (the block's logical index in b's table holds that very block), at
    positions up to its own and within the window. `logical` (pool-sized, on the device) is
    written for the step's blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    b = len(rows)
    qblocks = -(-b // FLEX_Q_BLOCK)
    padded = qblocks * FLEX_Q_BLOCK
    lists = [list(dict.fromkeys(blk for r in rows[s:s + FLEX_Q_BLOCK] for blk in r if blk != NULL_BLOCK))
             for s in range(0, b, FLEX_Q_BLOCK)]
    # the CPU's kernel wants a column per pool block (its check: KV length <= columns x BLOCK_N);
    # CUDA's reads kv_num's first entries only
    width = logical.shape[0] if logical.device.type == "cpu" else max(1, max(len(x) for x in lists))
    kv_indices = torch.zeros(1, 1, qblocks, width, dtype=torch.int32)
    for qb, x in enumerate(lists):
        kv_indices[0, 0, qb, :len(x)] = torch.tensor(x, dtype=torch.int32)
    kv_num = torch.tensor([len(x) for x in lists], dtype=torch.int32).view(1, 1, qblocks)
    # each query's table (its blocks by logical index, -1 elsewhere), padded to whole query blocks
    span = max(len(r) + base // block_size for r, base in zip(rows, bases))
    table = torch.full((padded, max(span, 1)), -1, dtype=torch.int32)
    pos = torch.full((padded,), -1, dtype=torch.int64)
    blocks, where = [], []
    for q, (r, base) in enumerate(zip(rows, bases)):
        first = base // block_size
        if r:
            table[q, first:first + len(r)] = torch.tensor(r, dtype=torch.int32)
        pos[q] = qpos[q]
        for j, blk in enumerate(r):
            if blk != NULL_BLOCK:
                blocks.append(blk)
                where.append(first + j)
    device = logical.device
    if blocks:
        logical.index_copy_(0, host_to_device(torch.tensor(blocks), device),
                            host_to_device(torch.tensor(where, dtype=torch.int32), device))
    table, pos = host_to_device(table, device), host_to_device(pos, device)
    width_t = table.shape[1]

    def mask_mod(_b, _h, q_idx, kv_idx):
        blk = kv_idx // block_size
        j = logical[blk]
        own = (j >= 0) & (table[q_idx, j.clamp(0, width_t - 1)] == blk)
        at = j * block_size + kv_idx % block_size
        ok = own & (at <= pos[q_idx])
        if window:
            ok = ok & (at > pos[q_idx] - window)
        return ok

    return BlockMask.from_kv_blocks(host_to_device(kv_num, device), host_to_device(kv_indices, device),
                                    BLOCK_SIZE=(FLEX_Q_BLOCK, block_size), mask_mod=mask_mod,
                                    seq_lengths=(padded, logical.shape[0] * block_size), compute_q_blocks=False)


__all__ = ["DEFAULT_BLOCK_SIZE", "GroupPlan", "KVGroup", "NoFreeBlocks", "PagedKVCache", "bytes_per_block",
           "bytes_per_token", "kv_groups", "kv_layout"]
