"""Where moectl reads MoEDeployments and their apps: the Kubernetes API (the kubeconfig or the
in-cluster config, like kubectl), standalone mode's state files (`moectl up`), and an app's
/moe/v1/status. Failures end the command with one line naming what was not found or reached."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

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
