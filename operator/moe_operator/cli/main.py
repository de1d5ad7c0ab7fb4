"""moectl: drive MoEDeployments (also installed as the kubectl plugin `kubectl moe`).

Exit codes: 0 success; 1 the operation failed (the reason is printed on one line); 2 bad usage.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(add_completion=True, no_args_is_help=True, help="Serve Mixture-of-Experts models on Ray Serve.")
err = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 4096)  # like kubectl: piped tables are never folded


def fail(message: str, code: int = 1) -> None:
    sys.stderr.write(f"error: {message}\n")  # one line, never wrapped
    raise typer.Exit(code)


@app.command("init-model")
def init_model(
    directory: Path = typer.Argument(..., help="Where to write the checkpoint (Hugging Face layout)."),
    family: str = typer.Option("mixtral", "--family", help="Model family (config.json model_type): mixtral, "
                               "qwen3_moe, qwen2_moe, olmoe, deepseek_v3, deepseek_v2 or gpt_oss."),
    layers: int = typer.Option(2, min=1, help="Decoder layers."),
    experts: int = typer.Option(8, min=1, help="Experts per layer."),
    top_k: int = typer.Option(2, "--top-k", min=1, help="Experts per token."),
    hidden: int = typer.Option(64, min=8, help="Hidden size."),
    intermediate: int = typer.Option(128, min=8, help="Expert intermediate size."),
    heads: int = typer.Option(4, min=1, help="Attention heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", min=1, help="Key/value heads (grouped-query attention)."),
    max_len: int = typer.Option(512, "--max-len", min=16, help="max_position_embeddings."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    seed: int = typer.Option(0, help="Random seed."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing checkpoint."),
):
    """Write a small random MoE checkpoint of a family (config.json, safetensors in the layout
    transformers writes, byte-level tokenizer.json, tokenizer_config.json with a simple chat template)."""
    import torch

    from moe_workers.model.family import SUPPORTED
    from moe_workers.model.random_init import write_random_checkpoint
    from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
    from moe_workers.serve.chat import write_tokenizer_config

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        fail(f"--dtype {dtype!r} is not one of {', '.join(dtypes)}", 2)
    if family not in SUPPORTED:
        fail(f"--family {family!r} is not one of {', '.join(SUPPORTED)}", 2)
    if top_k > experts:
        fail(f"--top-k {top_k} is larger than --experts {experts}", 2)
    if hidden % heads or heads % kv_heads:
        fail("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads", 2)
    if (directory / "config.json").exists() and not force:
        out.print(f"{directory} already holds a checkpoint (use --force to overwrite)")
        return
    with Progress(TextColumn("writing layers"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err) as progress:
        task = progress.add_task("layers", total=layers)
        write_random_checkpoint(directory, family, vocab_size=BYTE_VOCAB_SIZE, hidden_size=hidden,
                                intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                                num_kv_heads=kv_heads, num_experts=experts, top_k=top_k,
                                max_position_embeddings=max_len, dtype=dtypes[dtype], seed=seed, router_scale=10.0,
                                progress=lambda done, total: progress.update(task, completed=done))
    write_byte_tokenizer(directory)
    write_tokenizer_config(directory)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    out.print(f"wrote {directory} ({family}, {layers} layers x {experts} experts, top-{top_k}, {size / 2**20:.1f} MiB)")


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


def _kube_objects(kubeconfig: Optional[Path]):
    """CustomObjectsApi for the kubeconfig (or in-cluster config), like kubectl picks it."""
    import kubernetes
    import urllib3

    # a kubeconfig with insecure-skip-tls-verify is the user's explicit choice; kubectl stays quiet too
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config()
        else:
            kubernetes.config.load_kube_config(config_file=str(kubeconfig) if kubeconfig else None)
    except (kubernetes.config.ConfigException, OSError) as e:
        fail(f"cannot load kubeconfig: {e}")
    return kubernetes.client.CustomObjectsApi()


def _fetch_from_kubernetes(name: Optional[str], namespace: str, all_namespaces: bool,
                           kubeconfig: Optional[Path]) -> list[dict]:
    import kubernetes
    import urllib3

    from moe_operator.api import models

    api = _kube_objects(kubeconfig)
    args = (models.GROUP, models.VERSION)
    try:
        if name:
            return [api.get_namespaced_custom_object(*args, namespace, models.PLURAL, name, _request_timeout=30)]
        if all_namespaces:
            return api.list_cluster_custom_object(*args, models.PLURAL, _request_timeout=30)["items"]
        return api.list_namespaced_custom_object(*args, namespace, models.PLURAL, _request_timeout=30)["items"]
    except kubernetes.client.ApiException as e:
        if e.status == 404:
            fail(f"moedeployment {namespace}/{name} not found" if name else "the MoEDeployment CRD is not installed")
        fail(f"kubernetes API: {e.status} {e.reason}")
    except (urllib3.exceptions.HTTPError, OSError) as e:
        fail(f"cannot reach the Kubernetes API: {e.__class__.__name__}")
    return []


def _fetch_local(name: Optional[str], namespace: str, all_namespaces: bool) -> list[dict]:
    from moe_operator.standalone.runner import as_seen, default_state_dir, status_path

    if name:
        path = status_path(default_state_dir(), namespace, name)
        if not path.exists():
            fail(f"moedeployment {namespace}/{name} not found in standalone state ({path.parent})")
        return [as_seen(json.loads(path.read_text()))]
    pattern = "*/*.json" if all_namespaces else f"{namespace}/*.json"
    return [as_seen(json.loads(p.read_text())) for p in sorted(default_state_dir().glob(pattern))]


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
    docs = (_fetch_local(name, namespace, all_namespaces) if local
            else _fetch_from_kubernetes(name, namespace, all_namespaces, kubeconfig))
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
    for col in columns + (["IMBALANCE", "AUTOSCALING", "MESSAGE"] if output == "wide" else []):
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
                    else auto.get("phase", ""), ready.get("message", "")]
        table.add_row(*row)
    out.print(table)


def _with_override(spec: dict, expert: str, weights: Optional[str], sha256: Optional[str]) -> dict:
    """The spec's experts.overrides with `expert` set to these weights (or removed when None)."""
    overrides = [o for o in (spec.get("experts") or {}).get("overrides") or [] if o.get("expert") != expert]
    if weights is not None:
        entry = {"expert": expert, "weights": {"path": weights}}
        if sha256:
            entry["weights"]["sha256"] = sha256
        overrides.append(entry)
    return sorted(overrides, key=lambda o: tuple(int(p) for p in o["expert"].split(".")))


