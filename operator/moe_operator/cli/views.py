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
    """Per expert across replicas: hosting groups, replicas, tiers, version, tokens, and its
    health (pure): "p95_ms" (the slowest replica's sampled p95; None before a sample),
    "samples", "misses" (hot-tier misses) and "errors" (calls that raised) summed over replicas,
    "share" of its layer's tokens in the Ingress' last routing window against "baseline" (its
    moving average; both None before a window with tokens)."""
    rows: dict[str, dict] = {}
    for r in report.get("replicas") or []:
        health = r.get("health") or {}
        for eid, v in (r.get("versions") or {}).items():
            row = rows.setdefault(eid, {"expert": eid, "groups": set(), "replicas": 0, "tiers": {}, "digests": set(),
                                        "sources": set(), "tokens": 0, "p95_ms": None, "samples": 0, "misses": 0,
                                        "errors": 0})
            row["groups"].add(r.get("group", "?"))
            row["replicas"] += 1
            row["tiers"][v.get("tier", "?")] = row["tiers"].get(v.get("tier", "?"), 0) + 1
            row["digests"].add(v.get("digest", ""))
            row["sources"].add(v.get("source", ""))
            row["tokens"] += int(v.get("tokens", 0))
            h = health.get(eid) or {}
            if h.get("p95_ms") is not None:
                row["p95_ms"] = max(row["p95_ms"] or 0.0, h["p95_ms"])
            for k in ("samples", "misses", "errors"):
                row[k] += int(h.get(k, 0))
    load = (report.get("routing") or {}).get("load") or {}
    out = []
    for eid in sorted(rows, key=expert_key):
        row = rows[eid]
        digest = row["digests"].pop() if len(row["digests"]) == 1 else "mixed"
        layer, expert = expert_key(eid)
        figures = load.get(str(layer)) or {}
        share, baseline = (figures.get(k) or [] for k in ("share", "baseline"))
        out.append({"expert": eid, "groups": sorted(row["groups"]), "replicas": row["replicas"],
                    "tiers": dict(sorted(row["tiers"].items())), "version": digest,
                    "override": any(src != "checkpoint" for src in row["sources"]), "tokens": row["tokens"],
                    "p95_ms": row["p95_ms"], "samples": row["samples"], "misses": row["misses"],
                    "errors": row["errors"], "share": share[expert] if expert < len(share) else None,
                    "baseline": baseline[expert] if expert < len(baseline) else None})
    return out


def health_order(row: dict) -> tuple:
    """The long tail first: the least loaded experts (share of the last window, else tokens
    since start), then the slowest p95 and the most misses among equals (a sort key, pure)."""
    share = row.get("share")
    return (share if share is not None else float("inf"), row["tokens"], -(row.get("p95_ms") or 0.0),
            -row.get("misses", 0), expert_key(row["expert"]))


def load_vs_baseline(row: dict) -> str:
    """'0.42x' (the last window's share over its moving baseline), '-' before a window."""
    share, baseline = row.get("share"), row.get("baseline")
    if share is None or baseline is None:
        return "-"
    return f"{share / baseline:.2f}x" if baseline > 0 else ("new" if share > 0 else "-")


def select_rows(rows: list[dict], layers: set[int] | None = None, group: str | None = None,
                top: int | None = None, tail: int | None = None) -> list[dict]:
    """The expert rows of these layers and this group (a name, or its number), the `top` most
    loaded first when given, or the `tail` least loaded first (`health_order`) (pure)."""
    if group is not None and group.isdigit():
        group = f"ExpertShard-{group}"
    out = [r for r in rows if (layers is None or expert_key(r["expert"])[0] in layers)
           and (group is None or group in r["groups"])]
    if top is not None:
        out = sorted(out, key=lambda r: (-r["tokens"], expert_key(r["expert"])))[:top]
    if tail is not None:
        out = sorted(out, key=health_order)[:tail]
    return out


def parse_layers(text: str) -> set[int]:
    """'3', '3-5', '3-5,9' -> the layer numbers; ValueError naming what is wrong."""
    layers: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (hi.isdigit() and int(hi) < int(lo)):
            raise ValueError(f"{part.strip()!r} is not a layer or a range of layers (like 3, 3-5 or 3-5,9)")
        layers.update(range(int(lo), int(hi or lo) + 1))
    return layers


