"""The tiered store's prefetch: router hints queued and promoted by one background thread,
never by evicting experts in use. A part of `TieredExpertStore` (its state and lock), kept apart
for reading."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from .entry import HOT, WARM, Key


@dataclass(frozen=True)
class Refill:
    """A quantized expert demoted from hot, to read back into warm in its stored form."""

    key: Key


class Prefetch:
    """TieredExpertStore's prefetch thread (mixed into the store)."""

    def prefetch(self, keys: Iterable[Key]) -> None:
        """Hint: these experts are needed soon. Promoted in the background, never by evicting
        experts in use, and by evicting others only while hints mostly come true
        (PREFETCH_EVICT_ACCURACY); unknown keys (hosted elsewhere) are ignored."""
        if not self.config.prefetch:
            return
        with self._cv:
            keys = [k for k in keys if k in self.entries]
            self.hints.hinted(keys)
            self._queue(*[k for k in keys if self.entries[k].tier != HOT])

    def _queue(self, *items) -> None:
        """Work for the prefetch thread (started on first use): keys to promote to hot, or a
        Refill. `_prefetch_pending` counts what is queued or under way (drain_prefetch)."""
        if not items:
            return
        with self._cv:  # one thread: a batch's hint and a demotion's refill may be the first at once
            if self._prefetch_thread is None:
                self._prefetch_thread = threading.Thread(target=self._prefetch_loop, name="expert-prefetch",
                                                         daemon=True)
                self._prefetch_thread.start()
            self._prefetch_pending += len(items)
        for item in items:
            self._prefetch_q.put(item)

    def _prefetch_loop(self) -> None:
        while (item := self._prefetch_q.get()) is not None:
            try:
                if isinstance(item, Refill):
                    self._promote(item.key, WARM, mode="refill")
                elif item in self.entries and self.entries[item].tier != HOT:
                    self._promote(item, HOT, mode="prefetch")
            except Exception:  # a prefetch is a hint, a refill an optimisation: failures cost a later disk read
                pass
            finally:
                with self._cv:
                    self._prefetch_pending -= 1
                    self._cv.notify_all()

    def drain_prefetch(self, timeout_s: float = 30.0) -> None:
        """Wait until queued prefetches are done (tests and benchmarks), and the work they queued
        in turn (a promotion's hot victim refilled into warm)."""
        with self._cv:
            self._cv.wait_for(lambda: self._prefetch_pending == 0, timeout_s)
