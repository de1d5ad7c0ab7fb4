"""Fixed-size expert buffers of one tier (SlotPool)."""

from __future__ import annotations

import torch


class SlotPool:
    """Fixed-size buffers of one expert each, for one tier. Reusing them keeps a replica's memory
    at its budgets: freshly allocated and freed 100 MB tensors fragment the host heap (and each
    thread's malloc arena) until RSS is several times the weights it holds."""

    def __init__(self, slot_bytes: int, device: torch.device, pin: bool, capacity: int | None):
        self.slot_bytes, self.device, self.pin = slot_bytes, device, pin
        self.capacity = capacity  # slots; None: unbounded (then only a couple of free ones are kept)
        self.free: list[torch.Tensor] = []
        self.allocated = 0

    def take(self) -> torch.Tensor:
        if self.free:
            return self.free.pop()
        buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
        self.allocated += 1  # counted once it exists: a failed allocation changes nothing
        return buf

    def give(self, buf: torch.Tensor) -> None:
        if self.capacity is None and len(self.free) >= 2 or \
                self.capacity is not None and self.allocated > self.capacity:
            self.allocated -= 1  # dropped: its memory goes back
            return
        self.free.append(buf)

    def resize(self, capacity: int | None) -> None:
        self.capacity = capacity
        while self.free and (capacity is None and len(self.free) > 2 or
                             capacity is not None and self.allocated > capacity):
            self.free.pop()
            self.allocated -= 1
