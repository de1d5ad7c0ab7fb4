"""What moectl shows, built from an app's status report: pure functions, no I/O (unit-tested
without a cluster)."""

from __future__ import annotations

from typing import Optional

from rich.table import Table

from moe_workers.expert_ids import expert_key


def replica_progress(report: dict, expert: str, path: Optional[str]) -> list[tuple[str, str]]:
    """Per replica hosting `expert`: where its swap to `path` (None: rollback) stands (pure)."""
    rows = []
    for r in report.get("replicas") or []:
        v = (r.get("versions") or {}).get(expert)
        if v is None:
            continue
        who = f"{r.get('group', '?')}/{str(r.get('replica', '?'))[:8]}"
        attempt = (r.get("swaps") or {}).get(expert) or {}
        digest = str(v.get("digest", ""))[:19]
        if path is None:
            state = "back on the checkpoint" if v.get("source") == "checkpoint" else f"waiting (serving {digest})"
        elif v.get("source") == path:
            state = f"serving {digest}"
        elif attempt.get("path") == path and attempt.get("outcome") == "Failed":
            state = f"refused: {attempt.get('reason', '')}"
        else:
            state = f"waiting (serving {digest})"
        rows.append((who, state))
    return rows


def expert_rows(report: dict) -> list[dict]:
    """Per expert across replicas: hosting groups, replicas, tiers, version, tokens (pure)."""
    rows: dict[str, dict] = {}
    for r in report.get("replicas") or []:
        for eid, v in (r.get("versions") or {}).items():
            row = rows.setdefault(eid, {"expert": eid, "groups": set(), "replicas": 0, "tiers": {}, "digests": set(),
                                        "sources": set(), "tokens": 0})
            row["groups"].add(r.get("group", "?"))
            row["replicas"] += 1
            row["tiers"][v.get("tier", "?")] = row["tiers"].get(v.get("tier", "?"), 0) + 1
            row["digests"].add(v.get("digest", ""))
            row["sources"].add(v.get("source", ""))
            row["tokens"] += int(v.get("tokens", 0))
    out = []
    for eid in sorted(rows, key=expert_key):
        row = rows[eid]
        digest = row["digests"].pop() if len(row["digests"]) == 1 else "mixed"
        out.append({"expert": eid, "groups": sorted(row["groups"]), "replicas": row["replicas"],
                    "tiers": dict(sorted(row["tiers"].items())), "version": digest,
                    "override": any(src != "checkpoint" for src in row["sources"]), "tokens": row["tokens"]})
    return out


def load_grid(report: dict) -> tuple[list[list[int]], int, int]:
    """tokens[layer][expert] summed over replicas (pure)."""
    cells: dict[tuple[int, int], int] = {}
    for r in report.get("replicas") or []:
        for eid, v in (r.get("versions") or {}).items():
            layer, expert = expert_key(eid)
            cells[(layer, expert)] = cells.get((layer, expert), 0) + int(v.get("tokens", 0))
    layers = max((l for l, _ in cells), default=-1) + 1
    experts_ = max((e for _, e in cells), default=-1) + 1
    return [[cells.get((l, e), 0) for e in range(experts_)] for l in range(layers)], layers, experts_


def heatmap(grid: list[list[float]], title: str) -> Table:
    """Rows = layers, columns = experts; cell shade by share of the layer's load."""
    shades = ["grey23", "grey42", "dark_cyan", "cyan", "yellow", "orange1", "red1"]
    table = Table(title=title, box=None, header_style="bold", pad_edge=False)
    table.add_column("layer", justify="right")
    for e in range(len(grid[0]) if grid else 0):
        table.add_column(str(e), justify="right")
    table.add_column("imbalance", justify="right")
    for l, row in enumerate(grid):
        total = sum(row)
        peak = max(row) if row else 0
        cells = []
        for v in row:
            share = v / total if total else 0.0
            level = min(len(shades) - 1, int(share * len(row) * (len(shades) - 1) / 2)) if total else 0
            cells.append(f"[{shades[level]}]{'█' * 2} {v:>5.0f}[/]")
        mean = total / len(row) if row else 0
        table.add_row(str(l), *cells, f"{peak / mean:.2f}" if mean else "-")
    return table
