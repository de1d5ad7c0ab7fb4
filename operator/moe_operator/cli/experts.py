"""moectl experts and moectl top: an app's experts (placement, tiers, versions, load) and a live
heatmap of load per layer."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.table import Table

from .access import app_report, base_url
from .console import app, fail, out
from .views import (expert_rows, heatmap, layer_summary, load_grid, load_vs_baseline, parse_layers, select_rows,
                    summary_table)

MAX_TABLE_ROWS = 500  # past this many experts, unfiltered, the table is one row a layer


@app.command()
def experts(
    name: str = typer.Argument(..., help="MoEDeployment name."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    output: str = typer.Option("", "-o", "--output", help="json, yaml or wide."),
    layer: Optional[str] = typer.Option(None, "--layer", help="Only these layers: 3, 3-5 or 3-5,9."),
    group: Optional[str] = typer.Option(None, "--group", help="Only experts this shard group hosts "
                                        "(ExpertShard-2 or 2)."),
    top_n: Optional[int] = typer.Option(None, "--top", min=1, help="The N most loaded experts, busiest first."),
    tail: Optional[int] = typer.Option(None, "--tail", min=1, help="The long tail: the N least loaded experts "
                                       "(share of the last routing window), least first, with their p95 and misses."),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Standalone mode (moectl up)."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="The app's URL, when status.endpoint is not "
                                           "reachable from here (for example through kubectl port-forward)."),
):
    """Every expert: groups hosting it, replicas, tier residency, version, tokens served, and its health (live
    from the app): P95 (sampled compute, ms), MISSES (hot-tier misses), ERRORS (calls that raised), VS BASE (its
    share of the layer's tokens in the last routing window over its moving average). More than 500 experts with
    no --layer, --group, --top or --tail: one row a layer (-o json or yaml: every expert)."""
    if output not in ("", "json", "yaml", "wide"):
        fail(f"-o {output!r}: expected json, yaml or wide", 2)
    if top_n is not None and tail is not None:
        fail("--top and --tail: one or the other", 2)
    try:
        layers = parse_layers(layer) if layer is not None else None
    except ValueError as err:
        fail(f"--layer: {err}", 2)
    all_rows = expert_rows(app_report(base_url(name, namespace, kubeconfig, local, endpoint)))
    rows = select_rows(all_rows, layers, group, top_n, tail)
    if output == "json":
        out.print_json(json.dumps({"experts": rows}))
        return
    if output == "yaml":
        sys.stdout.write(yaml.safe_dump({"experts": rows}, sort_keys=False))
        return
    total = sum(r["tokens"] for r in all_rows) or 1
    if len(rows) > MAX_TABLE_ROWS and layers is None and group is None and top_n is None and tail is None:
        out.print(summary_table(layer_summary(rows), total))
        out.print(f"{len(rows)} experts in {len({r['expert'].split('.')[0] for r in rows})} layers: "
                  "--layer, --group or --top lists experts one a row")
        return
    table = Table(box=None, header_style="bold")
    for col in ("EXPERT", "GROUPS", "REPLICAS", "TIER", "VERSION", "LOAD", "VS BASE", "P95", "MISSES", "ERRORS"):
        table.add_column(col, justify="left" if col in ("EXPERT", "GROUPS", "TIER", "VERSION") else "right",
                         no_wrap=True)
    for r in rows:
        digest = r["version"].removeprefix("sha256:")
        version = (digest if output == "wide" else digest[:12]) + (" (override)" if r["override"] else "")
        tiers = " ".join(f"{t}x{n}" if n > 1 else t for t, n in r["tiers"].items())
        table.add_row(r["expert"], ",".join(g.removeprefix("ExpertShard-") for g in r["groups"]), str(r["replicas"]),
                      tiers, version, f"{r['tokens']} ({100 * r['tokens'] / total:.1f}%)", load_vs_baseline(r),
                      "-" if r["p95_ms"] is None else f"{r['p95_ms']:.3f} ms", str(r["misses"]), str(r["errors"]))
    out.print(table)


@app.command()
def top(
    name: str = typer.Argument(..., help="MoEDeployment name."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Standalone mode (moectl up)."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="The app's URL (see moectl experts)."),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between refreshes."),
    once: bool = typer.Option(False, "--once", help="Print one frame (tokens so far) and exit."),
):
    """A live heatmap of expert load per layer (tokens/s over the last interval), refreshed."""
    import time

    from rich.live import Live

    base = base_url(name, namespace, kubeconfig, local, endpoint)
    grid, layers, _ = load_grid(app_report(base))
    width = out.size.width
    if once:
        out.print(heatmap(grid, f"{namespace}/{name}: tokens per expert so far", layers, width))
        return
    with Live(heatmap(grid, f"{namespace}/{name}: waiting for the first interval", layers, width), console=out,
              refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                now, layers, _ = load_grid(app_report(base))
                rate = [[(b - a) / interval for a, b in zip(ra, rb)] for ra, rb in zip(grid, now)] if grid else now
                live.update(heatmap(rate, f"{namespace}/{name}: tokens/s per expert (every {interval:g} s; Ctrl-C quits)",
                                    layers, out.size.width))
                grid = now
        except KeyboardInterrupt:
            pass
