"""Standalone mode: the reconciler driven by a manifest file instead of the Kubernetes API.

`moectl up -f FILE` reads the MoEDeployment, validates it (schema + semantic checks), plans,
renders and applies the Serve app through the same Ray REST backend the operator uses, writes
status where `moectl get NAME --local` finds it, and re-reconciles when the file changes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from moe_operator.api import conditions as cond
from moe_operator.api.models import MoEDeploymentSpec
from moe_operator.api.semantics import validate_semantics
from moe_operator.api.validation import SpecError, parse_spec
from moe_operator.backends.ray_rest import RayServeClient, RayServeError
from moe_operator.planner.initial import initial_placement
from moe_operator.render.serve_app import merge_applications, render_application


def default_state_dir() -> Path:
    return Path(os.environ.get("MOE_STATE_DIR", Path.home() / ".cache" / "moe-operator" / "standalone"))


def status_path(state_dir: Path, namespace: str, name: str) -> Path:
    return state_dir / namespace / f"{name}.json"


@dataclass
class Manifest:
    name: str
    namespace: str
    spec: MoEDeploymentSpec | None
    problems: list[str]
    raw: dict


def load_manifest(path: Path) -> Manifest:
    """Parse a MoEDeployment file. Relative paths in spec.model.path and override weights resolve
    against the file's directory (standalone convenience; the CRD requires absolute paths)."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as err:
        return Manifest("", "default", None, [f"{path}: cannot read YAML: {err}"], {})
    docs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "MoEDeployment"]
    if len(docs) != 1:
        return Manifest("", "default", None, [f"{path}: expected exactly one MoEDeployment, found {len(docs)}"], {})
    doc = docs[0]
    meta = doc.get("metadata") or {}
    name, namespace = meta.get("name", ""), meta.get("namespace", "default")
    if not name:
        return Manifest("", namespace, None, ["metadata.name: required field is missing"], doc)
    spec_raw = json.loads(json.dumps(doc.get("spec") or {}))
    base = path.resolve().parent
    model = spec_raw.get("model") or {}
    if isinstance(model.get("path"), str) and not model["path"].startswith("/"):
        model["path"] = str((base / model["path"]).resolve())
    for o in (spec_raw.get("experts") or {}).get("overrides") or []:
        w = o.get("weights") or {}
        if isinstance(w.get("path"), str) and not w["path"].startswith("/"):
            w["path"] = str((base / w["path"]).resolve())
    try:
        return Manifest(name, namespace, parse_spec(spec_raw), [], doc)
    except SpecError as err:
        return Manifest(name, namespace, None, err.problems, doc)


@dataclass
class StandaloneRunner:
    manifest_path: Path
    client: RayServeClient
    http_port: int
    allowed_roots: list[str]
    state_dir: Path = field(default_factory=default_state_dir)
    log: Callable[[str], None] = print
    generation: int = 0
    placement: dict[str, list[str]] | None = None
    status: dict = field(default_factory=dict)
    _mtime: float = 0.0
    _app: str | None = None

    def _write_status(self, m: Manifest) -> None:
        path = status_path(self.state_dir, m.namespace, m.name or "unnamed")
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment",
               "metadata": {"name": m.name, "namespace": m.namespace, "generation": self.generation,
                            "annotations": {"serving.moe.io/manifest": str(self.manifest_path.resolve())}},
               "spec": m.spec.model_dump(by_alias=True, exclude_none=True) if m.spec else m.raw.get("spec"),
               "status": self.status}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.replace(path)

    def _set(self, type_: str, ok: bool | str, reason: str, message: str) -> None:
        self.status["conditions"] = cond.set_condition(self.status.get("conditions", []), type_, ok, reason, message,
                                                       self.generation)

    def reconcile(self) -> bool:
        """One pass over the current file; True when the app serves."""
        self.generation += 1
        m = load_manifest(self.manifest_path)
        self.status["observedGeneration"] = self.generation
        problems = list(m.problems)
        facts = None
        if m.spec is not None:
            facts, problems = validate_semantics(m.spec, self.allowed_roots)
        if problems:
            message = "; ".join(problems)
            self._set(cond.READY, False, cond.INVALID_SPEC, message)
            self._set(cond.PROGRESSING, False, cond.INVALID_SPEC, "fix the spec; the running app (if any) is left as it is")
            self._write_status(m)
            self.log(f"invalid spec: {message}")
            return False
        spec = m.spec
        self.placement = initial_placement(facts.num_layers, facts.num_experts, spec.experts.groups, self.placement)
        ours = render_application(m.namespace, m.name, spec, self.placement)
        self._set(cond.PROGRESSING, True, cond.DEPLOYING, f"deploying generation {self.generation}")
        ready = cond.get_condition(self.status.get("conditions", []), cond.READY)
        if not ready or ready["status"] != "True":  # an update keeps serving the previous generation
            self._set(cond.READY, False, cond.DEPLOYING, "waiting for the Serve application")
        self._write_status(m)
        try:
            current = self.client.get()
            apps = [a.get("deployed_app_config") for a in current.get("applications", {}).values()
                    if a.get("deployed_app_config")]
            config = {"http_options": {"host": "127.0.0.1", "port": self.http_port},
                      "applications": merge_applications(apps, ours)}
            self.client.put(config)
            self.client.wait_running([ours["name"]], timeout_s=600)
        except (RayServeError, ValueError, OSError) as err:
            self._set(cond.READY, False, cond.DEPLOY_FAILED, str(err))
            self._set(cond.PROGRESSING, False, cond.DEPLOY_FAILED, str(err))
            self._write_status(m)
            self.log(f"deploy failed: {err}")
            return False
        self._app = ours["name"]
        prefix = spec.ingress.route_prefix.rstrip("/")
        self.status["endpoint"] = f"http://127.0.0.1:{self.http_port}{prefix}/v1"
        self.status["groups"] = [{"name": g, "replicas": spec.experts.replicas_per_group,
                                  "readyReplicas": spec.experts.replicas_per_group, "experts": len(es)}
                                 for g, es in sorted(self.placement.items())]
        self.status["replicas"] = spec.experts.replicas_per_group
        self._set(cond.READY, True, cond.SERVING, f"serving at {self.status['endpoint']}")
        self._set(cond.PROGRESSING, False, cond.RECONCILED, f"generation {self.generation} applied")
        self._write_status(m)
        return True

    def changed(self) -> bool:
        try:
            mtime = self.manifest_path.stat().st_mtime
        except OSError:
            return False
        if mtime != self._mtime:
            self._mtime = mtime
            return True
        return False

    def watch(self, stop: Callable[[], bool], poll_s: float = 1.0) -> None:
        while not stop():
            if self.changed():
                self.log(f"{self.manifest_path} changed; reconciling")
                self.reconcile()
            time.sleep(poll_s)

    def teardown(self) -> None:
        """Remove our application, keep everyone else's."""
        if not self._app:
            return
        current = self.client.get()
        apps = [a.get("deployed_app_config") for n, a in current.get("applications", {}).items()
                if n != self._app and a.get("deployed_app_config")]
        if apps:
            self.client.put({"http_options": {"host": "127.0.0.1", "port": self.http_port}, "applications": apps})
        else:
            self.client.delete_all()

