"""moectl up: a MoEDeployment in the foreground without Kubernetes (standalone mode)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from .console import app, err, fail, out


@app.command()
def up(
    file: Path = typer.Option(..., "-f", "--filename", exists=True, dir_okay=False, help="MoEDeployment manifest."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", envvar="MOE_RAY_ADDRESS",
                                              help="Dashboard URL of an existing Ray cluster; default: the spec's "
                                              "ray.address, else a local Ray head started here."),
    ray_token_file: Optional[Path] = typer.Option(None, "--ray-token-file", help="File holding the Ray dashboard token."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="HTTP port of the Serve proxy (127.0.0.1)."),
    allowed_roots: list[Path] = typer.Option([], "--allowed-root",
                                             help="Directory models and weights may be read from (repeatable); "
                                             "default: the manifest's directory."),
    num_cpus: Optional[int] = typer.Option(None, "--num-cpus", min=1, help="Logical CPUs of the local Ray head."),
    once: bool = typer.Option(False, "--once", help="Reconcile once and exit (leaves a given cluster's app running)."),
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", exists=True, dir_okay=False,
                                                help="File with API keys, one per line: /v1/* then needs "
                                                "Authorization: Bearer <key> (re-read at every pass)."),
):
    """Run a MoEDeployment in the foreground without Kubernetes (standalone mode).

    SIGTERM or Ctrl-C stops it within seconds in every state (a second one at once); a local Ray
    head it started never outlives it, SIGKILL included."""
    from moe_operator.backends.ray_rest import RayServeClient
    from moe_operator.standalone.local_ray import LocalRayHead, end_leftover_heads, port_holder
    from moe_operator.standalone.runner import StandaloneRunner, default_state_dir, load_manifest, owner_tag

    manifest = load_manifest(file)
    for line in manifest.dropped:  # the apiserver prunes these silently; say so here
        err.print(f"warning: {file}: {line}, dropped as the Kubernetes apiserver would", markup=False)
    roots = [str(p.resolve()) for p in allowed_roots] or [str(file.resolve().parent)]
    roots += [r for r in os.environ.get("MOE_ALLOWED_ROOTS", "").split(":") if r]
    address = ray_address or (manifest.spec.ray.address if manifest.spec else None)
    head = None
    token = ray_token_file.read_text().strip() if ray_token_file else os.environ.get("MOE_RAY_TOKEN")
    stopping = threading.Event()
    heads: list = []  # the local head, once started (for a second signal to end it at once)

    def on_signal(signum, _frame):
        if stopping.is_set():  # the second one: no more cleanup
            for h in heads:
                if h.process is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(h.process.pid, signal.SIGKILL)
            os._exit(130)
        stopping.set()
        raise KeyboardInterrupt  # interrupts whatever the main thread waits for (Ray starting, a deploy)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if address is None:
            state_root = default_state_dir()
            end_leftover_heads(state_root, log=lambda m: err.print(m, markup=False))
            holder = port_holder(port)
            if holder is not None:
                fail(f"--port {port}: 127.0.0.1:{port} is already in use by {holder}; stop it or choose another "
                     "port (a second Serve proxy there would answer for the old app)")
            state = state_root / f"ray-{os.getpid()}"
            with err.status("starting a local Ray head on 127.0.0.1 ..."):
                head = LocalRayHead(work_dir=state, num_cpus=num_cpus, serve_http_port=port)
                heads.append(head)
                # a watchdog in its group ends it with this process (--once: it is meant to stay)
                head.start(parent_pid=None if once else os.getpid(), stopping=stopping.is_set)
            address, token = head.dashboard_url, head.token
            err.print(f"local Ray head: dashboard {address} (token in {head.token_path})")
        runner = StandaloneRunner(file, RayServeClient(address, token), port, roots, log=lambda m: err.print(m, markup=False),
                                  metrics_urls=[head.metrics_url] if head is not None else [],
                                  api_key_file=api_key_file)
        if not once:
            runner.owner = owner_tag()  # when this process is gone, so is the app
        runner.changed()
        with err.status(f"deploying {manifest.name or file} ..."):
            ok = runner.reconcile()
        if ok:
            out.print(f"{manifest.name} is serving at {runner.status['endpoint']}", highlight=False)
        elif once:
            fail(runner.status["conditions"][0]["message"] if runner.status.get("conditions") else "deploy failed")
        if once:
            return
        err.print(f"watching {file} for changes; Ctrl-C to stop")

        def head_gone() -> bool:
            return head is not None and head.process is not None and head.process.poll() is not None

        runner.watch(lambda: stopping.is_set() or head_gone())
        if head_gone() and not stopping.is_set():  # nothing left to serve from: say so, do not retry forever
            fail(f"the local Ray head exited (code {head.process.returncode}); its log: {head.work_dir / 'ray-head.log'}")
    except KeyboardInterrupt:
        pass
    finally:
        if not once and "runner" in locals():
            with contextlib.suppress(Exception):
                runner.mark_stopped()
        if head is None and stopping.is_set() and "runner" in locals():
            # an existing cluster: ask Ray to remove our app, without waiting for it to be gone
            with contextlib.suppress(Exception):
                runner.client.timeout_s = 3.0
                runner.teardown(wait_s=2.0)
            err.print("removal of the application requested", markup=False)
        if head is not None and (not once or stopping.is_set()):
            # our own head: the app goes with it, no need to remove it first
            with err.status("stopping the local Ray head ..."):
                head.stop(timeout_s=2.0)
        elif head is not None:
            err.print(f"the local Ray head keeps running (pid {head.process.pid}); stop it with kill -- -{head.process.pid}")
