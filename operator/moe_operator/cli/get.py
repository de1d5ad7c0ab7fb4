"""moectl get: MoEDeployments and their status, as a table, JSON or YAML."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.table import Table

from .access import fetch_from_kubernetes, fetch_local
from .console import app, err, fail, out


@app.command()
def get(
    name: Optional[str] = typer.Argument(None, help="MoEDeployment name; all when omitted."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    all_namespaces: bool = typer.Option(False, "-A", "--all-namespaces"),
    output: str = typer.Option("", "-o", "--output", help="json, yaml or wide."),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Read standalone mode's status (moectl up) instead of Kubernetes."),
):
    """Show MoEDeployments and their status (from Kubernetes, or standalone mode with --local)."""
    if output not in ("", "json", "yaml", "wide"):
        fail(f"-o {output!r}: expected json, yaml or wide", 2)
    if name and all_namespaces:
        fail("a NAME cannot be combined with -A", 2)
    docs = (fetch_local(name, namespace, all_namespaces) if local
            else fetch_from_kubernetes(name, namespace, all_namespaces, kubeconfig))
    if output == "json":
        out.print_json(json.dumps(docs[0] if name else {"items": docs}))
        return
    if output == "yaml":
        sys.stdout.write(yaml.safe_dump(docs[0] if name else {"items": docs}, sort_keys=False))
        return
    if not docs:
        err.print(f"No MoEDeployments found{'' if all_namespaces else f' in {namespace}'}.")
        return
    table = Table(box=None, header_style="bold")
    columns = (["NAMESPACE"] if all_namespaces else []) + ["NAME", "READY", "REASON", "GROUPS", "REPLICAS", "ENDPOINT"]
    for col in columns + (["IMBALANCE", "AUTOSCALING", "KV BLOCKS", "PREFIX HITS", "PREEMPTED", "MESSAGE"]
                          if output == "wide" else []):
        table.add_column(col, overflow="fold")
    for d in docs:
        st = d.get("status") or {}
        ready = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
        row = ([d["metadata"].get("namespace", "")] if all_namespaces else []) + [
            d["metadata"]["name"], ready.get("status", "Unknown"), ready.get("reason", ""),
            str((d.get("spec") or {}).get("experts", {}).get("groups", "")), str(st.get("replicas", "")),
            st.get("endpoint", "") or ""]
        if output == "wide":
            auto = st.get("autoscaling") or {}
            imb = st.get("imbalance")
            worst = st.get("worstLayer") or {}
            row += ["" if imb is None else f"{imb:.2f}" + (f" (worst L{worst['layer']} {worst['imbalance']:.2f})"
                                                           if worst else ""),
                    f"{auto.get('phase', 'Steady')} (last: {auto['lastDecision']})" if auto.get("lastDecision")
                    else auto.get("phase", ""), *kv_columns(st.get("kvCache")), ready.get("message", "")]
        table.add_row(*row)
    out.print(table)


def kv_columns(kv: dict | None) -> list[str]:
    """KV BLOCKS (used/total, of N tokens), PREFIX HITS (share of prompt tokens), PREEMPTED."""
    if not kv:
        return ["", "", ""]
    hits = kv.get("prefixHitRate")
    return [f"{kv['blocksUsed']}/{kv['blocksTotal']} x{kv['blockSize']}", "" if hits is None else f"{hits:.0%}",
            str(kv.get("preemptions", 0))]