def layer_summary(rows: list[dict]) -> list[dict]:
    """Per layer: experts, copies (replicas over groups), copies per tier, tokens and the most
    loaded expert, from expert rows (pure): what moectl experts shows when one row an expert is
    more than a person reads."""
    layers: dict[int, dict] = {}
    for r in rows:
        layer = expert_key(r["expert"])[0]
        s = layers.setdefault(layer, {"layer": layer, "experts": 0, "copies": 0, "tiers": {}, "tokens": 0,
                                      "hottest": None, "hottest_tokens": -1})
        s["experts"] += 1
        s["copies"] += r["replicas"]
        for tier, n in r["tiers"].items():
            s["tiers"][tier] = s["tiers"].get(tier, 0) + n
        s["tokens"] += r["tokens"]
        if r["tokens"] > s["hottest_tokens"]:
            s["hottest"], s["hottest_tokens"] = r["expert"], r["tokens"]
    return [layers[k] for k in sorted(layers)]


def summary_table(summary: list[dict], total: int) -> Table:
    """moectl experts' table of `layer_summary` rows; `total`: every expert's tokens."""
    table = Table(box=None, header_style="bold")
    for col in ("LAYER", "EXPERTS", "COPIES", "TIERS", "LOAD", "BUSIEST"):
        table.add_column(col, justify="left" if col in ("TIERS", "BUSIEST") else "right", no_wrap=True)
    for s in summary:
        tiers = " ".join(f"{t} {n}" for t, n in sorted(s["tiers"].items()))
        share = 100 * s["hottest_tokens"] / s["tokens"] if s["tokens"] else 0.0
        table.add_row(str(s["layer"]), str(s["experts"]), str(s["copies"]), tiers,
                      f"{s['tokens']} ({100 * s['tokens'] / total:.1f}%)",
                      f"{s['hottest']} ({share:.1f}% of the layer)" if s["tokens"] else "-")
    return table


def load_grid(report: dict) -> tuple[list[list[int]], list[int], int]:
    """tokens[row][expert] summed over replicas, a row for each layer that has routed experts
    (the layers, in order; the number of experts a layer) (pure)."""
    cells: dict[tuple[int, int], int] = {}
    for r in report.get("replicas") or []:
        for eid, v in (r.get("versions") or {}).items():
            layer, expert = expert_key(eid)
            cells[(layer, expert)] = cells.get((layer, expert), 0) + int(v.get("tokens", 0))
    layers = sorted({layer for layer, _ in cells})
    experts_ = max((e for _, e in cells), default=-1) + 1
    return [[cells.get((layer, e), 0) for e in range(experts_)] for layer in layers], layers, experts_


SHADES = ["grey23", "grey42", "dark_cyan", "cyan", "yellow", "orange1", "red1"]
CELL = 8  # "██ 12345": one expert's column with its count


def _shade(share: float, experts: int) -> str:
    """An expert's colour by its share of the layer's load: grey well under the even share
    (1 / experts), cyan about it, red at 2x and over."""
    return SHADES[min(len(SHADES) - 1, int(share * experts * (len(SHADES) - 1) / 2))]


def heatmap(grid: list[list[float]], title: str, layers: list[int] | None = None, width: int = 200) -> Table:
    """Rows = layers, columns = experts; a cell's shade is the expert's share of its layer's load.
    Wider than `width` characters (DeepSeek-V3: 256 experts), a column stands for a run of
    adjacent experts, shaded by the busiest of them, without counts; each row then names its
    busiest expert."""
    experts = len(grid[0]) if grid else 0
    layers = list(range(len(grid))) if layers is None else layers
    fit = max(1, (width - 30) // CELL)
    per = 1 if experts <= fit else -(-experts // max(1, width - 40))  # experts a column
    table = Table(title=title, box=None, header_style="bold", pad_edge=False,
                  caption=None if per == 1 else f"a column: {per} adjacent experts, shaded by the busiest")
    table.add_column("layer", justify="right")
    if per == 1:
        for e in range(experts):
            table.add_column(str(e), justify="right")
    else:
        table.add_column(f"experts 0-{experts - 1}", no_wrap=True)
        table.add_column("busiest", justify="right")
    table.add_column("imbalance", justify="right")
    for layer, row in zip(layers, grid):
        total = sum(row)
        mean = total / len(row) if row else 0
        peak = max(row) if row else 0
        shares = [v / total if total else 0.0 for v in row]
        if per == 1:
            cells = [f"[{_shade(sh, experts)}]{'█' * 2} {v:>5.0f}[/]" for v, sh in zip(row, shares)]
        else:
            strip = "".join(f"[{_shade(max(shares[k:k + per]), experts)}]█[/]" for k in range(0, experts, per))
            busiest = max(range(experts), key=lambda e: row[e]) if total else None
            cells = [strip, "-" if busiest is None else f"{layer}.{busiest} {100 * shares[busiest]:.1f}%"]
        table.add_row(str(layer), *cells, f"{peak / mean:.2f}" if mean else "-")
    return table
