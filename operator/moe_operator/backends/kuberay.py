"""KubeRay backend: the MoEDeployment owns a RayService (ray.io/v1) whose serveConfigV2 is the
rendered application; KubeRay runs the Ray cluster and deploys the app. This module only reads
and writes the RayService object through the Kubernetes API."""

from __future__ import annotations

from dataclasses import dataclass

import kubernetes

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayservices"


class KubeRayError(RuntimeError):
    pass


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

    def apply(self, obj: dict) -> dict:
        """Create the RayService, or replace its spec (labels and owner too) when it differs."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        current = self.get(ns, name)
        try:
            if current is None:
                return self.api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, obj, _request_timeout=30)
            meta = current["metadata"]
            if (current.get("spec") == obj["spec"] and meta.get("labels") == obj["metadata"]["labels"]
                    and meta.get("ownerReferences") == obj["metadata"]["ownerReferences"]):
                return current  # nothing to write
            if not any(r.get("uid") == obj["metadata"]["ownerReferences"][0]["uid"]
                       for r in meta.get("ownerReferences") or []):
                raise KubeRayError(f"RayService {ns}/{name} exists and is not owned by this MoEDeployment; "
                                   "rename one of them")
            body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": meta["resourceVersion"]}}
            return self.api.replace_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, body,
                                                             _request_timeout=30)
        except kubernetes.client.ApiException as e:
            if e.status == 404 and "the server could not find the requested resource" in (e.body or ""):
                raise KubeRayError("the RayService CRD (ray.io/v1) is not installed: install KubeRay") from None
            raise KubeRayError(f"writing RayService {ns}/{name}: {e.status} {e.reason}") from None

    def delete_owned(self, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the RayService if (and only if) `owner_uid` owns it; False when there was none of ours."""
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