def _check_swap_args(expert: str, weights: Optional[str], sha256: Optional[str], rollback: bool) -> None:
    from pydantic import ValidationError

    from moe_operator.api.models import ExpertOverride

    if rollback == (weights is not None):
        fail("give either --weights PATH or --rollback", 2)
    try:
        ExpertOverride.model_validate({"expert": expert, "weights": {"path": weights or "/x.safetensors",
                                                                      "sha256": sha256}})
    except ValidationError as e:
        first = e.errors()[0]
        where = {"expert": "--expert", "weights.path": "--weights", "weights.sha256": "--sha256"}.get(
            ".".join(str(x) for x in first["loc"]), ".".join(str(x) for x in first["loc"]))
        fail(f"{where}: {first['msg']}", 2)


def _swap_record(doc: dict, expert: str) -> Optional[dict]:
    st = doc.get("status") or {}
    if st.get("observedGeneration") != doc["metadata"].get("generation"):
        return None  # the operator has not seen our change yet
    return next((r for r in st.get("lastSwaps") or [] if r.get("expert") == expert), None)


@app.command("hot-swap")
def hot_swap(
    name: str = typer.Argument(..., help="MoEDeployment name."),
    expert: str = typer.Option(..., "--expert", help="Expert id LAYER.EXPERT, for example 3.12."),
    weights: Optional[str] = typer.Option(None, "--weights", help="Absolute path of the .safetensors file with "
                                          "the expert's new tensors (on the Ray nodes; names by family: "
                                          "w1/w2/w3, gate_proj/up_proj/down_proj or gate_up_proj...)."),
    sha256: Optional[str] = typer.Option(None, "--sha256", help="Expected sha256 of the file."),
    rollback: bool = typer.Option(False, "--rollback", help="Remove the override: back to the checkpoint's weights."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the new version serves on every replica (or fails)."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait with --wait."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Standalone mode: edit the manifest `moectl up` runs."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the overrides that would be applied; change nothing."),
):
    """Replace one expert's weights without downtime (sets spec.experts.overrides)."""
    import time

    if local and weights and not weights.startswith("/"):
        weights = str(Path(weights).resolve())  # standalone: relative to where moectl runs
    _check_swap_args(expert, weights, sha256, rollback)
    if local:
        doc = _fetch_local(name, namespace, False)[0]
        manifest = Path(doc["metadata"].get("annotations", {}).get("serving.moe.io/manifest", ""))
        if not manifest.is_file():
            fail(f"the manifest of {namespace}/{name} ({manifest}) is gone; is `moectl up` still running?")
        raw = yaml.safe_load(manifest.read_text())
        new = _with_override(raw.get("spec") or {}, expert, weights, sha256)
        if dry_run:
            sys.stdout.write(yaml.safe_dump({"spec": {"experts": {"overrides": new}}}, sort_keys=False))
            return
        raw.setdefault("spec", {}).setdefault("experts", {})["overrides"] = new
        tmp = manifest.with_name(f".{manifest.name}.tmp")
        tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
        tmp.replace(manifest)
        generation = doc["metadata"].get("generation", 0)

        def read() -> tuple[Optional[dict], dict]:
            d = _fetch_local(name, namespace, False)[0]
            return (_swap_record(d, expert) if d["metadata"].get("generation", 0) > generation else None), d
    else:
        import kubernetes

        from moe_operator.api import models

        api = _kube_objects(kubeconfig)
        args = (models.GROUP, models.VERSION, namespace, models.PLURAL, name)
        import random

        attempts = 20  # each conflict means another writer landed: n concurrent writers need up to n tries
        for attempt in range(attempts):
            if attempt:
                time.sleep(random.uniform(0.02, 0.1) * min(attempt, 5))  # jitter, so retries do not collide again
            try:
                doc = api.get_namespaced_custom_object(*args, _request_timeout=30)
            except kubernetes.client.ApiException as e:
                fail(f"moedeployment {namespace}/{name} not found" if e.status == 404
                     else f"kubernetes API: {e.status} {e.reason}")
            new = _with_override(doc.get("spec") or {}, expert, weights, sha256)
            # resourceVersion makes the write conditional: a concurrent writer's change is never overwritten
            patch = {"metadata": {"resourceVersion": doc["metadata"]["resourceVersion"]},
                     "spec": {"experts": {"overrides": new}}}
            if dry_run:
                sys.stdout.write(yaml.safe_dump({"spec": patch["spec"]}, sort_keys=False))
                return
            try:
                doc = api.patch_namespaced_custom_object(*args, patch, _request_timeout=30)
                break
            except kubernetes.client.ApiException as e:
                if e.status == 409:
                    continue  # someone else wrote in between: re-read and apply our change to theirs
                body = json.loads(e.body or "{}") if (e.body or "").startswith("{") else {}
                fail(f"kubernetes API: {e.status} {body.get('message') or e.reason}")
        else:
            fail(f"moedeployment {namespace}/{name} kept changing; gave up after {attempts} attempts")
        generation = doc["metadata"]["generation"]

        def read() -> tuple[Optional[dict], dict]:
            d = api.get_namespaced_custom_object(*args, _request_timeout=30)
            return (_swap_record(d, expert) if d["metadata"]["generation"] >= generation else None), d

    action = "rollback of" if rollback else "hot-swap of"
    if not wait:
        out.print(f"{action} expert {expert} requested on {namespace}/{name}", soft_wrap=True)
        return
    done = ("RolledBack",) if rollback else ("Serving",)
    deadline = time.monotonic() + timeout
    from moe_operator.observe import fetch_app_status

    with err.status(f"{action} expert {expert}: waiting for the operator") as spinner:
        while time.monotonic() < deadline:
            rec, doc = read()
            url = ((doc.get("status") or {}).get("endpoint") or "").removesuffix("/v1")
            report = fetch_app_status(url, timeout_s=2) if url else None
            if report is not None:  # per replica, when the app is reachable from here
                lines = [f"  {who}: {state}" for who, state in replica_progress(report, expert, weights)]
                spinner.update("\n".join([f"{action} expert {expert}: {(rec or {}).get('outcome', 'requested')}"] + lines))
            if rec is not None:
                if rec.get("outcome") == "Failed":
                    fail(f"{action} expert {expert} failed: {rec.get('reason', 'no reason given')}")
                if rec.get("outcome") in done:
                    secs = rec.get("durationSeconds")
                    out.print(f"expert {expert} {'is back to the checkpoint' if rollback else 'serves ' + rec.get('digest', '')}"
                              f" on every replica" + (f" ({secs:.3f} s)" if secs is not None else ""), soft_wrap=True)
                    return
                if report is None:
                    spinner.update(f"{action} expert {expert}: {rec.get('outcome')} {rec.get('reason', '')}".strip())
            time.sleep(0.5)
    fail(f"{action} expert {expert} did not finish within {timeout:.0f} s")


