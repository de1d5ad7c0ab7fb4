"""Field types shared by the MoEDeployment models: quantities, expert ids, digests.

Each type validates in pydantic (standalone mode, the operator) and renders the same rule into
the CRD's OpenAPI schema (the apiserver), so both reject the same input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

# Kubernetes resource.Quantity, the same regular expression the core types publish.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9,
                   "T": 1e12, "P": 1e15, "E": 1e18}

EXPERT_ID_PATTERN = r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$"
_EXPERT_ID_RE = re.compile(EXPERT_ID_PATTERN)
SHA256_PATTERN = r"^[0-9a-f]{64}$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def parse_quantity(value: int | float | str) -> float:
    """A Kubernetes quantity ("16Gi", "500M", "1.5e9", 1024) as a number of units."""
    if isinstance(value, bool):
        raise ValueError("a quantity must be a number or a string like '16Gi'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"quantity {value} is negative")
        return float(value)
    text = str(value).strip()
    if not _QUANTITY_RE.match(text):
        raise ValueError(f"{value!r} is not a quantity (examples: 512Mi, 16Gi, 2G, 1073741824)")
    for suffix, factor in _BINARY_SUFFIX.items():
        if text.endswith(suffix):
            number = float(text[: -len(suffix)])
            break
    else:
        m = re.match(r"^([+-]?[0-9.]+)([eE][+-]?[0-9.]+)$", text)
        if m:
            number, factor = float(text), 1
        else:
            suffix = text[-1] if text[-1] in _DECIMAL_SUFFIX else ""
            number = float(text[: len(text) - len(suffix)])
            factor = _DECIMAL_SUFFIX[suffix]
    if number < 0:
        raise ValueError(f"quantity {value!r} is negative")
    return number * factor


def quantity_bytes(value: int | float | str) -> int:
    """A memory quantity in whole bytes."""
    return int(parse_quantity(value))


def _validate_quantity(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("must be an integer number of bytes or a quantity string like '16Gi'")
    parse_quantity(value)
    return value


Quantity = Annotated[
    int | str,
    BeforeValidator(_validate_quantity),
    WithJsonSchema({
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
    }),
]


@dataclass(frozen=True, order=True)
class ExpertId:
    """One expert: layer L, expert E, written `L.E` on every interface."""

    layer: int
    expert: int

    @classmethod
    def parse(cls, text: str) -> "ExpertId":
        if not isinstance(text, str) or not _EXPERT_ID_RE.match(text):
            raise ValueError(f"{text!r} is not an expert id; expected LAYER.EXPERT, e.g. 3.12")
        layer, expert = text.split(".")
        return cls(int(layer), int(expert))

    def __str__(self) -> str:
        return f"{self.layer}.{self.expert}"


def _validate_expert_id(value: Any) -> str:
    return str(ExpertId.parse(value))


ExpertIdStr = Annotated[
    str,
    BeforeValidator(_validate_expert_id),
    PlainSerializer(str),
    WithJsonSchema({"type": "string", "pattern": EXPERT_ID_PATTERN}),
]

__all__ = [
    "DNS_SUBDOMAIN_PATTERN",
    "EXPERT_ID_PATTERN",
    "ExpertId",
    "ExpertIdStr",
    "QUANTITY_PATTERN",
    "Quantity",
    "SHA256_PATTERN",
    "parse_quantity",
    "quantity_bytes",
]
