"""KubeRay backend: the MoEDeployment owns a RayService (ray.io/v1) whose serveConfigV2 is the
rendered application; KubeRay runs the Ray cluster and deploys the app. This module only reads
and writes the RayService object through the Kubernetes API."""

from __future__ import annotations

from dataclasses import dataclass

import kubernetes

from moe_operator.names import RENDERED_SPEC_ANNOTATION

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayservices"


def contains(live, ours) -> bool:
    """Whether `live` holds everything `ours` sets: maps may have more keys (defaults the CRD
    fills in, such as a port's protocol or a worker group's numOfHosts), lists match item by item."""
    if isinstance(ours, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in ours.items())
    if isinstance(ours, list):
        return isinstance(live, list) and len(live) == len(ours) and all(map(contains, live, ours))
    return live == ours


def needs_write(current: dict, desired: dict) -> str | None:
    """Why the live RayService must be written again, or None when it already is what we render:
    the digest of the spec we last wrote differs from this pass's, or the live object lost something
    we set (someone edited it), or our labels or owner reference are not there."""
    meta, want = current.get("metadata") or {}, desired["metadata"]
    if (meta.get("annotations") or {}).get(RENDERED_SPEC_ANNOTATION) != want["annotations"][RENDERED_SPEC_ANNOTATION]:
        return "the rendered spec changed"
    if not contains(current.get("spec"), desired["spec"]):
        return "the live spec differs from what was written"
    if not contains(meta.get("labels") or {}, want["labels"]) or meta.get("ownerReferences") != want["ownerReferences"]:
        return "labels or owner reference differ"
    return None


class KubeRayError(RuntimeError):
    pass


def _resource_missing(body: str) -> bool:
    """Whether a 404 says the resource type is not served (no such CRD), not that an object is
    missing: the apiserver answers an unknown path with plain text ("404 page not found"; older
    releases "the server could not find the requested resource"), an absent object with a Status
    naming it."""
    return "page not found" in body or "the server could not find the requested resource" in body


@dataclass
class KubeRayClient:
    api: kubernetes.client.CustomObjectsApi

    def get(self, namespace: str, name: str) -> dict | None:
        try:
            return self.api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, _request_timeout=30)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise KubeRayError(f"reading RayService {namespace}/{name}: {e.status} {e.reason}") from None

    writes: int = 0  # creates and replaces made (bench/control_plane.py counts them per pass)

    def apply(self, obj: dict) -> dict:
        """Create the RayService, or replace its spec when `needs_write` says so; a steady state
        writes nothing. What others keep in the metadata (KubeRay's finalizer, their labels and
        annotations) is kept."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        current = self.get(ns, name)
        try:
            if current is None:
                self._check_kept(self.api.create_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, obj, dry_run="All", _request_timeout=30), obj)
                self.writes += 1
                return self.api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, obj, _request_timeout=30)
            meta = current["metadata"]
            if not any(r.get("uid") == obj["metadata"]["ownerReferences"][0]["uid"]
                       for r in meta.get("ownerReferences") or []):
                raise KubeRayError(f"RayService {ns}/{name} exists and is not owned by this MoEDeployment; "
                                   "rename one of them")
            if needs_write(current, obj) is None:
                return current
            body = {**obj, "metadata": {
                **meta, "labels": {**(meta.get("labels") or {}), **obj["metadata"]["labels"]},
                "annotations": {**(meta.get("annotations") or {}), **obj["metadata"]["annotations"]},
                "ownerReferences": obj["metadata"]["ownerReferences"]}}
            self._check_kept(self.api.replace_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, name, body, dry_run="All", _request_timeout=30), obj)
            self.writes += 1
            return self.api.replace_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, body,
                                                             _request_timeout=30)
        except kubernetes.client.ApiException as e:
            if e.status == 404 and _resource_missing(e.body or ""):
                raise KubeRayError("the RayService CRD (ray.io/v1) is not installed: install KubeRay") from None
            raise KubeRayError(f"writing RayService {ns}/{name}: {e.status} {e.reason}") from None

    @staticmethod
    def _check_kept(stored: dict, obj: dict) -> None:
        """Refuse to write a RayService whose CRD would drop what keeps the cluster safe: an older
        KubeRay's schema prunes rayClusterConfig.authOptions (1.5.0 has none), and KubeRay would
        then start a Ray cluster without the token authentication the MoEDeployment asks for.
        `stored` is the apiserver's answer to a dry run of the same write."""
        wanted = obj["spec"]["rayClusterConfig"].get("authOptions")
        if wanted and not ((stored.get("spec") or {}).get("rayClusterConfig") or {}).get("authOptions"):
            raise KubeRayError(
                "the installed KubeRay's RayService CRD has no rayClusterConfig.authOptions (KubeRay 1.5.0 has "
                "none): the Ray cluster would run without the token authentication spec.ray.authTokenSecretRef "
                "asks for, so nothing was written; install a KubeRay whose CRD has authOptions, or remove "
                "spec.ray.authTokenSecretRef to run the cluster without a token")

    def delete_owned(self, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the RayService if (and only if) `owner_uid` owns it: True while one of ours is there
        (also one already being deleted, held by KubeRay's finalizer), False once there is none."""
        current = self.get(namespace, name)
        if current is None or not any(r.get("uid") == owner_uid for r in current["metadata"].get("ownerReferences") or []):
            return False
        body = {"preconditions": {"uid": current["metadata"]["uid"]}}  # exactly the object we checked
        try:
            self.api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body=body,
                                                     _request_timeout=30)
            return True
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return False
            raise KubeRayError(f"deleting RayService {namespace}/{name}: {e.status} {e.reason}") from None