@app.command()
def rebalance(
    name: str = typer.Argument(..., help="MoEDeployment name."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the operator has decided, and a rebalance it "
                              "started serves (make-before-break: loaded, switched, drained)."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait with --wait."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Standalone mode: ask the `moectl up` running this object."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the request that would be applied and what the "
                                 "autoscaler sees now; change nothing."),
):
    """Ask for a rebalance now (skips the stabilization window and cooldown, in any autoscaling mode;
    happens only when the planner finds a better placement)."""
    import time
    import uuid

    from moe_operator.autoscaling.loop import REBALANCE_ANNOTATION
    from moe_operator.standalone.runner import default_state_dir, rebalance_request_path

    request = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"
    patch = {"metadata": {"annotations": {REBALANCE_ANNOTATION: request}}}
    if local:
        read = lambda: _fetch_local(name, namespace, False)[0]  # noqa: E731
        doc = read()
    else:
        import kubernetes

        from moe_operator.api import models

        api = _kube_objects(kubeconfig)
        args = (models.GROUP, models.VERSION, namespace, models.PLURAL, name)

        def read() -> dict:
            try:
                return api.get_namespaced_custom_object(*args, _request_timeout=30)
            except kubernetes.client.ApiException as e:
                fail(f"moedeployment {namespace}/{name} not found" if e.status == 404
                     else f"kubernetes API: {e.status} {e.reason}")

        doc = read()
    auto = (doc.get("status") or {}).get("autoscaling") or {}
    if dry_run:
        sys.stdout.write(yaml.safe_dump(patch, sort_keys=False))
        err.print(f"imbalance now {(doc.get('status') or {}).get('imbalance', 'unknown')}; autoscaler: "
                  f"{auto.get('message') or 'no reading yet'}", markup=False, highlight=False)
        return
    if local:
        path = rebalance_request_path(default_state_dir(), namespace, name)
        path.write_text(request + "\n")
    else:
        try:
            api.patch_namespaced_custom_object(*args, patch, _request_timeout=30)
        except kubernetes.client.ApiException as e:
            fail(f"kubernetes API: {e.status} {e.reason}")
    if not wait:
        out.print(f"rebalance of {namespace}/{name} requested ({request})", soft_wrap=True)
        return
    deadline = time.monotonic() + timeout
    with err.status(f"rebalance of {namespace}/{name}: waiting for the operator to read load") as spinner:
        while time.monotonic() < deadline:
            auto = (read().get("status") or {}).get("autoscaling") or {}
            if auto.get("lastRequest") == request:
                if auto.get("target") is None and auto.get("lastDecision") == "Rebalance" and \
                        str(auto.get("reason", "")).startswith(f"requested ({request})"):
                    out.print(f"rebalanced {namespace}/{name}: imbalance {auto.get('imbalanceBefore', 0):.2f} -> "
                              f"expected {auto.get('imbalanceAfter', 0):.2f}, {auto.get('movedCopies', 0)} copies moved "
                              f"({auto.get('bytesMoved', 0) / 2**20:.1f} MiB)", soft_wrap=True)
                    return
                if auto.get("target") is None:
                    out.print(f"no rebalance: {auto.get('message', '')}", soft_wrap=True)
                    return
                spinner.update(f"rebalance of {namespace}/{name}: {auto.get('phase', 'Loading')}")
            time.sleep(0.5)
    fail(f"rebalance of {namespace}/{name} did not finish within {timeout:.0f} s")


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


