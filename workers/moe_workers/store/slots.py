"""Fixed-size expert buffers of one tier (SlotPool)."""

from __future__ import annotations

import torch

from moe_workers.device import DeviceOps


class SlotPool:
    """Fixed-size buffers of one expert each, for one tier. Reusing them keeps a replica's memory
    at its budgets: freshly allocated and freed 100 MB tensors fragment the host heap (and each
    thread's malloc arena) until RSS is several times the weights it holds.

    A slot is given back with the events of the last device work on it (a batch or a copy out of
    it that reads it, the copy into it that may still write it); whoever takes it next orders its
    copy after them (`take()` returns them; a host write waits for them first), so a recycled slot
    is never overwritten under a kernel or copy still using it. A dropped slot whose device work
    has not finished is kept until it has (its memory is still in use)."""

    def __init__(self, slot_bytes: int, ops: DeviceOps, host: bool, capacity: int | None):
        self.slot_bytes, self.ops, self.host = slot_bytes, ops, host
        self.device = torch.device("cpu") if host else ops.device
        self.capacity = capacity  # slots; None: unbounded (then only a couple of free ones are kept)
        self.free: list[tuple[torch.Tensor, list]] = []  # (slot, events its last readers recorded)
        self.dropping: list[tuple[torch.Tensor, list]] = []  # over capacity, waiting for their readers
        self.allocated = 0
        self.allocations = 0  # buffers ever allocated (a reused slot is not counted again)

    def take(self) -> tuple[torch.Tensor, list]:
        """A slot, and the events a copy into it must wait for."""
        self._reap()
        if self.free:
            return self.free.pop()
        buf = self.ops.alloc(self.slot_bytes, self.host)
        self.allocated += 1  # counted once it exists: a failed allocation changes nothing
        self.allocations += 1
        return buf, []

    def give(self, buf: torch.Tensor, after: list | None = None) -> None:
        after = [e for e in (after or []) if e is not None]
        if self.capacity is None and len(self.free) >= 2 or \
                self.capacity is not None and self.allocated > self.capacity:
            self._drop(buf, after)
            return
        self.free.append((buf, after))

    def resize(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.trim()

    def hand_free_to(self, other: "SlotPool") -> bool:
        """One free slot of this pool, over its capacity, becomes the other pool's (same memory
        kind only): a move that pushed this pool over and left the other short reuses the slot
        instead of freeing one buffer and faulting in another."""
        if self.capacity is None or self.allocated <= self.capacity or not self.free:
            return False
        if (other.host, other.device) != (self.host, self.device):
            return False
        other.free.append(self.free.pop())
        self.allocated -= 1
        other.allocated += 1
        return True

    def trim(self) -> None:
        """Drop free slots while the pool holds more than its capacity (a slot that came in with
        its expert from another pool may have pushed it over)."""
        while self.free and (self.capacity is None and len(self.free) > 2 or
                             self.capacity is not None and self.allocated > self.capacity):
            self._drop(*self.free.pop())

    def _drop(self, buf: torch.Tensor, after: list) -> None:
        if any(not e.query() for e in after):
            self.dropping.append((buf, after))  # still read: freed once its readers are done
            return
        self.ops.free(buf, self.host)
        self.allocated -= 1  # dropped: its memory goes back

    def _reap(self) -> None:
        if self.dropping:
            pending, self.dropping = self.dropping, []
            for buf, after in pending:
                self._drop(buf, after)
