"""Expert ids `L.E` (layer, expert) as every interface writes them: their numeric order (pure)."""

from __future__ import annotations


def expert_key(eid: str) -> tuple[int, ...]:
    """'3.12' -> (3, 12): sorts 3.2 before 3.12, which the strings do not."""
    return tuple(int(p) for p in eid.split("."))


def layer_of(eid: str) -> int:
    return int(eid.split(".")[0])
