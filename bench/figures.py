"""How every benchmark ends: its results as JSON, its figures as `name: value` lines (what the
README quotes and CI logs keep), and its scratch directories gone."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path


def scratch(prefix: str) -> Path:
    """A new directory under the system's temporary one, removed when the benchmark exits (its
    checkpoints and Ray sessions run to gigabytes)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


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
