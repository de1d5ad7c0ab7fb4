"""What the apiserver does to an object before validating it, done the same way for standalone
mode (pure): fields the CRD's structural schema does not know are dropped, and so are nulls of
fields that are not nullable (a null item of a list is not dropped: the apiserver refuses it). So one file means the same under `kubectl apply` and `moectl up`
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
        for i, v in enumerate(value):  # a null item is kept: the apiserver refuses it (type_problems names it)
            item, more = prune(v, schema["items"], f"{path}[{i}]")
            out_list.append(item)
            dropped += more
        return out_list, dropped
    return value, dropped


_TYPES = {"object": (dict,), "array": (list,), "string": (str,), "integer": (int,), "number": (int, float),
          "boolean": (bool,)}


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def type_problems(value: Any, schema: dict, path: str = "") -> list[str]:
    """Each place where `value` is not of the JSON type its structural schema says, as the
    apiserver refuses it ("spec.experts.tiers: must be of type object, got integer"), before any
    field of it is read (pruned first: unknown fields are not looked at)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
        return [] if ok else [f"{path}: must be an integer or a string, got {_type_name(value)}"]
    kind = schema.get("type")
    if kind in _TYPES:
        ok = isinstance(value, _TYPES[kind]) and not (isinstance(value, bool) and kind in ("integer", "number"))
        if value is None and schema.get("nullable"):
            return []
        if not ok:
            return [f"{path}: must be of type {kind}, got {_type_name(value)}"]
    out: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k) if k in props else (extra if isinstance(extra, dict) else None)
            if sub is not None:
                out += type_problems(v, sub, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            out += type_problems(v, schema["items"], f"{path}[{i}]")
    return out


def spec_schema() -> dict:
    """The CRD's schema of `spec`."""
    from moe_operator.api.crd import build_crd

    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
