"""Polling helper for tests that wait on a real system to converge."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float = 240, what: str = "condition", interval_s: float = 0.5):
    """The first truthy value of predicate(), or AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
