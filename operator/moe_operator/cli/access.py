"""Where moectl reads MoEDeployments and their apps: the Kubernetes API (the kubeconfig or the
in-cluster config, like kubectl), standalone mode's state files (`moectl up`), and an app's
/moe/v1/status. Failures end the command with one line naming what was not found or reached."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

from .console import fail


def kube_objects(kubeconfig: Optional[Path]):
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


@contextlib.contextmanager
def kube_call(namespace: str, name: Optional[str]) -> Iterator[None]:
    """Ends the command with one line when a Kubernetes API call inside fails: the object (or,
    for a list, the CRD) not found, another API error with the apiserver's message, or the API
    out of reach."""
    import kubernetes
    import urllib3

    try:
        yield
    except kubernetes.client.ApiException as e:
        if e.status == 404:
            fail(f"moedeployment {namespace}/{name} not found" if name else "the MoEDeployment CRD is not installed")
        try:
            message = json.loads(e.body).get("message") if (e.body or "").startswith("{") else None
        except ValueError:
            message = None
        fail(f"kubernetes API: {e.status} {message or e.reason}")
    except (urllib3.exceptions.HTTPError, OSError) as e:
        fail(f"cannot reach the Kubernetes API: {e.__class__.__name__}")


def object_args(namespace: str, name: str) -> tuple:
    """The CustomObjectsApi arguments that name one MoEDeployment."""
    from moe_operator.api import models

    return models.GROUP, models.VERSION, namespace, models.PLURAL, name


def read_object(api, namespace: str, name: str) -> dict:
    """One MoEDeployment as the apiserver has it (failing as `kube_call` does)."""
    with kube_call(namespace, name):
        return api.get_namespaced_custom_object(*object_args(namespace, name), _request_timeout=30)


def fetch_from_kubernetes(name: Optional[str], namespace: str, all_namespaces: bool,
                          kubeconfig: Optional[Path]) -> list[dict]:
    from moe_operator.api import models

    api = kube_objects(kubeconfig)
    if name:
        return [read_object(api, namespace, name)]
    with kube_call(namespace, None):
        if all_namespaces:
            return api.list_cluster_custom_object(models.GROUP, models.VERSION, models.PLURAL, _request_timeout=30)["items"]
        return api.list_namespaced_custom_object(models.GROUP, models.VERSION, namespace, models.PLURAL,
                                                 _request_timeout=30)["items"]


def fetch_local(name: Optional[str], namespace: str, all_namespaces: bool) -> list[dict]:
    from moe_operator.standalone.runner import as_seen, default_state_dir, status_path

    if name:
        path = status_path(default_state_dir(), namespace, name)
        if not path.exists():
            fail(f"moedeployment {namespace}/{name} not found in standalone state ({path.parent})")
        return [as_seen(json.loads(path.read_text()))]
    pattern = "*/*.json" if all_namespaces else f"{namespace}/*.json"
    return [as_seen(json.loads(p.read_text())) for p in sorted(default_state_dir().glob(pattern))]


def base_url(name: str, namespace: str, kubeconfig: Optional[Path], local: bool, endpoint: Optional[str]) -> str:
    """The app's base URL: --endpoint, else the object's status.endpoint (without /v1)."""
    if endpoint:
        return endpoint.rstrip("/").removesuffix("/v1")
    doc = (fetch_local(name, namespace, False) if local else fetch_from_kubernetes(name, namespace, False, kubeconfig))[0]
    url = (doc.get("status") or {}).get("endpoint")
    if not url:
        fail(f"moedeployment {namespace}/{name} has no endpoint yet (not serving)")
    return url.removesuffix("/v1")


def app_report(base: str) -> dict:
    from moe_operator.observe import fetch_app_status

    report = fetch_app_status(base, timeout_s=10)
    if report is None:
        fail(f"cannot read {base}/moe/v1/status (is the app serving, and reachable from here? see --endpoint)")
    return report


def _set_in(spec: dict, change: dict) -> None:
    """`change` (a spec fragment: {"experts": {"overrides": [...]}}) written into `spec`; a list or
    a value replaces what was there, as a JSON merge patch does."""
    for k, v in change.items():
        if isinstance(v, dict) and isinstance(spec.get(k), dict):
            _set_in(spec[k], v)
        else:
            spec[k] = v


def edit_spec(name: str, namespace: str, kubeconfig: Optional[Path], local: bool,
              change: Callable[[dict], dict], dry_run: bool = False
              ) -> Optional[tuple[Callable[[], dict], Callable[[dict], bool]]]:
    """Apply `change` (the spec as it is -> the spec fragment to write) to one MoEDeployment: in
    standalone mode to the manifest `moectl up` runs (replaced atomically), else as a merge patch
    conditional on resourceVersion, re-read and retried when another writer landed in between.
    Returns (read: the object now, seen: whether a read object has our change), or None with
    `dry_run` (the fragment printed, nothing changed)."""
    import random
    import sys
    import time

    import yaml

    from moe_operator.names import MANIFEST_ANNOTATION

    if local:
        doc = fetch_local(name, namespace, False)[0]
        manifest = Path(doc["metadata"].get("annotations", {}).get(MANIFEST_ANNOTATION, ""))
        if not manifest.is_file():
            fail(f"the manifest of {namespace}/{name} ({manifest}) is gone; is `moectl up` still running?")
        raw = yaml.safe_load(manifest.read_text())
        fragment = change(raw.get("spec") or {})
        if dry_run:
            sys.stdout.write(yaml.safe_dump({"spec": fragment}, sort_keys=False))
            return None
        _set_in(raw.setdefault("spec", {}), fragment)
        tmp = manifest.with_name(f".{manifest.name}.tmp")
        tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
        tmp.replace(manifest)
        before = doc["metadata"].get("generation", 0)
        return (lambda: fetch_local(name, namespace, False)[0],
                lambda d: d["metadata"].get("generation", 0) > before)
    import kubernetes

    api = kube_objects(kubeconfig)
    attempts = 20  # each conflict means another writer landed: n concurrent writers need up to n tries
    for attempt in range(attempts):
        if attempt:
            time.sleep(random.uniform(0.02, 0.1) * min(attempt, 5))  # jitter, so retries do not collide again
        doc = read_object(api, namespace, name)
        fragment = change(doc.get("spec") or {})
        if dry_run:
            sys.stdout.write(yaml.safe_dump({"spec": fragment}, sort_keys=False))
            return None
        # resourceVersion makes the write conditional: a concurrent writer's change is never overwritten
        patch = {"metadata": {"resourceVersion": doc["metadata"]["resourceVersion"]}, "spec": fragment}
        with kube_call(namespace, name):
            try:
                doc = api.patch_namespaced_custom_object(*object_args(namespace, name), patch, _request_timeout=30)
                break
            except kubernetes.client.ApiException as e:
                if e.status != 409:
                    raise
                # 409: someone else wrote in between: re-read and apply our change to theirs
    else:
        fail(f"moedeployment {namespace}/{name} kept changing; gave up after {attempts} attempts")
    after = doc["metadata"]["generation"]
    return lambda: read_object(api, namespace, name), lambda d: d["metadata"]["generation"] >= after
