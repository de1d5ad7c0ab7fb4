"""The one check of weight paths against the allowed roots, shared by the operator (spec
validation) and the shards (hot-swap files): symlinks are resolved first, so a link inside a root
pointing outside it is outside."""

from __future__ import annotations

import os
from pathlib import Path


def within_roots(path: str | Path, roots: list[str]) -> Path | None:
    """The resolved path if it is one of the roots or lies below one, else None."""
    resolved = Path(os.path.realpath(path))
    for root in roots:
        r = Path(os.path.realpath(root))
        if resolved == r or r in resolved.parents:
            return resolved
    return None
