"""What an object's pass talks to, chosen from its spec: the Kubernetes API clients beside kopf's
own (status, Secrets, RayServices), the API keys and Ray token read from Secrets, and the `Backend`
the pass runs over (its RayService, or its Ray cluster's Serve REST API). Not pure: reads Secrets
and files; the clients themselves live in kopf's operator memo, built once at start."""

from __future__ import annotations

import os
import threading

import kopf

from moe_operator.api import conditions as cond
from moe_operator.api import models
from moe_operator.backends.kuberay import KubeRayClient
from moe_operator.backends.kuberay_backend import KubeRayBackend
from moe_operator.backends.serve_backend import Backend, ServeBackend
from moe_operator.reconcile import rest_backend
from moe_operator.settings import RENDER_ONLY, Settings
from moe_workers.serve.auth import digests


class KubeApis:
    """The Kubernetes API clients the handlers use beside kopf's own (status, Secrets, RayServices):
    the configuration loaded and each client built once, at the operator's start (`load`: every
    loop writes status; importing `kubernetes` alone is ~0.4 CPU s), or on first use if that failed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._core = self._kuberay = self._custom = None

    def load(self) -> None:
        """Load the configuration and build the clients now (the operator's start), not on first use."""
        with self._lock:
            if self._custom is None:
                self._load()

    def _load(self) -> None:
        import kubernetes

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:  # outside a cluster: $KUBECONFIG as it is now
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        self._core = kubernetes.client.CoreV1Api()
        self._custom = kubernetes.client.CustomObjectsApi()
        self._kuberay = KubeRayClient(self._custom)

    @property
    def core(self):
        with self._lock:
            if self._core is None:
                self._load()
            return self._core

    @property
    def kuberay(self) -> KubeRayClient:
        with self._lock:
            if self._kuberay is None:
                self._load()
            return self._kuberay

    def patch_status(self, namespace: str, name: str, change: dict) -> None:
        """Merge-patch a MoEDeployment's status subresource."""
        self.load()
        self._custom.patch_namespaced_custom_object_status(
            models.GROUP, models.VERSION, namespace, models.PLURAL, name, {"status": change}, _request_timeout=30)


class Unconfigured(Exception):
    """What the pass needs from outside the spec is missing or unreadable (a Secret, the Ray
    address): the object shows Ready=False with `reason` and the message, never an exception out
    of a handler."""

    def __init__(self, reason: str, message: str, retry_s: float | None = 10):
        super().__init__(message)
        self.reason, self.retry_s = reason, retry_s


def kuberay_mode(spec: dict) -> bool:
    return (spec.get("ray") or {}).get("mode") == "KubeRay"


def _secret_value(ref: dict, namespace: str, field: str, kube: KubeApis) -> str:
    import base64

    import kubernetes

    where = f"{field}: Secret {namespace}/{ref['name']}"
    try:
        secret = kube.core.read_namespaced_secret(ref["name"], namespace, _request_timeout=30)
    except kubernetes.client.ApiException as err:
        why = {404: "not found", 403: "not readable by the operator (Helm value readTokenSecrets)"}
        raise Unconfigured(cond.SECRET_UNAVAILABLE, f"{where} {why.get(err.status, f'unreadable: {err.status} {err.reason}')}")
    except (OSError, kubernetes.client.exceptions.OpenApiException) as err:
        raise Unconfigured(cond.SECRET_UNAVAILABLE, f"{where} unreadable: {err}")
    key = ref.get("key", "token")
    value = (secret.data or {}).get(key)
    if value is None:
        raise Unconfigured(cond.SECRET_UNAVAILABLE, f"{where} has no key {key}")
    return base64.b64decode(value).decode()


def api_key_digests(spec: dict, namespace: str, kube: KubeApis) -> list[str] | None:
    """The digests of the API keys in force (spec.ingress.apiKeySecretRef), None without one."""
    ref = ((spec.get("ingress") or {}).get("apiKeySecretRef")) or None
    if not ref:
        return None
    keys = digests(_secret_value(ref, namespace, "spec.ingress.apiKeySecretRef", kube))
    if not keys:
        raise Unconfigured(cond.SECRET_UNAVAILABLE, f"spec.ingress.apiKeySecretRef: Secret {namespace}/{ref['name']} "
                           "holds no key")
    return keys


def _token(spec: dict, namespace: str, memo: kopf.Memo) -> str | None:
    settings: Settings = memo.settings
    ref = ((spec.get("ray") or {}).get("authTokenSecretRef")) or None
    if ref:
        return _secret_value(ref, namespace, "spec.ray.authTokenSecretRef", memo.kube).strip()
    if settings.ray_token_file:  # read each pass: a mounted Secret changes in place
        try:
            return open(settings.ray_token_file).read().strip()
        except OSError as err:
            raise Unconfigured(cond.SECRET_UNAVAILABLE, f"MOE_RAY_TOKEN_FILE {settings.ray_token_file}: {err}")
    return settings.ray_token or None


def serve_client(spec: dict, namespace: str, memo: kopf.Memo) -> ServeBackend:
    """A client of the Ray cluster the spec names (or the operator's), or the render-only one."""
    settings: Settings = memo.settings
    if settings.ray_backend == RENDER_ONLY:
        return memo.render_only
    address = (spec.get("ray") or {}).get("address") or settings.ray_address
    if not address:
        raise Unconfigured(cond.RAY_NOT_CONFIGURED, "no Ray address: set spec.ray.address, or the operator's "
                           "MOE_RAY_ADDRESS (Helm value ray.address)", retry_s=None)
    return memo.ray_clients.get(address, _token(spec, namespace, memo))


def _served_client(spec: dict, namespace: str, status: dict, memo: kopf.Memo) -> ServeBackend:
    """A client of the cluster the application was deployed to (status.rayAddress), which a spec
    edited since may no longer name (the pass refuses to move it)."""
    address = status.get("rayAddress")
    if not address or memo.settings.ray_backend == RENDER_ONLY:
        return serve_client(spec, namespace, memo)
    return memo.ray_clients.get(address, _token(spec, namespace, memo))


def backend_for(spec: dict, namespace: str, memo: kopf.Memo, status: dict | None = None) -> Backend:
    """The backend this object's pass runs over: its RayService (ray.mode KubeRay), else its Ray
    cluster's Serve REST API with the API keys in force. `status`: for a deletion, the cluster the
    application was deployed to (a KubeRay object's RayService), whatever the spec names now."""
    served = status or {}
    if served.get("rayService") or (kuberay_mode(spec) and not served.get("rayAddress")):
        return KubeRayBackend(memo.kube.kuberay)
    if status is not None:
        return rest_backend(_served_client(spec, namespace, served, memo), memo.settings)
    return rest_backend(serve_client(spec, namespace, memo), memo.settings,
                        api_key_digests=api_key_digests(spec, namespace, memo.kube))
