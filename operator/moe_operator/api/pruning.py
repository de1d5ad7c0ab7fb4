"""What the apiserver does to an object before validating it, done the same way for standalone
mode (pure): fields the CRD's structural schema does not know are dropped, and so are nulls of
fields that are not nullable. So one file means the same under `kubectl apply` and `moectl up`
(`replicas_per_group` under spec.experts is not replicasPerGroup in either).
"""

from __future__ import annotations

from typing import Any


def prune(value: Any, schema: dict, path: str = "") -> tuple[Any, list[str]]:
    """(the value as the apiserver would store it, the paths that were dropped)."""
    dropped: list[str] = []
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        out = {}
        for k, v in value.items():
            child = f"{path}.{k}" if path else str(k)
            sub = (props or {}).get(k) if props is not None else (extra if isinstance(extra, dict) else None)
            if sub is None:
                dropped.append(f"{child}: unknown field")
                continue
            if v is None and not sub.get("nullable"):
                dropped.append(f"{child}: null")
                continue
            out[k], more = prune(v, sub, child)
            dropped += more
        return out, dropped
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        out_list = []
        for i, v in enumerate(value):
            if v is None and not schema["items"].get("nullable"):
                dropped.append(f"{path}[{i}]: null")
                continue
            item, more = prune(v, schema["items"], f"{path}[{i}]")
            out_list.append(item)
            dropped += more
        return out_list, dropped
    return value, dropped


def spec_schema() -> dict:
    """The CRD's schema of `spec`."""
    from moe_operator.api.crd import build_crd

    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
