"""Standalone mode: the reconciler driven by a manifest file instead of the Kubernetes API.

`moectl up -f FILE` reads the MoEDeployment, validates it (schema + semantic checks), plans,
renders and applies the Serve app through the same Ray REST backend the operator uses, writes
status where `moectl get NAME --local` finds it, and re-reconciles when the file changes.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from moe_operator import containment
from moe_operator.api import conditions as cond
from moe_operator.api.models import API_VERSION, KIND, MoEDeploymentSpec
from moe_operator.api.pruning import prune, spec_schema, type_problems
from moe_operator.api.validation import SpecError, parse_spec
from moe_operator.autoscaling.driver import Autoscaler, decide
from moe_operator.backends.serve_backend import ServeBackend
from moe_operator.names import MANIFEST_ANNOTATION, OWNER_ANNOTATION, app_name
from moe_operator.reconcile import ObjectRef, deploying, observe_live, reconcile, remove_application
from moe_operator.settings import Settings
from moe_workers.process_tag import process_tag, tag_running
from moe_workers.serve.auth import digests


def default_state_dir() -> Path:
    return Path(os.environ.get("MOE_STATE_DIR", Path.home() / ".cache" / "moe-operator" / "standalone"))


def status_path(state_dir: Path, namespace: str, name: str) -> Path:
    return state_dir / namespace / f"{name}.json"




owner_tag = process_tag  # the `moectl up` that owns an app, named so that a reused pid does not pass for it
owner_running = tag_running


def as_seen(doc: dict, running: Callable[[str], bool] = owner_running) -> dict:
    """A status file as `moectl get --local` shows it (pure but for `running`): an app whose
    `moectl up` is gone (SIGKILL, a crash) is not served, whatever the file last said."""
    tag = ((doc.get("metadata") or {}).get("annotations") or {}).get(OWNER_ANNOTATION)
    status = doc.get("status") or {}
    conditions = status.get("conditions") or []
    if tag is None or running(tag) or any(c.get("reason") == cond.STOPPED for c in conditions):
        return doc
    status = {k: v for k, v in status.items() if k != "endpoint"}
    status["conditions"] = cond.set_condition(conditions, cond.READY, False, cond.STOPPED,
                                              f"moectl up (pid {tag.split(':')[0]}) is not running; nothing serves "
                                              "this app")
    return {**doc, "status": status}


def rebalance_request_path(state_dir: Path, namespace: str, name: str) -> Path:
    """`moectl rebalance NAME --local` writes its request here (the annotation's stand-in)."""
    return state_dir / namespace / f"{name}.rebalance"


@dataclass
class Manifest:
    name: str
    namespace: str
    spec: MoEDeploymentSpec | None
    problems: list[str]
    raw: dict
    raw_spec: dict | None = None
    dropped: list[str] = field(default_factory=list)  # what the apiserver would have pruned too


class _Loader(yaml.SafeLoader):
    """YAML as kubectl reads it: `1e+308` is a number (YAML 1.2 and go-yaml), not a string (PyYAML)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"), list("-+0123456789."))

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def load_manifest(path: Path) -> Manifest:
    """Parse a MoEDeployment file. Relative paths in spec.model.path and override weights resolve
    against the file's directory (standalone convenience; the CRD requires absolute paths); an
    empty one stays empty (refused, as the apiserver refuses it)."""
    try:
        docs = [d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d]
    except (OSError, yaml.YAMLError) as err:
        return Manifest("", "default", None, [f"{path}: cannot read YAML: {err}"], {})
    docs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "MoEDeployment"]
    if len(docs) != 1:
        return Manifest("", "default", None, [f"{path}: expected exactly one MoEDeployment, found {len(docs)}"], {})
    doc = docs[0]
    meta = doc.get("metadata") or {}
    if not isinstance(meta, dict):
        return Manifest("", "default", None, [f"metadata: must be of type object, got {type(meta).__name__}"], doc)
    name, namespace = meta.get("name", ""), meta.get("namespace", "default")
    if not name:
        return Manifest("", "default", None, ["metadata.name: required field is missing"], doc)
    for field_name, value in (("name", name), ("namespace", namespace)):
        if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
            return Manifest("", "default", None, [
                f"metadata.{field_name}: {value!r} is not a valid name: a lowercase RFC 1123 subdomain (lower case "
                "letters, digits, '-' and '.', starting and ending with a letter or digit, at most 253 characters), "
                "as the apiserver requires"], doc)
    spec_in = doc.get("spec")
    if spec_in is not None and not isinstance(spec_in, dict):
        return Manifest(name, namespace, None, [f"spec: must be of type object, got {type(spec_in).__name__}"], doc)
    spec_raw, dropped = prune(json.loads(json.dumps(spec_in or {})), spec_schema(), "spec")
    shape = type_problems(spec_raw, spec_schema(), "spec")  # before any field is read: every shape error named
    if shape:
        return Manifest(name, namespace, None, shape, doc)
    base = path.resolve().parent
    cold = ((spec_raw.get("experts") or {}).get("tiers") or {}).get("cold") or {}
    overrides = [o.get("weights") or {} for o in (spec_raw.get("experts") or {}).get("overrides") or []]
    for holder in [spec_raw.get("model") or {}, cold, *overrides]:
        _beside_manifest(holder, base)
    try:
        return Manifest(name, namespace, parse_spec(spec_raw), [], doc, spec_raw, dropped)
    except SpecError as err:
        return Manifest(name, namespace, None, err.problems, doc, spec_raw, dropped)


def _beside_manifest(holder: dict, base: Path) -> None:
    """A relative `path` of the manifest, made absolute beside it (moectl up's convenience; the
    apiserver takes absolute ones only). One that names no file (a NUL byte) is left as it is,
    for the spec's own check to name."""
    value = holder.get("path")
    if isinstance(value, str) and value and not value.startswith("/") and "\x00" not in value:
        holder["path"] = str((base / value).resolve())


@dataclass
class StandaloneRunner:
    manifest_path: Path
    client: ServeBackend
    http_port: int
    allowed_roots: list[str]
    state_dir: Path = field(default_factory=default_state_dir)
    log: Callable[[str], None] = print
    generation: int = 0
    status: dict = field(default_factory=dict)
    metrics_urls: list[str] = field(default_factory=list)  # the local Ray's metrics export
    api_key_file: Path | None = None  # API keys, one per line (moectl up --api-key-file)
    _mtime: float = 0.0
    _app: str | None = None
    _name: str = ""
    _replicas: int | None = None  # set by the autoscaler (standalone has no spec to write it into)
    _replicas_in_file: int | None = None
    autoscaler: Autoscaler = field(default_factory=Autoscaler)
    _retry_at: float | None = None  # a pass that failed for a passing reason (Ray busy) runs again then
    _deploying: float | None = None  # the last pass left Serve deploying: the next one in so many seconds
    owner: str | None = None  # owner_tag() of the `moectl up` whose exit ends serving (None: --once)
    _last_manifest: Manifest | None = None

    def _write_status(self, m: Manifest) -> None:
        self._last_manifest = m
        path = status_path(self.state_dir, m.namespace, m.name or "unnamed")
        path.parent.mkdir(parents=True, exist_ok=True)
        annotations = {MANIFEST_ANNOTATION: str(self.manifest_path.resolve())}
        if self.owner:
            annotations[OWNER_ANNOTATION] = self.owner
        doc = {"apiVersion": API_VERSION, "kind": KIND,
               "metadata": {"name": m.name, "namespace": m.namespace, "generation": self.generation,
                            "annotations": annotations},
               "spec": m.spec.model_dump(by_alias=True, exclude_none=True) if m.spec else m.raw.get("spec"),
               "status": self.status}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.replace(path)

    def _spec(self, m: Manifest) -> MoEDeploymentSpec | None:
        """The file's spec, with the replica count the autoscaler set (until the file changes it)."""
        if m.spec is None:
            return None
        in_file = m.spec.experts.replicas_per_group
        if self._replicas_in_file is not None and in_file != self._replicas_in_file:
            self._replicas = None  # someone set it by hand: theirs wins (as with kubectl scale)
        self._replicas_in_file = in_file
        if self._replicas is None:
            return m.spec
        return m.spec.model_copy(update={"experts": m.spec.experts.model_copy(
            update={"replicas_per_group": self._replicas})})

    def reconcile(self, new_generation: bool = True) -> bool:
        """Passes over the current file until one is not under way (a pass never waits for Ray: while
        Serve deploys what was applied, the next pass looks again after its short retry); True when
        the app serves."""
        ready = self._pass(new_generation)
        while self._deploying is not None:
            time.sleep(self._deploying)
            ready = self._pass(new_generation=False)
        return ready

    def _pass(self, new_generation: bool = True) -> bool:
        """One pass over the current file; True when the app serves."""
        self._deploying = None
        if new_generation:
            self.generation += 1
        m = load_manifest(self.manifest_path)
        if m.raw_spec is None:  # the file itself is unusable: nothing to reconcile
            message = "; ".join(m.problems)
            if not m.name and self._last_manifest is not None and self._last_manifest.name:
                # no usable name in the file: the object this `moectl up` serves gets the condition
                m = Manifest(self._last_manifest.name, self._last_manifest.namespace, None, m.problems, m.raw)
            self.status["conditions"] = cond.set_condition(self.status.get("conditions", []), cond.READY, False,
                                                           cond.INVALID_SPEC, message, self.generation)
            self.status["observedGeneration"] = self.generation
            self._write_status(m)
            self.log(f"invalid manifest: {message}")
            return False
        self._name = m.name
        keys = digests(self.api_key_file.read_text()) if self.api_key_file is not None else None
        if self.api_key_file is not None and not keys:
            self.log(f"warning: {self.api_key_file} holds no API key; the API stays open")
        was_deploying = deploying(self.status)
        settings = Settings(allowed_roots=tuple(self.allowed_roots), serve_http_port=self.http_port)
        res = reconcile(ObjectRef(m.namespace, m.name, self.generation), m.raw_spec, self.status, self.client,
                        settings, spec=self._spec(m), api_key_digests=keys)
        self.status = res.status
        self._write_status(m)
        for _, reason, message in res.events:
            self.log(f"{reason}: {message}")
        self._retry_at = None
        if deploying(res.status) and res.retry_after_s is not None:  # Serve is at it: the next pass looks again
            if not was_deploying:
                self.log(f"{cond.DEPLOYING}: {res.event[2] if not res.ready else 'a change rolls out'}")
            self._deploying = res.retry_after_s
        if res.ready:
            self._app = app_name(m.namespace, m.name)
        elif self._deploying is None:
            self.log(f"{res.event[1]}: {res.event[2]}")
            if res.retry_after_s is not None:  # as kopf does with TemporaryError
                self._retry_at = time.monotonic() + res.retry_after_s
                self.log(f"retrying in {res.retry_after_s:.0f} s")
        return res.ready

    def autoscale(self, now: float | None = None) -> None:
        """Drive a placement change in progress one step, else read load when due and decide."""
        m = load_manifest(self.manifest_path)
        spec = self._spec(m)
        if spec is None or not cond.is_true(self.status.get("conditions") or [], cond.READY):
            return
        if (self.status.get("autoscaling") or {}).get("target") is not None:
            self.reconcile(new_generation=False)
            return
        request_file = rebalance_request_path(self.state_dir, m.namespace, m.name)
        request = request_file.read_text().strip() if request_file.is_file() else None
        p = decide(self.autoscaler, f"{m.namespace}/{m.name}", spec, self.status, request,
                   lambda: {g: list(v) for g, v in self._placement().items()}, self.allowed_roots,
                   app_name(m.namespace, m.name), self.metrics_urls, now)
        if p is None:
            return
        self.status["autoscaling"] = p.autoscaling
        self.status.update(p.status)
        self._write_status(m)
        if p.event:
            self.log(f"{p.event[1]}: {p.event[2]}")
        if p.replicas_per_group is not None:
            self._replicas = p.replicas_per_group
            self.reconcile(new_generation=True)
        elif p.autoscaling.get("target") is not None:
            self.reconcile(new_generation=False)

    def _placement(self) -> dict[str, list[str]]:
        from moe_operator.reconcile import deployed_placement

        return deployed_placement(self.client.get(), self._app) or {} if self._app else {}

    def changed(self) -> bool:
        try:
            mtime = self.manifest_path.stat().st_mtime
        except OSError:
            return False
        if mtime != self._mtime:
            self._mtime = mtime
            return True
        return False

    def observe(self) -> None:
        """Between reconciles: live tiers, overridden experts and hot-swap outcomes."""
        m = load_manifest(self.manifest_path)
        if m.spec is None or not cond.is_true(self.status.get("conditions") or [], cond.READY):
            return
        fields, events = observe_live(m.spec, self.status)
        if any(self.status.get(k) != v for k, v in fields.items()):
            self.status.update(fields)
            self._write_status(m)
        for _, reason, message in events:
            self.log(f"{reason}: {message}")
        if containment.pending(m.raw_spec or {}, self.status):  # autoQuarantine to decide: the whole pass
            self.reconcile(new_generation=False)

    def watch(self, stop: Callable[[], bool], poll_s: float = 1.0, observe_every_s: float = 2.0) -> None:
        last_observe = 0.0
        while not stop():
            if self.changed():
                self.log(f"{self.manifest_path} changed; reconciling")
                self.reconcile()
            elif self._retry_at is not None and time.monotonic() >= self._retry_at:
                if self.reconcile(new_generation=False):
                    self.log(f"{self._name} is serving at {self.status['endpoint']}")
            elif time.monotonic() - last_observe >= observe_every_s:
                self.observe()
                try:
                    self.autoscale()
                except Exception as err:  # a failed pass is reported; the next one retries
                    self.log(f"autoscaler: {err}")
                last_observe = time.monotonic()
            time.sleep(poll_s)

    def mark_stopped(self) -> None:
        """The status file says the app is no longer served (moectl up is exiting)."""
        if self._last_manifest is None:
            return
        self.status.pop("endpoint", None)
        self.status["conditions"] = cond.set_condition(self.status.get("conditions", []), cond.READY, False,
                                                       cond.STOPPED, f"moectl up stopped at {cond.now_rfc3339()}",
                                                       self.generation)
        self._write_status(self._last_manifest)

    def teardown(self, wait_s: float = 120.0) -> None:
        """Remove our application, keep everyone else's (waiting at most `wait_s` for Ray to
        stop listing it)."""
        if self._app:
            remove_application(self.client, self._app, self.http_port, wait_s=wait_s)
