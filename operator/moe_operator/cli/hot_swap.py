"""moectl hot-swap: one expert's weights replaced (spec.experts.overrides), optionally waited for
replica by replica."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from moe_workers.expert_ids import expert_key

from .access import edit_spec
from .console import app, err, fail, out
from .views import replica_progress


def _with_override(spec: dict, expert: str, weights: Optional[str], sha256: Optional[str]) -> dict:
    """The spec's experts.overrides with `expert` set to these weights (or removed when None)."""
    overrides = [o for o in (spec.get("experts") or {}).get("overrides") or [] if o.get("expert") != expert]
    if weights is not None:
        entry = {"expert": expert, "weights": {"path": weights}}
        if sha256:
            entry["weights"]["sha256"] = sha256
        overrides.append(entry)
    return sorted(overrides, key=lambda o: expert_key(o["expert"]))


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
    edited = edit_spec(name, namespace, kubeconfig, local,
                       lambda spec: {"experts": {"overrides": _with_override(spec, expert, weights, sha256)}}, dry_run)
    if edited is None:
        return  # --dry-run: printed
    read_doc, seen = edited

    def read() -> tuple[Optional[dict], dict]:
        d = read_doc()
        return (_swap_record(d, expert) if seen(d) else None), d

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
