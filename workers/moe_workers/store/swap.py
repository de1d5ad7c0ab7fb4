"""The tiered store's hot-swap: a new version staged beside the serving one, validated, committed
between batches, the old one released after its last batch. A collaborator of
`TieredExpertStore` (its `swapper`), working over the store's public part under its lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from typing import TYPE_CHECKING

from .entry import HOT, WARM, Entry, Key
from .versions import SwapError, Version, content_digest

if TYPE_CHECKING:
    from .store import TieredExpertStore


class HotSwap:
    """TieredExpertStore's hot-swap; its own state is one lock per expert swapped."""

    def __init__(self, store: TieredExpertStore):
        """Over `store`'s entries, tiers and lock; its own: one lock per expert swapped."""
        self.store = store
        self._swap_locks: dict[Key, threading.Lock] = {}

    def swap(self, key: Key, load: Callable[[], dict[str, torch.Tensor]], source: str) -> Version:
        """Replace `key`'s weights: stage beside the serving version (room reserved in its tier,
        else warm; a quantized model's always hot, decoded), validate (`load` raises SwapError),
        commit between batches, release the old. On any failure the old version keeps serving
        and the error propagates."""
        if key not in self.store.entries:
            raise SwapError(f"expert {key[0]}.{key[1]} is not hosted on this replica")
        lock = self._swap_locks.setdefault(key, threading.Lock())
        with lock:  # swaps of one expert are serialised; the last one to commit wins
            with self.store.cv:
                e = self.store.entries[key]
                stage = self._stage_room(key, e, time.monotonic() + self.store.wait_timeout_s)
                hold = self.store.ledger.reserve(stage, self.store.forms.nbytes(stage), staged=True)
            slot = None
            try:
                raw = load()
                compute_only = self.store.forms.quantized and set(raw) == set(self.store.part_names)
                version = Version(content_digest(raw), source, compute_only=compute_only)
                staged, slot, staged_ready = self.store.fill(stage, raw)
            except BaseException:
                with self.store.cv:
                    self._unstage(hold, slot)
                raise
            with self.store.cv:
                e.swap_pending = True
                deadline = time.monotonic() + self.store.wait_timeout_s
                while e.pins or e.busy:  # the batch boundary
                    if not self.store.cv.wait(max(0.0, deadline - time.monotonic())):
                        e.swap_pending = False
                        self._unstage(hold, slot, staged_ready)
                        raise SwapError(f"expert {key[0]}.{key[1]} stayed in use for {self.store.wait_timeout_s:.0f} s; "
                                        "swap not committed")
                if e.removed:  # configure() dropped the expert while the swap waited for its batches
                    e.swap_pending = False
                    self._unstage(hold, slot, staged_ready)
                    raise SwapError(f"expert {key[0]}.{key[1]} was removed from this replica; swap not committed")
                if e.tier in (HOT, WARM):
                    self.store.ledger.remove(e.tier, self.store.forms.nbytes(e.tier))
                self.store.free_slot(e)  # the old version's memory: released after its last batch
                self.store.drop_kept(e)
                hold.commit()
                e.tensors, e.slot, e.tier, e.version, e.ready = staged, slot, stage, version, staged_ready
                e.swap_pending = False
                e.prefetched = False
                self.store.settle()
                self.store.cv.notify_all()
            # the cold file after the commit, off the swap's path (until it exists, a demoted
            # expert is read back from the version's own source file)
            threading.Thread(target=self.store.disk.write_if_current, args=(key, version, raw), name="cold-write",
                             daemon=True).start()
            return version

    def _unstage(self, hold, slot, ready=None) -> None:
        """A staged version that will not commit gives its room and slot back (lock held), the
        slot once `ready` (the copy into it) is done."""
        if slot is not None:
            self.store.pools[hold.tier].give(slot, [ready])
        hold.abandon()
        self.store.cv.notify_all()

    def _stage_room(self, key: Key, e: Entry, deadline: float) -> str:
        """The tier to stage a new version of `key` in, with room made there (lock held): its
        own tier first, then warm, then hot. When every expert there is in use (pinned by a
        batch, or moving), wait for one to be let go, up to `deadline`: under load the tiers are
        full of experts in use at any one moment, but not for long."""
        while True:
            if e.removed:
                raise SwapError(f"expert {key[0]}.{key[1]} was removed from this replica; swap not committed")
            # a quantized model's replacement may come in either form: staged decoded, in hot
            tiers = [HOT] if self.store.forms.quantized else ([e.tier] if e.tier in (HOT, WARM) else []) + [WARM, HOT]
            for tier in dict.fromkeys(tiers):
                if self.store.make_room(tier, self.store.forms.nbytes(tier), exclude={key}, wait=False):
                    return tier
            if not self.store.cv.wait(max(0.0, deadline - time.monotonic())):
                raise SwapError(f"no room to stage expert {key[0]}.{key[1]} beside the serving version: the hot and "
                                f"warm budgets stayed full of experts in use for {self.store.wait_timeout_s:.0f} s")
