"""moectl bench: a load generator of concurrent streaming clients against an app."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .access import base_url
from .console import app, err, fail, out


@app.command()
def bench(
    name: Optional[str] = typer.Argument(None, help="MoEDeployment name (its status.endpoint), or use --endpoint."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Standalone mode (moectl up)."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="The app's URL."),
    concurrency: int = typer.Option(8, "--concurrency", "-c", min=1, max=1024, help="Clients sending at once."),
    duration: float = typer.Option(30.0, "--duration", min=0.5, help="Seconds to send requests."),
    prompt_len: int = typer.Option(32, "--prompt-len", min=1, help="Prompt length in tokens (random ids)."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="Completion length."),
    seed: int = typer.Option(0, "--seed"),
    hammer: bool = typer.Option(False, "--hammer", help="Resend a refused request at once instead of "
                                "waiting for its Retry-After (the worst case for a server under overload)."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="A JSON schema file: every "
                                               "completion asks for JSON that fits it (sampled); counts those "
                                               "that parse."),
    tools: Optional[Path] = typer.Option(None, "--tools", help="A JSON file of OpenAI tools: chat requests "
                                         "that must call one (tool_choice required); counts the calls."),
    output: str = typer.Option("", "-o", "--output", help="json for machine-readable results."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MOE_API_KEY",
                                          help="Sent as Authorization: Bearer (when the app has API keys)."),
):
    """Load generator: concurrent streaming clients for a duration; goodput, request latency,
    time to first token and inter-token latency percentiles. Refused requests (503/429) are
    counted apart from failures, and a client waits for their Retry-After unless --hammer."""
    import requests

    from moe_operator.loadgen import LoadGen, model_info, summarize

    if not name and not endpoint:
        fail("give a MoEDeployment NAME or --endpoint URL", 2)
    if output not in ("", "json"):
        fail(f"-o {output!r}: expected json", 2)
    base = base_url(name, namespace, kubeconfig, local, endpoint)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = model_info(base, headers)
    except (requests.RequestException, ValueError, KeyError, IndexError) as e:
        fail(f"cannot reach {base}/v1/models: {e.__class__.__name__}")
    if prompt_len + max_tokens > models.get("max_model_len", 1 << 30):
        fail(f"--prompt-len + --max-tokens ({prompt_len + max_tokens}) exceeds the model's context "
             f"({models['max_model_len']})", 2)
    workload = {}
    for flag, path in (("--json-schema", json_schema), ("--tools", tools)):
        if path is not None:
            try:
                workload[flag] = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                fail(f"{flag} {path}: {e}", 2)
    if "--tools" in workload and not isinstance(workload["--tools"], list):
        fail(f"--tools {tools}: expected a JSON list of tools", 2)
    load = LoadGen(base, concurrency, prompt_len, max_tokens, int(models.get("vocab_size", 256)), seed, headers, hammer,
                   json_schema=workload.get("--json-schema"), tools=workload.get("--tools"))
    with Progress(TextColumn("load"), BarColumn(), TextColumn("{task.fields[done]} requests"),
                  TimeElapsedColumn(), console=err, transient=output == "json") as progress:
        task = progress.add_task("load", total=duration, done=0)
        wall = load.run(duration, lambda t, n: progress.update(task, completed=min(duration, t), done=n))
    summary = {**summarize(load.records, wall), "concurrency": concurrency, "prompt_len": prompt_len,
               "max_tokens": max_tokens, "hammer": hammer}
    summary["requests_per_s"] = summary["goodput_rps"]
    if output == "json":
        out.print_json(json.dumps(summary))
    else:
        table = Table(box=None, show_header=False)
        rows = [("requests", f"{summary['requests']}: {summary['ok']} answered, {summary['refused']} refused "
                             f"(503/429), {summary['failed']} failed"),
                ("goodput", f"{summary['goodput_rps']} req/s, {summary['tokens_per_s']} tokens/s")]
        if "structured_ok" in summary:
            what = "called a tool" if tools else "parsed as JSON"
            rows.append((what, f"{summary['structured_ok']} of {summary['ok']} answered"))
        for label, key in (("latency", "latency_s"), ("time to first token", "ttft_s"), ("inter-token latency", "itl_s")):
            rows.append((f"{label} p50 / p90 / p99", " / ".join(f"{summary[key][q] * 1e3:.0f} ms" for q in ("p50", "p90", "p99"))))
        for k, v in rows:
            table.add_row(k, v)
        out.print(table)
    if not summary["ok"]:
        fail(f"no request succeeded ({summary['requests']} sent; "
             f"{', '.join(summary['errors']) or ('all refused' if summary['refused'] else 'HTTP errors')})")
