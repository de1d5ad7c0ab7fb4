"""Which KV cache block holds which tokens of which sequence: a paged KV cache's bookkeeping
(pure: no torch, no model).

The cache is a pool of fixed-size blocks (`block_size` tokens each). A sequence holds a block
table per *group* (layers of one attention kind: full attention, or a sliding window of W
tokens); every block of the pool holds the keys and values of one group's layers for its
tokens, so groups share one pool and one budget (vLLM's hybrid allocator does the same). A
sliding-window group frees a block once every later query lies past its window: its table
entry becomes `NULL_BLOCK`, which no sequence is ever given and attention never reads unmasked.

Prefix caching: a full block that has been computed is registered under a digest of its tokens
and of every token before it (and of `salt`, the model that computed it), so a later sequence
whose tokens start the same way takes the block instead of computing it again (vLLM's automatic
prefix caching). Blocks are reference-counted; a block nobody holds stays in the free queue with
its digest until it is handed out again, least recently freed first, so freeing costs no cache
entry until the memory is needed. `reset()` forgets every digest (a new model: a committed
expert hot-swap changes every later layer's keys and values).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .family import Arch

NULL_BLOCK = 0  # a placeholder in tables (freed out-of-window blocks, padding); never handed out
DEFAULT_BLOCK_SIZE = 16


# -- a model's layout (pure: the operator sizes the cache with these, without torch) ------------

def kv_layout(arch: Arch) -> tuple[tuple[int, int], tuple[int, int]]:
    """((heads, dim) of what the cache keeps as keys, the same for values). Multi-head latent
    attention keeps what transformers' cache keeps: the normed latent and the roped shared key."""
    if arch.mla:
        return (1, arch.kv_lora_rank), (1, arch.qk_rope_head_dim)
    return (arch.num_kv_heads, arch.head_dim), (arch.num_kv_heads, arch.head_dim)


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]


def kv_groups(arch: Arch) -> list[KVGroup]:
    """Layers by attention kind, in groups of equal size (the gcd of the kinds' layer counts),
    so that one block of the pool holds any group's layers."""
    kinds: dict[int | None, list[int]] = {}
    for layer in range(arch.num_layers):
        kinds.setdefault(arch.sliding(layer), []).append(layer)
    size = math.gcd(*(len(v) for v in kinds.values()))
    return [KVGroup(window, tuple(layers[i:i + size])) for window, layers in kinds.items()
            for i in range(0, len(layers), size)]


def token_numel(arch: Arch) -> int:
    """Numbers one token's keys and values take in one layer."""
    (kh, kd), (vh, vd) = kv_layout(arch)
    return kh * kd + vh * vd


def block_bytes(arch: Arch, block_size: int, elem_bytes: int) -> int:
    """One block of the pool: one group's layers, `block_size` tokens of keys and values."""
    return len(kv_groups(arch)[0].layers) * block_size * token_numel(arch) * elem_bytes


def sequence_blocks(arch: Arch, block_size: int, tokens: int) -> int:
    """Blocks one sequence of `tokens` tokens holds at most (windowed groups: their window)."""
    groups = kv_groups(arch)
    probe = KVCacheManager(2, block_size, [g.window for g in groups], prefix_caching=False)
    return probe.blocks_for(tokens)


def budget_blocks(arch: Arch, budget_bytes: int, block_size: int, elem_bytes: int) -> int:
    """Blocks `budget_bytes` holds, the null block included."""
    return budget_bytes // block_bytes(arch, block_size, elem_bytes)


def budget_problem(arch: Arch, budget_bytes: int, block_size: int, elem_bytes: int, max_len: int) -> str | None:
    """Why a KV budget cannot hold one sequence of `max_len` tokens (with the numbers), or None."""
    per_block = block_bytes(arch, block_size, elem_bytes)
    have = max(0, budget_blocks(arch, budget_bytes, block_size, elem_bytes) - 1)
    need = sequence_blocks(arch, block_size, max_len)
    if have >= need:
        return None
    return (f"KV cache budget {budget_bytes} bytes holds {have} blocks of {block_size} tokens ({per_block} bytes "
            f"each); one sequence of {max_len} tokens needs {need} ({(need + 1) * per_block} bytes with the null "
            f"block); raise kvCacheBudget or lower maxModelLen")


class NoFreeBlocks(Exception):
    """The pool cannot give the blocks asked for (the caller preempts or waits)."""


