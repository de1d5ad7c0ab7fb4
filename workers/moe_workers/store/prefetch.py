"""The tiered store's background mover: one thread that takes work (router hints to promote,
quantized experts to read back into warm) off a queue and hands each item to the store, never
blocking the caller. It owns its queue, thread and count of work outstanding; the store owns the
experts and decides what an item does (`TieredExpertStore._background`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .entry import Key


@dataclass(frozen=True)
class Refill:
    """A quantized expert demoted from hot, to read back into warm in its stored form."""

    key: Key


Item = Key | Refill


class Prefetcher:
    """Runs `work(item)` for queued items on one thread, started on first use. A failure of
    one item is dropped (a prefetch is a hint, a refill an optimisation: it costs a later disk
    read). `drain` waits for everything queued, and the work that queued in turn."""

    def __init__(self, work: Callable[[Item], None]):
        self._work = work
        self._q: queue.SimpleQueue = queue.SimpleQueue()  # items, None to stop
        self._cv = threading.Condition()
        self._pending = 0  # queued or under way
        self._thread: threading.Thread | None = None

    def put(self, *items: Item) -> None:
        if not items:
            return
        with self._cv:  # one thread: a batch's hint and a demotion's refill may be the first at once
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="expert-prefetch", daemon=True)
                self._thread.start()
            self._pending += len(items)
        for item in items:
            self._q.put(item)

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            try:
                self._work(item)
            except Exception:
                pass
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until nothing is queued or under way; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        with self._cv:
            if self._thread is not None:
                self._q.put(None)
