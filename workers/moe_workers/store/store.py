"""TieredExpertStore: where one ExpertShard replica keeps its experts.

Tiers, fastest first (exclusive: an expert's weights live in exactly one of hot or warm, or
only on disk; except that a quantized model's expert promoted from warm keeps its stored form
there, so leaving hot costs it nothing):
  hot   accelerator memory in compute layout (host memory in compute layout without one)
  warm  host RAM (pinned when CUDA is present); a quantized model's experts in their stored form
  cold  a local cache directory of per-expert safetensors files, read lazily (mmap); an expert
        with no cache file is read from its source (the checkpoint, or its override file)

Budgets are bytes per tier and are never exceeded: a move reserves room in its target tier
(evicting by policy) before it copies anything. Experts pinned by an in-flight batch are never
evicted, and a hot-swap commits only between batches, so no batch mixes versions.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_workers.device import DeviceOps, ops_for
from moe_workers.model import native
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.config import MoEConfig
from moe_workers.model.dtypes import TORCH_NAME

from .cold import ColdCache
from .coldio import ColdIO
from .config import TierConfig, TierConfigError
from .entry import (
    COLD,
    HOT,
    SOURCE,
    TIERS,
    WARM,
    Entry,
    Key,
    MoveHook,
    StoreFull,
    StoreStats,
)
from .ledger import COMPUTE, STORED, Hold, Ledger, TierForms
from .policy import HintTracker, Policy, RankAware, make_policy
from .prefetch import Prefetcher, Refill
from .slots import SlotPool
from .swap import HotSwap
from .versions import CHECKPOINT, Version

# A prefetch may evict resident experts only while at least this share of recent hints came
# true; below it, it fills free room only. With the router's hints right 28% of the time and
# RAM short of the experts, evicting for them doubled the reads from disk and halved decode
# (bench/tiering.py, served: RAM at 50% of a shard's experts, batch 1).
PREFETCH_EVICT_ACCURACY = 0.5

__all__ = ["COLD", "HOT", "PREFETCH_EVICT_ACCURACY", "SOURCE", "TIERS", "WARM", "Batch", "Entry", "Key", "StoreFull",
           "StoreStats", "TierConfig", "TieredExpertStore"]


class TieredExpertStore:
    """Experts of one replica across hot / warm / cold, moved by use and by prefetch hints.

    The store owns the entries, the byte accounting (`ledger`), the slot pools and the lock
    (`cv`); three collaborators do one job each over them: `disk` (coldio.ColdIO: cold files and
    version sources read into slots, written after a swap), `prefetcher` (prefetch.Prefetcher:
    its own thread and queue) and `swapper` (swap.HotSwap: stage, validate, commit between
    batches). What they use of the store is its public part: `cv`, `entries`, `pools`,
    `staging`, `forms`, `parts`, `part_names`, `fill`, `views`, `make_room`, `free_slot`,
    `drop_kept`, `settle`, `ledger`, `cold`, `ckpt`, `model`, `ops`, `policy`, `stats`."""

    def __init__(self, checkpoint: Checkpoint, compute_dtype: torch.dtype, config: TierConfig | None = None,
                 device: torch.device | str | None = None, on_move: MoveHook | None = None,
                 ops: DeviceOps | None = None):
        """`device`: the hot tier's (the CPU unless given: a replica's device comes from what Ray
        assigned it, see moe_workers.device.replica_device); `ops`: its operations (tests
        pass a recording one)."""
        self.ckpt = checkpoint
        self.model: MoEConfig = checkpoint.config
        self.dtype = compute_dtype
        self.part_names = [name for name, _ in self.model.expert_parts()]
        self.parts = {COMPUTE: [(name, compute_dtype, shape) for name, shape in self.model.expert_parts()],
                       STORED: [(name, getattr(torch, TORCH_NAME[st]) if st else self.model.dtype, shape)
                                for name, st, shape in self.model.stored_parts()]}
        self.forms = TierForms(compute_bytes=_bytes(self.parts[COMPUTE]), stored_bytes=_bytes(self.parts[STORED]),
                               quantized=self.model.quant is not None)
        self.config = config or TierConfig()
        self.ops = ops or ops_for(device, pinned=self.config.pinned)
        self.device = self.ops.device
        self.policy: Policy = make_policy(self.config.policy)
        self.cold_error: str | None = None
        self.cold = self._open_cold(self.config)
        self.on_move = on_move
        self.entries: dict[Key, Entry] = {}
        self.pools = {HOT: SlotPool(self.forms.nbytes(HOT), self.ops, self.device.type == "cpu",
                                    self._slots(HOT, self.config.hot_budget)),
                      WARM: SlotPool(self.forms.nbytes(WARM), self.ops, True, self._slots(WARM, self.config.warm_budget))}
        self.ledger = Ledger(self._budgets(self.config))
        # host buffers a quantized expert read from disk is decoded from into its hot slot (a
        # couple kept for reuse; no budget: one per promotion under way)
        self.staging = SlotPool(self.forms.stored_bytes, self.ops, True, None)
        self.stats = StoreStats()
        self.cv = threading.Condition(threading.RLock())
        self.prefetcher = Prefetcher(self._background)
        self.disk = ColdIO(self)
        self.swapper = HotSwap(self)
        self.hints = HintTracker()
        self.wait_timeout_s = 60.0
        # entries released while pinned or being moved: they keep their memory (and its count)
        # until their last unpin or the end of their move, so no batch or copy loses its weights
        self._retiring: list[Entry] = []
        # calls that must promote experts before computing are admitted one at a time: a call
        # holds pins only while it promotes or computes, never while it waits for another call
        # that holds pins (no hold-and-wait between batches)
        self._admission = threading.Lock()

    # -- configuration ------------------------------------------------------------------------

    @property
    def expert_bytes(self) -> int:
        """One expert in the compute dtype (what a hot slot holds)."""
        return self.forms.compute_bytes

    @staticmethod
    def _budgets(cfg: TierConfig) -> dict[str, int | None]:
        return {HOT: cfg.hot_budget, WARM: cfg.warm_budget}

    def _warm_ok(self, e: Entry) -> bool:
        """The warm tier holds a quantized model's experts in their stored form only: a version
        swapped in the compute dtype moves between hot and disk."""
        return not (self.forms.quantized and e.version.compute_only)

    def _open_cold(self, cfg: TierConfig) -> ColdCache | None:
        """The cache directory; an unusable one degrades to reading from the source (reported in
        `cold_error`), because a node without the NVMe path should still serve."""
        self.cold_error = None
        if not cfg.cold_dir:
            return None
        try:
            return ColdCache(Path(cfg.cold_dir), self.ckpt.path, cfg.cold_budget)
        except OSError as err:
            self.cold_error = f"tiers.cold_dir: cannot use {cfg.cold_dir} ({err.strerror or err}); reading experts from the source"
            return None

    def check_budgets(self, keys: Iterable[Key], config: TierConfig) -> None:
        """Refuse a hot budget that cannot hold one token's experts at once: those of a layer
        hosted here, top-k at most. A call needing more than the hot tier holds is computed in
        waves (`call_waves`); a token's own experts never wait for each other."""
        per_layer: dict[int, int] = {}
        for layer, _ in keys:
            per_layer[layer] = per_layer.get(layer, 0) + 1
        if not per_layer or config.hot_budget is None:
            return
        layer, n = max(per_layer.items(), key=lambda kv: (kv[1], -kv[0]))
        n = min(n, self.model.top_k)
        one = self.forms.nbytes(HOT)
        need = n * one
        if config.hot_budget < need:
            raise TierConfigError(
                f"tiers.hot_budget: {config.hot_budget} bytes cannot hold one token's experts: layer {layer} "
                f"needs {n} experts on this shard at once (top-{self.model.top_k}), {need} bytes ({one} each); raise "
                f"the hot budget to >= {need} or spread the experts over more groups")

    def call_waves(self, keys: list[Key]) -> list[list[int]]:
        """The positions of a call's experts in the waves it is computed in: all at once when
        the hot tier holds them, else groups of at most its slots, the experts already hot first
        (each wave pins, promotes and computes its experts, then lets them go)."""
        slots = self.pools[HOT].capacity
        if slots is None or len(keys) <= slots:
            return [list(range(len(keys)))]
        with self.cv:
            order = sorted(range(len(keys)), key=lambda i: (self.entries[keys[i]].tier != HOT
                                                             if keys[i] in self.entries else True, i))
            self.stats.waved_calls += 1
        return [order[i:i + slots] for i in range(0, len(order), slots)]

    def configure(self, keys: list[Key], config: TierConfig | None = None) -> None:
        """Host exactly `keys` under `config`: new experts are read (digest, cold file) and placed
        as high as budgets allow before this returns; dropped ones are released."""
        config = config or self.config
        self.check_budgets(keys, config)
        with self.cv:
            if config.policy != self.config.policy:
                self.policy = make_policy(config.policy)
            if (config.cold_dir, config.cold_budget) != (self.config.cold_dir, self.config.cold_budget):
                if self.cold is not None and config.cold_dir == self.config.cold_dir and self.cold_error is None:
                    self.cold.budget = config.cold_budget
                else:
                    self.cold = self._open_cold(config)
            self.config = config
            self.ledger.budgets = self._budgets(config)
            wanted = set(keys)
            self.pools[HOT].resize(self._slots(HOT, config.hot_budget))
            self.pools[WARM].resize(self._slots(WARM, config.warm_budget))
            for key in [k for k in self.entries if k not in wanted]:
                self._release(key)
        for key in keys:
            if key not in self.entries:
                self._register(key)
        with self.cv:
            for tier in (HOT, WARM):  # budgets may have shrunk
                if not self.make_room(tier, 0, exclude=set(), wait=True):
                    raise StoreFull(f"cannot shrink the {tier} tier to its budget")
        for key in keys:  # fill from the top while there is room that needs no eviction
            self._promote(key, HOT if self._fits(HOT) else WARM, mode="preload")

    def _slots(self, tier: str, budget: int | None) -> int | None:
        return None if budget is None else budget // self.forms.nbytes(tier)

    def _layout(self, buf: torch.Tensor, tier: str) -> dict[str, torch.Tensor]:
        """The expert's parts as views of one slot of `tier`, in the form it holds: the compute
        parts (w1, w2, w3 for SwiGLU experts) in the compute dtype, or the stored parts (fp8
        weights and F32 scales; mxfp4 blocks, scales and biases)."""
        return self.views(buf, self.forms.form(tier))

    def views(self, buf: torch.Tensor, form: str) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, dtype, shape in self.parts[form]:
            n = math.prod(shape) * dtype.itemsize
            out[name] = buf[offset:offset + n].view(dtype).view(shape)
            offset += n
        return out

    def fill(self, tier: str, src: dict[str, torch.Tensor], after=None) -> tuple[dict[str, torch.Tensor], torch.Tensor, object]:
        """Copy an expert into a slot of `tier` (room already reserved): (views, slot, the event
        the copy completes with). The copy waits for the slot's last readers and for `after`
        (the source's own copy); nothing here blocks the host on the device. A dtype conversion
        happens on the source's side first, so a DMA never allocates a converted temporary."""
        decoding = self.forms.form(tier) == COMPUTE and self.forms.quantized and set(src) != set(self.part_names)
        if self.forms.form(tier) == STORED and set(src) != {name for name, _, _ in self.parts[STORED]}:
            raise ValueError(f"the {tier} tier holds experts in their stored form; got parts {', '.join(sorted(src))}")
        with self.cv:
            buf, slot_after = self.pools[tier].take()
        ready = None
        try:
            views = self._layout(buf, tier)
            waits = [*slot_after, after]
            if decoding:  # the stored form decoded into the compute slot, where the device is
                ready = self.ops.decode(views, src, self.model.quant, after=waits)
            for name, dst in views.items() if not decoding else ():
                s = src[name]
                if s.dtype != dst.dtype:
                    s = s.to(dst.dtype)
                ready = self.ops.copy(dst, s, after=waits)
                waits = []  # one stream: later copies are ordered after the first
        except BaseException:
            with self.cv:  # (after the parts already enqueued)
                self.pools[tier].give(buf, [*slot_after, ready])
            raise
        return views, buf, ready

    def _same_memory(self) -> bool:
        """Hot and warm are both plain host memory in the same layout (no accelerator, an
        unquantized model): moving between them is bookkeeping, and copying would only waste memory."""
        return self.device.type == "cpu" and self.forms.same_layout()

    def _move_slot(self, src: str, dst: str) -> None:
        """A slot changes pools with its expert (lock held); both stay within their budgets."""
        self.pools[src].allocated -= 1
        self.pools[dst].allocated += 1
        # a hot victim moved into a full warm pool whose own victim freed a slot there: that
        # slot goes to the hot pool, which lost one (freeing it and faulting in a new 42 MiB
        # buffer for the next read cost 335 against 119 ms a batch-16 step in bench/tiering)
        self.pools[dst].hand_free_to(self.pools[src])
        self.pools[dst].trim()

    def free_slot(self, e: Entry, after=None) -> None:
        """Give e's slot back to the pool of its tier (lock held), once the device is done with
        it: its last batch, `after` (a copy out of it) and `e.ready` (the copy into it: an expert
        demoted hot -> warm may leave warm before its device -> host copy has run)."""
        if e.slot is not None and e.tier in (HOT, WARM):
            self.pools[e.tier].give(e.slot, [e.read_done, after, e.ready])
        e.slot, e.tensors, e.read_done = None, None, None

    def drop_kept(self, e: Entry) -> None:
        """A hot expert's stored copy leaves the warm tier (lock held): warm needs the room, the
        expert left, or a swap replaced it. Its slot is reused once the decode that read it is done."""
        if e.kept_slot is not None:
            self.pools[WARM].give(e.kept_slot, [e.ready])
            self.ledger.remove(WARM, self.forms.nbytes(WARM))
        e.kept, e.kept_slot = None, None

    def _warm_candidates(self) -> list[Key]:
        """What may leave the warm tier: warm experts no batch holds, and hot experts' stored copies."""
        return [k for k, e in self.entries.items() if not e.busy and
                (e.tier == WARM and e.pins == 0 or e.tier == HOT and e.kept is not None)]

    def _evict(self, tier: str, victim: Key) -> None:
        """Make room in `tier` by its victim (lock held): a hot expert's stored copy is dropped, a
        resident expert goes one tier down."""
        e = self.entries[victim]
        if tier == WARM and e.tier == HOT:
            self.drop_kept(e)
        else:
            self._demote(e)

    def _fits(self, tier: str) -> bool:
        return self.ledger.fits(tier, self.forms.nbytes(tier))

    def _register(self, key: Key) -> None:
        problem = self.model.expert_problem(*key)
        if problem:
            raise TierConfigError(problem)
        version = Version(self.disk.register(key), CHECKPOINT)
        with self.cv:
            self.entries[key] = Entry(key, version)

    def _release(self, key: Key) -> None:
        """Stop hosting `key` (lock held). An entry a batch has pinned, or one being moved, keeps
        its memory until its last unpin or the end of the move (`_retire_if_done`)."""
        e = self.entries.pop(key)
        if self.cold is not None:
            self.cold.drop(key)
        self.policy.forget(key)
        e.removed = True
        if e.pins or e.busy:
            self._retiring.append(e)
        else:
            self._retire(e)

    def _retire(self, e: Entry) -> None:
        """Give a removed entry's memory back (lock held)."""
        if e.tier in (HOT, WARM):
            self.ledger.remove(e.tier, self.forms.nbytes(e.tier))
        self.drop_kept(e)
        self.free_slot(e)
        e.tier = COLD

    def _retire_if_done(self, e: Entry) -> None:
        if e.removed and not e.pins and not e.busy and e in self._retiring:
            self._retiring.remove(e)
            self._retire(e)
            self.cv.notify_all()

    # -- reading weights for a batch ----------------------------------------------------------

    def use(self, keys: list[Key], top1: Iterable[Key] | None = ()) -> "Batch":
        """Weights (compute layout) of `keys`, pinned for the duration of a batch:
        `with store.use(keys) as weights: ...`. `top1`: those of `keys` that some token chose
        first (the router's ranking, told to the policy with the call's keys); None: tell the
        policy nothing (a wave of a call already told with `tell`).

        A call whose experts are all hot pins them and computes at once (one lock acquisition).
        A call that must promote some first is admitted as a unit: it takes the admission lock
        before pinning anything, so the only pins it can wait on belong to calls that are
        computing (and will unpin), never to a call waiting in turn for its pins."""
        return Batch(self, keys, top1)

    def swap(self, key: Key, load, source: str) -> Version:
        """Replace `key`'s weights between batches (`swap.HotSwap.swap`); the old version keeps
        serving on any failure, which propagates."""
        return self.swapper.swap(key, load, source)

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, keys: Iterable[Key]) -> None:
        """Hint: these experts are needed soon. Promoted in the background, never by evicting
        experts in use, and by evicting others only while hints mostly come true
        (PREFETCH_EVICT_ACCURACY); unknown keys (hosted elsewhere) are ignored."""
        if not self.config.prefetch:
            return
        with self.cv:
            keys = [k for k in keys if k in self.entries]
            self.hints.hinted(keys)
            self.prefetcher.put(*[k for k in keys if self.entries[k].tier != HOT])

    def _background(self, item) -> None:
        """The prefetch thread's work: a hinted key promoted to hot, a Refill read into warm."""
        if isinstance(item, Refill):
            self._promote(item.key, WARM, mode="refill")
        elif item in self.entries and self.entries[item].tier != HOT:
            self._promote(item, HOT, mode="prefetch")

    def drain_prefetch(self, timeout_s: float = 30.0) -> None:
        """Wait until queued prefetches are done (tests and benchmarks), and the work they queued
        in turn (a promotion's hot victim refilled into warm)."""
        self.prefetcher.drain(timeout_s)

    def tell(self, keys: list[Key], top1: Iterable[Key] = ()) -> None:
        """Tell the policy of a call (its experts and their first choices) without pinning:
        for a call computed in waves, each wave then `use`s its part with top1=None."""
        with self.cv:
            self._told(keys, top1)

    def _told(self, keys: list[Key], top1: Iterable[Key]) -> None:
        if top1:
            self.stats.ranked_calls += 1
        self.policy.visit(keys, top1)

    def _begin(self, keys: list[Key], top1: Iterable[Key] | None = ()) -> tuple[list[Entry], dict[Key, dict[str, torch.Tensor]]]:
        deadline = time.monotonic() + self.wait_timeout_s
        with self.cv:
            if self.config.prefetch:
                self.hints.used(keys)
                self.stats.hint_accuracy = self.hints.accuracy
            entries = self._pin(keys, deadline, fast_only=True, top1=top1)
            if entries is not None:  # every one hot and still: a hit each, as a demand promotion counts it
                for e in entries:
                    self.stats.hits[HOT] += 1
                    if e.prefetched:
                        self.stats.prefetch_used += 1
                        e.prefetched = False
        if entries is None:  # some must be promoted first: the call waits for them
            t0 = time.perf_counter()
            try:
                return self._begin_admitted(keys, deadline, top1)
            finally:
                with self.cv:
                    self.stats.promotion_waits += 1
                    self.stats.promotion_wait_s += time.perf_counter() - t0
        self._after_copies(entries)
        return entries, {e.key: e.tensors for e in entries}

    def _after_copies(self, entries: list[Entry]) -> None:
        """The batch's kernels run after the copies that brought its experts (a device error
        there unpins the batch before it propagates)."""
        try:
            for e in entries:
                self.ops.wait(e.ready)
        except BaseException:
            self._end(entries)
            raise

    def _begin_admitted(self, keys: list[Key], deadline: float, top1: Iterable[Key] | None) -> tuple[list[Entry], dict]:
        if not self._admission.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise StoreFull("timed out waiting to load this batch's experts (other batches are loading theirs)")
        entries: list[Entry] = []
        try:
            entries = self._pin(keys, deadline, fast_only=False, top1=top1)
            out = {e.key: self._promote(e.key, HOT, mode="demand", entry=e) for e in entries}
        except BaseException:
            self._admission.release()
            self._end(entries)
            raise
        self._admission.release()
        self._after_copies(entries)
        return entries, out

    def _end(self, entries: list[Entry]) -> None:
        if not entries:
            return
        now = time.monotonic()
        read_done = self.ops.record()  # after the batch's kernels: its slots may be reused then
        with self.cv:
            for e in entries:
                e.pins -= 1
                e.last_used = now
                if read_done is not None:
                    e.read_done = read_done
                self._retire_if_done(e)
            self.settle()
            self.cv.notify_all()

    def _pin(self, keys: list[Key], deadline: float, fast_only: bool, top1: Iterable[Key] | None = ()
             ) -> list[Entry] | None:
        """Pin `keys` once no swap of theirs is committing, and tell the policy of the call.
        fast_only: only when every one is hot and still (None otherwise: the call must be
        admitted to promote)."""
        with self.cv:
            while True:
                missing = [k for k in keys if k not in self.entries]
                if missing:
                    raise KeyError(f"this replica does not host expert(s) {', '.join(f'{l}.{e}' for l, e in missing)}")
                if not any(self.entries[k].swap_pending for k in keys):  # a swap commits between batches
                    break
                if not self.cv.wait(max(0.0, deadline - time.monotonic())):
                    raise StoreFull("timed out waiting for a hot-swap to commit")
            entries = [self.entries[k] for k in keys]
            if fast_only and not all(e.tier == HOT and not e.busy for e in entries):
                return None
            for e in entries:
                e.pins += 1
            if top1 is not None:
                self._told(keys, top1)
            return entries

    def promote(self, key: Key, tier: str = HOT) -> bool:
        """Move one expert up to `tier` now, evicting by policy (experts in use are never
        evicted); False when there was no room. For operators' warm-up and benchmarks."""
        return self._promote(key, tier, mode="prefetch") is not None

    def demote(self, key: Key) -> None:
        """Move one expert down a tier now (unless a batch is using it)."""
        with self.cv:
            e = self.entries[key]
            if e.tier in (HOT, WARM) and not e.busy and e.pins == 0:
                self._demote(e)

    # -- moves --------------------------------------------------------------------------------

    def _promote(self, key: Key, target: str, mode: str, entry: Entry | None = None) -> dict[str, torch.Tensor] | None:
        """Move `key` up to `target`; returns its tensors when it ends there. mode: "demand" (a
        batch needs it: waits and evicts, or raises), "prefetch" (a hint: evicts by policy, never
        waits), "refill" (a quantized expert demoted from hot read back into warm: evicts there
        by policy, never waits), "preload" (fills free room only). `entry`: the one a batch
        pinned (it stays that batch's even if the expert is removed from the replica meanwhile).

        Three steps: claim (under the lock: the entry marked busy, room reserved in `target`),
        copy (unlocked), land (under the lock: the reservation committed) or, on any failure,
        roll back (`_abandon`, the one place that undoes a claim)."""
        with self.cv:
            move = self._claim(key, target, mode, entry)
        if not isinstance(move, _Move):
            return move
        t0 = time.perf_counter()
        kept_ready = None
        try:
            if move.warm_copy is not None and self._same_memory():
                tensors, slot, ready = move.warm_copy, move.e.slot, move.warm_ready  # the slot changes tier
            elif move.warm_copy is not None:
                tensors, slot, ready = self.fill(target, move.warm_copy, after=move.warm_ready)
            elif move.kept_hold is not None:  # from disk into a warm slot it keeps, decoded from there
                move.kept, move.kept_slot, kept_ready = self.disk.read(key, move.version, WARM)
                tensors, slot, ready = self.fill(target, move.kept, after=kept_ready)
            else:
                tensors, slot, ready = self.disk.read(key, move.version, target)
        except BaseException:
            with self.cv:
                if move.kept_slot is not None:
                    self.pools[WARM].give(move.kept_slot, [kept_ready])
                self._abandon(move)
            raise
        with self.cv:
            self._land(move, tensors, slot, ready)
        if self.on_move is not None:
            self.on_move(move.label.split("->")[0], target, time.perf_counter() - t0, self.forms.nbytes(target))
        return tensors

    def _claim(self, key: Key, target: str, mode: str, entry: Entry | None) -> "_Move | dict | None":
        """The first step of a move (lock held): the entry's tensors when it is already there,
        None when it cannot move now (not demanded), else the claimed move."""
        demand = mode == "demand"
        evict = demand or mode == "refill" or mode == "prefetch" and (
            self.hints.accuracy is None or self.hints.accuracy >= PREFETCH_EVICT_ACCURACY)
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            e = entry if entry is not None else self.entries.get(key)
            if e is None or (entry is None and e.removed):
                if demand:
                    raise KeyError(f"expert {key[0]}.{key[1]} was removed from this replica")
                return None
            if not e.busy and (e.tier == target or (e.tier == HOT and target == WARM)):
                if demand:  # (also when it waited for a prefetch already under way)
                    self.stats.hits[HOT] += 1
                if demand and e.prefetched:
                    self.stats.prefetch_used += 1
                    e.prefetched = False
                return e.tensors
            if target == WARM and not self._warm_ok(e):
                return None
            if not e.busy:
                break
            if not demand:
                return None
            self.cv.wait(max(0.0, deadline - time.monotonic()))
            if time.monotonic() > deadline:
                raise StoreFull(f"timed out waiting for expert {key[0]}.{key[1]} to move")
        e.busy = True  # from here on no eviction (nested ones included) may pick it
        # In one memory (no accelerator) warm -> hot is an exchange: the expert leaves its warm
        # room as the hot tier's victim moves in. Counting that room free first keeps the victim
        # in RAM; otherwise every such promotion with warm full pushed another expert to disk (68
        # cold reads a step at batch 16 with every expert fitting in RAM).
        credit = self.forms.nbytes(WARM) if e.tier == WARM and target == HOT and self._same_memory() else 0
        self.ledger.remove(WARM, credit)
        need = self.forms.nbytes(target)
        move = _Move(e, e.tier, target, mode, credit=credit)
        try:
            room = self.make_room(target, need, exclude={key}, wait=demand, evict=evict)
        except BaseException:
            self._abandon(move)
            raise
        if not room:
            self._abandon(move)
            if mode == "prefetch":
                self.stats.prefetch_skipped += 1
            return None
        if demand:
            self._count_miss(e)
        move.hold = self.ledger.reserve(target, need)
        move.warm_copy = e.tensors if e.tier == WARM else None
        move.warm_ready, move.version = e.ready, e.version
        if (mode != "preload" and e.tier == COLD and target == HOT and self._warm_ok(e) and not self.forms.same_layout()
                and self.make_room(WARM, self.forms.nbytes(WARM), exclude={key}, wait=False, evict=evict)):
            # a quantized expert read from disk for hot goes through a warm slot it keeps: leaving
            # hot later it is warm at once instead of being read from disk a second time (a refill);
            # not when filling free room (configure: distinct experts first)
            move.kept_hold = self.ledger.reserve(WARM, self.forms.nbytes(WARM))
        return move

    def _abandon(self, move: "_Move") -> None:
        """Undo a claim (lock held): its reservations, the warm room an exchange counted free."""
        if move.hold is not None:
            move.hold.abandon()
        if move.kept_hold is not None:
            move.kept_hold.abandon()
        self.ledger.add(WARM, move.credit)
        move.e.busy = False
        self.cv.notify_all()

    def _land(self, move: "_Move", tensors: dict[str, torch.Tensor], slot: torch.Tensor, ready) -> None:
        """The last step of a move (lock held): the entry is in `target` with its new copy."""
        e, source, target = move.e, move.source, move.target
        move.hold.commit()
        if move.kept_hold is not None:
            move.kept_hold.commit()
            e.kept, e.kept_slot = move.kept, move.kept_slot  # (a removed entry gives it back as it retires)
        if source == WARM and target == HOT and not self.forms.same_layout() and not e.removed:
            e.kept, e.kept_slot = e.tensors, e.slot  # decoded into hot: its stored copy stays in warm
            e.slot = None  # (the hot slot below replaces it; the warm one is the entry's kept copy)
        elif source in (HOT, WARM) and not move.credit:
            self.ledger.remove(source, self.forms.nbytes(source))
        if slot is e.slot:
            self._move_slot(source, target)
        elif e.slot is not None or e.kept_slot is None:
            self.free_slot(e, after=ready)  # the copy read the old slot
        e.tensors, e.slot, e.tier, e.busy, e.ready = tensors, slot, target, False, ready
        e.prefetched = move.mode == "prefetch"
        if move.mode == "prefetch":
            self.stats.prefetch_issued += 1
        self.stats.promotions += 1
        move.label = f"{source if source != COLD or self._has_cold(e) else SOURCE}->{target}"
        self.stats.bytes_moved[move.label] = self.stats.bytes_moved.get(move.label, 0) + self.forms.nbytes(target)
        self._retire_if_done(e)  # released while it moved, and no batch holds it
        self.cv.notify_all()

    def _count_miss(self, e: Entry) -> None:
        self.stats.misses[HOT] += 1
        self.stats.key_misses[e.key] = self.stats.key_misses.get(e.key, 0) + 1
        if e.tier == WARM:
            self.stats.hits[WARM] += 1
            return
        self.stats.misses[WARM] += 1
        if self._has_cold(e):
            self.stats.hits[COLD] += 1
        else:
            self.stats.misses[COLD] += 1

    def _has_cold(self, e: Entry) -> bool:
        return self.cold is not None and self.cold.get(e.key, e.version.digest) is not None

    def make_room(self, tier: str, nbytes: int, exclude: set[Key], wait: bool, evict: bool = True) -> bool:
        """Evict (by policy) until `nbytes` more fit in `tier`. Called with the lock held."""
        budget = self.ledger.budgets[tier]
        if budget is None:
            return True
        if nbytes > budget:
            return False
        deadline = time.monotonic() + self.wait_timeout_s
        while not self.ledger.fits(tier, nbytes):
            candidates = [k for k in self._candidates(tier) if k not in exclude] if evict else []
            victim = self.policy.victim(candidates)
            if victim is None:
                if not wait:
                    return False
                if self.ledger.staged[tier]:
                    # a swap's staged copy holds the room, and its commit waits for the batches
                    # that pinned the expert, this one maybe: waiting here would deadlock until the
                    # timeout. Go over the budget by the staged copy until the commit frees the old.
                    return True
                if not self.cv.wait(max(0.0, deadline - time.monotonic())):
                    raise StoreFull(f"no room in the {tier} tier: every resident expert is in use")
                continue
            self._evict(tier, victim)
        return True

    def _candidates(self, tier: str) -> list[Key]:
        if tier == WARM:
            return self._warm_candidates()
        return [k for k, e in self.entries.items() if e.tier == tier and not e.busy and e.pins == 0]

    def settle(self) -> None:
        """Back within the budgets (lock held). A batch may have gone over a budget by a swap's
        staged copy (see _make_room); once no swap is staged there, evict by policy what no batch
        holds until the tier fits again."""
        for tier in (HOT, WARM):
            if self.ledger.budgets[tier] is None or self.ledger.staged[tier]:
                continue
            while self.ledger.over(tier):
                victim = self.policy.victim(self._candidates(tier))
                if victim is None:
                    break  # the batches holding them will settle it when they end
                self._evict(tier, victim)

    def _demote(self, e: Entry) -> None:
        """One tier down (hot -> warm when warm has room without waiting, else to disk). Called
        with the lock held; a copy to the warm tier (a GPU hot tier) is issued with the lock
        released, the entry busy and its warm room counted meanwhile, so no device call ever
        runs under the store's lock. A quantized expert leaving hot is warm again at once when it
        kept its stored copy there (promoted from warm); else it goes to disk and is read back
        into warm in its stored form by the prefetch thread (`Refill`): its hot copy is the
        decoded form, which the warm tier does not hold."""
        src = e.tier
        self.stats.demotions += 1
        t0 = time.perf_counter()
        to_warm = src == HOT and self.forms.same_layout() and self._warm_ok(e)
        moved = 0
        if src == HOT and e.kept is not None:  # its stored copy is warm already: no copy, no disk
            self.ledger.remove(HOT, self.forms.nbytes(HOT))
            self.free_slot(e)
            # e.ready stays: the decode that wrote the hot slot read this one
            e.tensors, e.slot, e.kept, e.kept_slot = e.kept, e.kept_slot, None, None
            e.tier = dst = WARM
        elif to_warm and self.make_room(WARM, self.forms.nbytes(WARM), exclude={e.key}, wait=False):
            if self._same_memory():
                self._move_slot(HOT, WARM)
            else:
                e.busy = True  # no eviction, batch or move may pick it while the lock is released
                hold = self.ledger.reserve(WARM, self.forms.nbytes(WARM))  # its warm room, held across the copy
                try:
                    with _released(self.cv):
                        tensors, slot, ready = self.fill(WARM, e.tensors, after=e.ready)
                except BaseException:
                    hold.abandon()
                    e.busy = False
                    self.cv.notify_all()
                    raise
                hold.abandon()  # counted as used below, with the tier change
                e.busy = False
                self.free_slot(e, after=ready)
                e.tensors, e.slot, e.ready = tensors, slot, ready
                self.cv.notify_all()
            self.ledger.remove(src, self.forms.nbytes(src))
            e.tier = WARM
            self.ledger.add(WARM, self.forms.nbytes(WARM))
            dst, moved = WARM, self.forms.nbytes(WARM)
        else:
            self.ledger.remove(src, self.forms.nbytes(src))
            self.free_slot(e)
            e.tier = COLD
            dst = COLD
            if src == HOT and not self.forms.same_layout() and self._warm_ok(e) and not e.removed:
                self.prefetcher.put(Refill(e.key))
        e.prefetched = False
        self._retire_if_done(e)  # dropped by configure() while its copy ran
        move = f"{src}->{dst}"
        self.stats.bytes_moved[move] = self.stats.bytes_moved.get(move, 0) + moved
        if self.on_move is not None:
            self.on_move(src, dst, time.perf_counter() - t0, moved)

    # -- idle demotion ------------------------------------------------------------------------

    def demote_idle(self, now: float | None = None) -> int:
        """Move experts unused for idle_demotion_s down one tier; returns how many moved."""
        idle = self.config.idle_demotion_s
        if not idle:
            return 0
        now = time.monotonic() if now is None else now
        moved = 0
        with self.cv:
            for e in list(self.entries.values()):
                if e.tier in (HOT, WARM) and not e.busy and e.pins == 0 and now - e.last_used >= idle:
                    self._demote(e)
                    e.last_used = now  # the next step down waits another idle period
                    moved += 1
        return moved

    # -- status -------------------------------------------------------------------------------

    def residency(self) -> dict[str, dict]:
        """Per tier: experts and bytes (cold: files in the cache), and one expert's form and
        bytes as the tier holds it, with their ratio to the compute dtype (`TierForms.report`)."""
        forms = self.forms.report()
        with self.cv:
            out = {t: {"experts": 0, "bytes": 0, "form": forms[t]["form"], "expert_bytes": forms[t]["bytes"],
                       "vs_compute": forms[t]["vs_compute"]} for t in TIERS}
            for e in self.entries.values():
                if e.tier in (HOT, WARM):
                    out[e.tier]["experts"] += 1
                    out[e.tier]["bytes"] += self.forms.nbytes(e.tier)
                if e.kept is not None:  # a hot expert's stored copy, in warm
                    out[WARM]["experts"] += 1
                    out[WARM]["bytes"] += self.forms.nbytes(WARM)
            if self.model.quant is not None:  # what decodes a stored expert into a hot slot
                out[HOT]["decoder"] = native.describe() if self.device.type == "cpu" else self.device.type
            if self.cold is not None:
                out[COLD]["experts"] = len(self.cold.files)
                out[COLD]["bytes"] = self.cold.used()
                if self.cold.files:  # the checkpoint's own bytes (its scales' dtype, which warm widens to F32)
                    out[COLD]["expert_bytes"] = self.cold.used() // len(self.cold.files)
                    out[COLD]["vs_compute"] = round(out[COLD]["expert_bytes"] / self.forms.compute_bytes, 4)
            return out

    def experts(self) -> dict[str, dict]:
        """Per hosted expert: version digest and source, tier."""
        with self.cv:
            out = {}
            for (l, ex), e in sorted(self.entries.items()):
                tier = e.tier if e.tier != COLD or self._has_cold(e) else SOURCE
                out[f"{l}.{ex}"] = {"digest": e.version.digest, "source": e.version.source, "tier": tier}
            return out

    def misses_by_key(self) -> dict[Key, int]:
        """Hot misses per expert since start (a batch that had to promote it): the expert's
        share of `stats.misses["hot"]`, for its health in the shard's status."""
        with self.cv:
            return dict(self.stats.key_misses)

    def policy_report(self) -> dict:
        """The eviction policy's name and, for RankAware, the temporal locality it has learnt."""
        with self.cv:
            stay = self.policy.stay() if isinstance(self.policy, RankAware) else None
            return {"name": self.policy.name, "stay": None if stay is None else round(stay, 4)}

    def budgets(self) -> dict[str, int | None]:
        return {HOT: self.config.hot_budget, WARM: self.config.warm_budget,
                COLD: self.cold.budget if self.cold is not None else None}

    def close(self) -> None:
        self.prefetcher.close()