def _base_url(name: str, namespace: str, kubeconfig: Optional[Path], local: bool, endpoint: Optional[str]) -> str:
    """The app's base URL: --endpoint, else the object's status.endpoint (without /v1)."""
    if endpoint:
        return endpoint.rstrip("/").removesuffix("/v1")
    doc = (_fetch_local(name, namespace, False) if local else _fetch_from_kubernetes(name, namespace, False, kubeconfig))[0]
    url = (doc.get("status") or {}).get("endpoint")
    if not url:
        fail(f"moedeployment {namespace}/{name} has no endpoint yet (not serving)")
    return url.removesuffix("/v1")


def _app_report(base: str) -> dict:
    from moe_operator.observe import fetch_app_status

    report = fetch_app_status(base, timeout_s=10)
    if report is None:
        fail(f"cannot read {base}/moe/v1/status (is the app serving, and reachable from here? see --endpoint)")
    return report


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
    for eid in sorted(rows, key=lambda e: tuple(int(p) for p in e.split("."))):
        row = rows[eid]
        digest = row["digests"].pop() if len(row["digests"]) == 1 else "mixed"
        out.append({"expert": eid, "groups": sorted(row["groups"]), "replicas": row["replicas"],
                    "tiers": dict(sorted(row["tiers"].items())), "version": digest,
                    "override": any(src != "checkpoint" for src in row["sources"]), "tokens": row["tokens"]})
    return out


