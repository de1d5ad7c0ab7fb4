"""What every part of the tiered store shares: tier names, an expert's entry (where its
weights are, who uses them), the store's counters."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .versions import Version

HOT, WARM, COLD, SOURCE = "hot", "warm", "cold", "source"
TIERS = (HOT, WARM, COLD)

Key = tuple[int, int]  # (layer, expert)


class StoreFull(RuntimeError):
    """No room could be made in a tier in time (every resident expert is in use)."""


@dataclass(eq=False)  # identity: entries are looked up in lists (_retiring), never compared by value
class Entry:
    key: Key
    version: Version
    tier: str = COLD
    tensors: dict[str, torch.Tensor] | None = None  # hot or warm copy: views into `slot`
    slot: torch.Tensor | None = None
    pins: int = 0
    busy: bool = False  # being moved; waiters wait on the store's condition
    swap_pending: bool = False
    prefetched: bool = False  # promoted by a hint and not yet used
    last_used: float = field(default_factory=time.monotonic)
    removed: bool = False  # no longer hosted; its memory goes back at its last unpin / the end of its move
    # device event: the copy into `slot` is complete (None: nothing pending); on a slot that was a
    # hot expert's kept copy, the decode that read it. A slot goes back to its pool after it.
    ready: object = None
    read_done: object = None  # device event: the last batch that read `slot` is complete
    # a quantized model's expert promoted from warm to hot keeps its stored form in its warm slot
    # (counted in warm): evicted from hot it is warm again at once, with no read from disk
    kept: dict[str, torch.Tensor] | None = None
    kept_slot: torch.Tensor | None = None


@dataclass
class StoreStats:
    hits: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    misses: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    bytes_moved: dict[str, int] = field(default_factory=dict)  # "cold->hot": bytes
    promotions: int = 0
    demotions: int = 0
    prefetch_issued: int = 0  # prefetches that moved an expert up
    prefetch_used: int = 0  # of those, used by a batch before leaving the tier
    prefetch_skipped: int = 0  # no room without evicting experts in use (or hints too often wrong to evict)
    hint_accuracy: float | None = None  # share of recent hints a call then used (HintTracker)
    cold_reads: dict[str, int] = field(default_factory=lambda: {"cache": 0, "disk": 0})  # where cold files' bytes were
    ranked_calls: int = 0  # calls that said which of their experts tokens chose first (the router's ranking)
    waved_calls: int = 0  # calls with more experts than the hot tier holds, computed in waves
    promotion_waits: int = 0  # calls that waited for some of their experts to be promoted (a hot miss)
    promotion_wait_s: float = 0.0  # ... and how long, summed (wall)
    key_misses: dict = field(default_factory=dict)  # (layer, expert) -> hot misses (not in as_dict: status per expert)

    def as_dict(self) -> dict:
        acc = self.prefetch_used / self.prefetch_issued if self.prefetch_issued else None
        return {"hits": dict(self.hits), "misses": dict(self.misses), "bytes_moved": dict(self.bytes_moved),
                "promotions": self.promotions, "demotions": self.demotions,
                "prefetch_issued": self.prefetch_issued, "prefetch_used": self.prefetch_used,
                "prefetch_skipped": self.prefetch_skipped, "prefetch_accuracy": acc,
                "hint_accuracy": self.hint_accuracy,
                "cold_reads": dict(self.cold_reads), "ranked_calls": self.ranked_calls,
                "waved_calls": self.waved_calls, "promotion_waits": self.promotion_waits,
                "promotion_wait_s": self.promotion_wait_s}


MoveHook = Callable[[str, str, float, int], None]  # (from tier, to tier, seconds, bytes)