def block_digests(tokens: list[int], block_size: int, salt: bytes = b"", parent: bytes = b"",
                  start_block: int = 0) -> list[bytes]:
    """The chained digest of each full block of `tokens` from `start_block` on (`parent`: the
    digest of the block before it): equal digests mean equal tokens from position 0 on."""
    out = []
    for b in range(start_block, len(tokens) // block_size):
        h = hashlib.blake2b(digest_size=16, key=salt[:64])
        h.update(parent)
        h.update(array("q", tokens[b * block_size:(b + 1) * block_size]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class BlockPool:
    """Blocks 1..num_blocks-1 (block 0 is NULL_BLOCK), their reference counts and digests, and
    the free queue in the order blocks were freed (the least recently freed is handed out first,
    dropping its digest)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), not {num_blocks}")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.digest: list[tuple[int, bytes] | None] = [None] * num_blocks
        self.cached: dict[tuple[int, bytes], int] = {}  # (group, digest) -> block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.evictions = 0  # cached blocks handed out for new tokens (their cache entry dropped)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: nobody holds them (cached ones included)."""
        return len(self.free)

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreeBlocks(f"{n} blocks asked for, {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            key = self.digest[block]
            if key is not None:
                del self.cached[key]
                self.digest[block] = None
                self.evictions += 1
            self.refs[block] = 1
            out.append(block)
        return out

    def hold(self, block: int) -> None:
        """One more holder of a cached block (a prefix hit)."""
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one hold of each block, in this order (a block nobody holds joins the free queue's end)."""
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def register(self, group: int, digest: bytes, block: int) -> None:
        """`block` (held, full, computed) holds the tokens `digest` names, for `group`'s layers.
        A digest already cached keeps its first block; this one stays a plain block."""
        key = (group, digest)
        if key not in self.cached and self.digest[block] is None:
            self.cached[key] = block
            self.digest[block] = key

    def lookup(self, group: int, digest: bytes) -> int | None:
        return self.cached.get((group, digest))

    def reset(self) -> None:
        """Forget every digest: blocks stay as they are held, none is found by its tokens again."""
        for key in self.cached:
            self.digest[self.cached[key]] = None
        self.cached.clear()


@dataclass
class _Sequence:
    tables: list[list[int]]  # per group: block per block index (NULL_BLOCK where freed)
    digests: list[bytes] = field(default_factory=list)  # of its full blocks, as far as computed
    registered: int = 0  # full blocks registered in the pool's cache (every group)


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of those, found computed in the cache


class KVCacheManager:
    """Block tables of sequences over one BlockPool. `windows` has one entry per group: None
    for full attention, else the window (a query at position q reads keys at q-W+1 .. q).

    Per step the caller asks `allocate(seq, total, computed)` for the blocks to hold a sequence's
    first `total` tokens when `computed` of them are in the cache already, and after the step
    `commit(seq, tokens, computed)` to register the blocks it filled."""

    def __init__(self, num_blocks: int, block_size: int, windows: list[int | None], prefix_caching: bool = True,
                 salt: bytes = b""):
        if block_size < 1:
            raise ValueError(f"block size must be at least 1, not {block_size}")
        if not windows:
            raise ValueError("a KV cache needs at least one group of layers")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.windows = list(windows)
        self.prefix_caching = prefix_caching
        self.salt = salt
        self.seqs: dict[int, _Sequence] = {}
        self.stats = PrefixStats()

    # -- sizes ---------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of up to `tokens` tokens holds at most while it decodes, all groups
        together (a windowed group: its window, and a partial block on either side)."""
        end = -(-tokens // self.block_size)
        return sum(end if w is None else min(end, -(-(w - 1) // self.block_size) + 1) for w in self.windows)

    def max_tokens(self) -> int | None:
        """The longest sequence the whole pool holds, or None when every group is windowed
        (a sequence then holds a window's blocks, whatever its length)."""
        if all(w is not None for w in self.windows):
            return None
        usable = self.pool.usable - sum(-(-(w - 1) // self.block_size) + 1 for w in self.windows if w is not None)
        full = sum(1 for w in self.windows if w is None)
        return max(0, usable // full) * self.block_size

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.usable - self.pool.num_free

    def _first_needed(self, window: int | None, computed: int) -> int:
        """The first block index the next query (at position `computed`) reads in a group."""
        if window is None:
            return 0
        return max(0, computed - window + 1) // self.block_size

    def _needed(self, window: int | None, total: int, computed: int) -> int:
        """Blocks a group holds for `total` tokens once the first `computed` are in the cache."""
        end = -(-total // self.block_size)
        return max(0, end - self._first_needed(window, min(computed, total)))

    # -- prefix lookup ---------------------------------------------------------------------

    def _hit_blocks(self, digests: list[bytes], limit: int) -> int:
        """How many leading full blocks (at most `limit`) every group has cached: a full group
        needs all of them, a windowed one those its next query reads."""
        k = limit
        for g, w in enumerate(self.windows):
            if w is None:
                n = 0
                while n < k and self.pool.lookup(g, digests[n]) is not None:
                    n += 1
                k = n
        while k > 0:
            if all(self.pool.lookup(g, digests[b]) is not None
                   for g, w in enumerate(self.windows) if w is not None
                   for b in range(self._first_needed(w, k * self.block_size), k)):
                return k
            k -= 1
        return 0

    def cached_prefix(self, tokens: list[int]) -> int:
        """Tokens at the start of `tokens` the cache holds computed (a multiple of the block
        size, always leaving the last token to compute). Changes nothing."""
        if not self.prefix_caching:
            return 0
        digests = block_digests(tokens, self.block_size, self.salt)
        return self._hit_blocks(digests, (len(tokens) - 1) // self.block_size) * self.block_size

    # -- a sequence's life ---------------------------------------------------------------

    def start(self, seq: int) -> None:
        """`seq` begins holding nothing, without a prefix lookup (blocks come from `allocate`)."""
        if seq in self.seqs:
            raise ValueError(f"sequence {seq} holds blocks already")
        self.seqs[seq] = _Sequence([[] for _ in self.windows])

    def admit(self, seq: int, tokens: list[int], first_chunk: int) -> int:
        """Start `seq`: take its cached prefix and blocks for `first_chunk` more tokens (fewer
        where the prompt ends). Returns how many tokens are computed already; raises
        NoFreeBlocks (and holds nothing) when the pool cannot give the rest."""
        if seq in self.seqs:
            raise ValueError(f"sequence {seq} holds blocks already")
        digests = block_digests(tokens, self.block_size, self.salt) if self.prefix_caching else []
        hit = self._hit_blocks(digests, (len(tokens) - 1) // self.block_size) if self.prefix_caching else 0
        computed = hit * self.block_size
        total = min(len(tokens), computed + max(1, first_chunk))
        tables: list[list[int]] = []
        held: list[int] = []
        needed = 0
        for g, w in enumerate(self.windows):
            first = self._first_needed(w, computed)
            table = [NULL_BLOCK] * first
            for b in range(first, hit):
                table.append(self.pool.lookup(g, digests[b]))
            tables.append(table)
            needed += self._needed(w, total, computed) - (hit - first)
        # hit blocks nobody holds are in the free queue: they do not count as free for the rest
        reusing = len({b for t in tables for b in t if b != NULL_BLOCK and self.pool.refs[b] == 0})
        if needed > self.pool.num_free - reusing:
            raise NoFreeBlocks(f"{needed} blocks needed, {self.pool.num_free - reusing} free")
        for t in tables:
            for b in t:
                if b != NULL_BLOCK:
                    self.pool.hold(b)
                    held.append(b)
        state = _Sequence(tables, digests[:hit], registered=hit)
        self.seqs[seq] = state
        self._grow(state, total, computed)
        self.stats.queried_tokens += len(tokens)
        self.stats.hit_tokens += computed
        return computed

    def allocate(self, seq: int, total: int, computed: int) -> None:
        """Blocks for `seq`'s first `total` tokens, `computed` of them in the cache: windowed
        groups first free what no later query reads. Raises NoFreeBlocks (holding what it held)
        when the pool cannot give them."""
        state = self.seqs[seq]
        for g, w in enumerate(self.windows):
            if w is not None:
                table, first = state.tables[g], self._first_needed(w, computed)
                freed = [b for b in table[:first] if b != NULL_BLOCK]
                if freed:
                    self.pool.release(freed)
                    table[:first] = [NULL_BLOCK] * min(first, len(table))
        self._grow(state, total, computed)

    def _grow(self, state: _Sequence, total: int, computed: int) -> None:
        end = -(-total // self.block_size)
        want = [max(0, end - len(t)) for t in state.tables]
        if sum(want) > self.pool.num_free:
            raise NoFreeBlocks(f"{sum(want)} blocks needed, {self.pool.num_free} free")
        for t, n in zip(state.tables, want):
            t.extend(self.pool.take(n))

    def commit(self, seq: int, tokens: list[int], computed: int) -> None:
        """`tokens[:computed]` of `seq` are in its blocks now: register its newly full blocks
        for later sequences (with prefix caching)."""
        if not self.prefix_caching:
            return
        state = self.seqs[seq]
        full = computed // self.block_size
        if full <= state.registered:
            return
        if len(state.digests) < full:
            parent = state.digests[-1] if state.digests else b""
            state.digests.extend(block_digests(tokens[:full * self.block_size], self.block_size, self.salt,
                                               parent, len(state.digests)))
        for b in range(state.registered, full):
            for g, table in enumerate(state.tables):
                if table[b] != NULL_BLOCK:
                    self.pool.register(g, state.digests[b], table[b])
        state.registered = full

    def free(self, seq: int) -> None:
        """`seq` ended (or was preempted): its blocks go back, last block first, so a prefix's
        tail is handed out again before its head."""
        state = self.seqs.pop(seq, None)
        if state is None:
            return
        for table in state.tables:
            self.pool.release(table[::-1])

    def table(self, seq: int, group: int) -> list[int]:
        return self.seqs[seq].tables[group]

    def reset_prefix_cache(self) -> None:
        self.pool.reset()
        for state in self.seqs.values():
            state.registered = len(state.digests) + (1 << 40)  # never registered again: old model