@app.command()
def experts(
    name: str = typer.Argument(..., help="MoEDeployment name."),
    namespace: str = typer.Option("default", "-n", "--namespace"),
    output: str = typer.Option("", "-o", "--output", help="json, yaml or wide."),
    kubeconfig: Optional[Path] = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG"),
    local: bool = typer.Option(False, "--local", help="Standalone mode (moectl up)."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="The app's URL, when status.endpoint is not "
                                           "reachable from here (for example through kubectl port-forward)."),
):
    """Every expert: groups hosting it, replicas, tier residency, version, tokens served (live from the app)."""
    if output not in ("", "json", "yaml", "wide"):
        fail(f"-o {output!r}: expected json, yaml or wide", 2)
    rows = expert_rows(_app_report(_base_url(name, namespace, kubeconfig, local, endpoint)))
    if output == "json":
        out.print_json(json.dumps({"experts": rows}))
        return
    if output == "yaml":
        sys.stdout.write(yaml.safe_dump({"experts": rows}, sort_keys=False))
        return
    table = Table(box=None, header_style="bold")
    for col in ("EXPERT", "GROUPS", "REPLICAS", "TIER", "VERSION", "LOAD"):
        table.add_column(col, justify="right" if col in ("REPLICAS", "LOAD") else "left", no_wrap=True)
    total = sum(r["tokens"] for r in rows) or 1
    for r in rows:
        digest = r["version"].removeprefix("sha256:")
        version = (digest if output == "wide" else digest[:12]) + (" (override)" if r["override"] else "")
        tiers = " ".join(f"{t}x{n}" if n > 1 else t for t, n in r["tiers"].items())
        table.add_row(r["expert"], ",".join(g.removeprefix("ExpertShard-") for g in r["groups"]), str(r["replicas"]),
                      tiers, version, f"{r['tokens']} ({100 * r['tokens'] / total:.1f}%)")
    out.print(table)


def load_grid(report: dict) -> tuple[list[list[int]], int, int]:
    """tokens[layer][expert] summed over replicas (pure)."""
    cells: dict[tuple[int, int], int] = {}
    for r in report.get("replicas") or []:
        for eid, v in (r.get("versions") or {}).items():
            layer, expert = (int(p) for p in eid.split("."))
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

    base = _base_url(name, namespace, kubeconfig, local, endpoint)
    grid, _, _ = load_grid(_app_report(base))
    if once:
        out.print(heatmap(grid, f"{namespace}/{name}: tokens per expert so far"))
        return
    with Live(heatmap(grid, f"{namespace}/{name}: waiting for the first interval"), console=out,
              refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                now, _, _ = load_grid(_app_report(base))
                rate = [[(b - a) / interval for a, b in zip(ra, rb)] for ra, rb in zip(grid, now)] if grid else now
                live.update(heatmap(rate, f"{namespace}/{name}: tokens/s per expert (every {interval:g} s; Ctrl-C quits)"))
                grid = now
        except KeyboardInterrupt:
            pass


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
    base = _base_url(name, namespace, kubeconfig, local, endpoint)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = model_info(base, headers)
    except (requests.RequestException, ValueError, KeyError, IndexError) as e:
        fail(f"cannot reach {base}/v1/models: {e.__class__.__name__}")
    if prompt_len + max_tokens > models.get("max_model_len", 1 << 30):
        fail(f"--prompt-len + --max-tokens ({prompt_len + max_tokens}) exceeds the model's context "
             f"({models['max_model_len']})", 2)
    load = LoadGen(base, concurrency, prompt_len, max_tokens, int(models.get("vocab_size", 256)), seed, headers, hammer)
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
        for label, key in (("latency", "latency_s"), ("time to first token", "ttft_s"), ("inter-token latency", "itl_s")):
            rows.append((f"{label} p50 / p90 / p99", " / ".join(f"{summary[key][q] * 1e3:.0f} ms" for q in ("p50", "p90", "p99"))))
        for k, v in rows:
            table.add_row(k, v)
        out.print(table)
    if not summary["ok"]:
        fail(f"no request succeeded ({summary['requests']} sent; "
             f"{', '.join(summary['errors']) or ('all refused' if summary['refused'] else 'HTTP errors')})")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
