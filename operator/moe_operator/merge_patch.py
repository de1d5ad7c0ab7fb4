"""JSON merge patches (RFC 7386) between two versions of a status (pure)."""

from __future__ import annotations


def merge_patch(before: dict, after: dict) -> dict:
    """A JSON merge patch from `before` to `after`: changed keys, and None for keys removed (a
    plain update would leave them, e.g. a finished rebalance's target)."""
    out = {}
    for k, v in after.items():
        old = before.get(k)
        if isinstance(v, dict) and isinstance(old, dict):
            sub = merge_patch(old, v)
            if sub:
                out[k] = sub
        elif v != old:
            out[k] = v
    for k in before:
        if k not in after:
            out[k] = None
    return out