@contextmanager
def _released(cv: threading.Condition):
    """The store's lock (an RLock, possibly held more than once by this thread) released for
    the block and taken again as deeply after it: a device copy never runs under the lock."""
    depth = 0
    while True:
        try:
            cv.release()
        except RuntimeError:  # no longer held by this thread
            break
        depth += 1
    try:
        yield
    finally:
        for _ in range(depth):
            cv.acquire()


def _bytes(parts: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in parts)


@dataclass(eq=False)
class _Move:
    """One promotion between its claim and its landing (TieredExpertStore._promote)."""

    e: Entry
    source: str
    target: str
    mode: str
    credit: int = 0  # warm bytes counted free for an exchange (given back if the move fails)
    hold: Hold | None = None  # the room reserved in `target`
    warm_copy: dict[str, torch.Tensor] | None = None
    warm_ready: object = None
    kept_hold: Hold | None = None  # warm room for the stored copy a quantized expert read from disk keeps
    kept: dict[str, torch.Tensor] | None = None
    kept_slot: torch.Tensor | None = None
    version: Version | None = None
    label: str = ""


class Batch:
    """`TieredExpertStore.use`: a class rather than a generator-based context manager (a shard
    enters one per request, per layer of every decode step; the generator form took several
    times the Python operations, which cost tens of microseconds each between a replica's idle
    gaps)."""

    __slots__ = ("store", "keys", "top1", "entries")

    def __init__(self, store: TieredExpertStore, keys: list[Key], top1: Iterable[Key] | None = ()):
        self.store = store
        self.keys = keys
        self.top1 = top1
        self.entries: list[Entry] = []

    def __enter__(self) -> dict[Key, dict[str, torch.Tensor]]:
        self.entries, weights = self.store._begin(self.keys, self.top1)
        return weights

    def __exit__(self, *exc) -> None:
        entries, self.entries = self.entries, []
        self.store._end(entries)
