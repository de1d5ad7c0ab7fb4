"""Field types shared by the MoEDeployment models: quantities, expert ids, digests.

Each type validates in pydantic (standalone mode, the operator) and renders the same rule into
the CRD's OpenAPI schema (the apiserver), so both reject the same input.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal
from typing import Annotated, Any, Callable

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

from moe_workers.expert_ids import EXPERT_ID_PATTERN, ExpertId

# Kubernetes resource.Quantity's regular expression, without the sign: no size here is negative,
# and the apiserver refuses "-1Gi" as the parser does.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_EXPONENT = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# Kubernetes keeps quantities in an int64; the schema's `maximum` is a float64, which cannot hold
# 2**63 - 1 (it rounds up and overflows), so the bound both sides use is the largest float64 below it
MAX_QUANTITY = 2**63 - 1024
SHA256_PATTERN = r"^[0-9a-f]{64}$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def parse_quantity(value: int | str) -> Decimal:
    """A Kubernetes quantity ("16Gi", "500M", "1.5e9", 1024) as an exact number of units, at
    most MAX_QUANTITY ("1e400" or 400 nines are refused, never turned into inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("must be an integer or a quantity string like '16Gi'")
    if isinstance(value, int):
        number = Decimal(value)
    else:
        if not _QUANTITY_RE.match(value):
            raise ValueError(f"{value!r} is not a quantity (examples: 512Mi, 16Gi, 2G, 1073741824)")
        text = value.lstrip("+")
        if text[-2:] in _BINARY_SUFFIX:
            number = Decimal(text[:-2]) * _BINARY_SUFFIX[text[-2:]]
        elif text[-1] in _DECIMAL_EXPONENT:
            number = Decimal(text[:-1]).scaleb(_DECIMAL_EXPONENT[text[-1]])
        else:
            mantissa, _, exponent = text.lower().partition("e")
            if exponent and abs(Decimal(exponent)) > 100:
                raise ValueError(f"{value!r} is out of range: at most {MAX_QUANTITY}")
            number = Decimal(mantissa).scaleb(int(Decimal(exponent))) if exponent else Decimal(text)
    if number < 0:
        raise ValueError(f"quantity {value!r} is negative")
    if number > MAX_QUANTITY:
        raise ValueError(f"{value!r} is out of range: at most {MAX_QUANTITY}")
    return number


def quantity_bytes(value: int | str) -> int:
    """A memory quantity in whole bytes (a fraction rounds up, as Kubernetes does)."""
    return int(parse_quantity(value).to_integral_value(rounding=ROUND_CEILING))


def _validate_quantity(value: Any) -> int | str:
    parse_quantity(value)
    return value


def _validate_bytes(value: Any) -> int | str:
    """A size in bytes: a whole number of at least one byte ("0", "0.5", "1n" are refused)."""
    n = parse_quantity(value)
    if n < 1 or n != n.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes of at least 1 (examples: 512Mi, 16Gi)")
    return value


def _quantity_type(validator: Callable[[Any], int | str]) -> Any:
    """An int-or-string field checked by `validator` in pydantic and by the pattern and bounds in
    the CRD (the apiserver's int-or-string form)."""
    return Annotated[
        int | str,
        BeforeValidator(validator),
        WithJsonSchema({
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "minimum": 0,
            "maximum": MAX_QUANTITY,
        }),
    ]


Quantity = _quantity_type(_validate_quantity)
Bytes = _quantity_type(_validate_bytes)  # whole bytes, at least 1


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
