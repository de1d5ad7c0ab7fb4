"""How every benchmark ends: its results as JSON, and its figures as `name: value` lines (what the
README quotes and CI logs keep)."""

from __future__ import annotations

import json
from pathlib import Path


def report(out: str | Path, results: dict, figures: dict[str, float], digits: int = 3) -> int:
    """Write `results`, with `figures` under "figures", to `out`; print one line per figure.
    Returns 0, the benchmark's exit status."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**results, "figures": figures}, indent=2))
    print()
    for name, value in figures.items():
        print(f"{name}: {value:.{digits}f}")
    return 0
