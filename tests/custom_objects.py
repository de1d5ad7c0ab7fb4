"""An in-memory stand-in for kubernetes' `CustomObjectsApi`, as far as `KubeRayClient` uses it:
create, get, replace and delete one namespaced object, with what the apiserver does that the
backend relies on (404 as `ApiException`, a dry run that stores nothing, `metadata.generation`
moving only when the spec changes, `status` kept across a replace, a uid precondition on delete, an
object with finalizers only marked for deletion).
What KubeRay would write into a RayService's status a test writes with `set_status`."""

from __future__ import annotations

import copy
import itertools

from kubernetes.client import ApiException

_uids = itertools.count(1)


class MemoryCustomObjects:
    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace, name) -> object

    def _missing(self, plural, namespace, name):
        err = ApiException(status=404, reason="Not Found")
        err.body = f'{{"kind":"Status","message":"{plural} \\"{name}\\" not found"}}'
        return err

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_):
        obj = self.objects.get((plural, namespace, name))
        if obj is None:
            raise self._missing(plural, namespace, name)
        return copy.deepcopy(obj)

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, dry_run=None, **_):
        name = body["metadata"]["name"]
        if (plural, namespace, name) in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        obj = copy.deepcopy(body)
        obj["metadata"].update(generation=1, uid=f"uid-{next(_uids)}", namespace=namespace)
        if dry_run != "All":
            self.objects[(plural, namespace, name)] = obj
        return copy.deepcopy(obj)

    def replace_namespaced_custom_object(self, group, version, namespace, plural, name, body, dry_run=None, **_):
        current = self.objects.get((plural, namespace, name))
        if current is None:
            raise self._missing(plural, namespace, name)
        obj = copy.deepcopy(body)
        meta = current["metadata"]
        obj["metadata"].update(uid=meta["uid"], generation=meta["generation"] + (body.get("spec") != current.get("spec")))
        obj["status"] = copy.deepcopy(current.get("status"))
        if dry_run != "All":
            self.objects[(plural, namespace, name)] = obj
        return copy.deepcopy(obj)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, body=None, **_):
        current = self.objects.get((plural, namespace, name))
        if current is None:
            raise self._missing(plural, namespace, name)
        wanted = ((body or {}).get("preconditions") or {}).get("uid")
        if wanted and wanted != current["metadata"]["uid"]:
            raise ApiException(status=409, reason="Conflict")
        if current["metadata"].get("finalizers"):  # held until its controller lets it go
            current["metadata"].setdefault("deletionTimestamp", "2026-12-07T00:00:00Z")
            return copy.deepcopy(current)
        del self.objects[(plural, namespace, name)]
        return {"kind": "Status", "status": "Success"}

    def finalize(self, plural, namespace, name) -> None:
        """What the other controller (KubeRay) does once its clean-up is done: drop its finalizer,
        and the object goes if it was being deleted."""
        obj = self.objects[(plural, namespace, name)]
        obj["metadata"]["finalizers"] = []
        if obj["metadata"].get("deletionTimestamp"):
            del self.objects[(plural, namespace, name)]

    def set_status(self, plural, namespace, name, status: dict) -> None:
        """What the other controller (KubeRay) writes into the object's status subresource."""
        self.objects[(plural, namespace, name)]["status"] = copy.deepcopy(status)
