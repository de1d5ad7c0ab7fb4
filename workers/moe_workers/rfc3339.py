"""Timestamps as Kubernetes writes them in status (RFC 3339, UTC, whole seconds, `Z`) (pure)."""

from __future__ import annotations

import time
from datetime import datetime, timezone


def format_rfc3339(t: float | None = None) -> str:
    """Seconds since the epoch (now when None) -> '2026-12-03T10:04:05Z'."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


def parse_rfc3339(text: str | None) -> float | None:
    """'2026-12-03T10:04:05Z' (or with an offset) -> seconds since the epoch; None or '' -> None."""
    if not text:
        return None
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()
