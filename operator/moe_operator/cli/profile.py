"""moectl profile: where a step's time goes over a window, live from the app (two reads of
/moe/v1/status, `profile_view` draws the difference)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
import yaml

from .access import app_report, base_url
from .console import app, fail, out
from .profile_view import profile_diff, profile_tree

SAME_REPLICA_TRIES = 5  # reads after the window until one reaches the Ingress replica of the first


@app.command()
def profile(
    name: str = typer.Argument(..., help="MoEDeployment name."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    seconds: float = typer.Option(5.0, "--seconds", min=0.2, help="The window: seconds between the two reads."),
    output: str = typer.Option("", "-o", "--output", help="json or yaml."),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Standalone mode (moectl up)."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="The app's URL (see moectl experts)."),
):
    """A step's time by phase over the next --seconds (ms a step and share): attention, router,
    the expert exchange (plan, gather, wait, combine; under the wait each shard group's compute,
    promotion waits and slowest experts by sampled p95), logits, sampling. From timers the
    Ingress and shard replicas keep anyway; the app must be serving requests meanwhile."""
    if output not in ("", "json", "yaml"):
        fail(f"-o {output!r}: expected json or yaml", 2)
    base = base_url(name, namespace, kubeconfig, local, endpoint)
    before = app_report(base)
    time.sleep(seconds)
    for _ in range(SAME_REPLICA_TRIES):  # with several Ingress replicas a read may reach another one
        after = app_report(base)
        if (after.get("ingress") or {}).get("pid") == (before.get("ingress") or {}).get("pid"):
            break
    else:
        fail("the reads reached different Ingress replicas each time: profile one through --endpoint "
             "(a port-forward to one Ingress Pod)")
    try:
        diff = profile_diff(before, after, seconds)
    except ValueError as err:
        fail(str(err))
    if output == "json":
        out.print_json(json.dumps(diff))
    elif output == "yaml":
        sys.stdout.write(yaml.safe_dump(diff, sort_keys=False))
    else:
        out.print(profile_tree(diff, "step"))
