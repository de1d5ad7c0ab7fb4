"""Expert ids `L.E` (layer, expert) as every interface writes them: parsed strictly, and their
numeric order (pure). The CRD's schema takes `EXPERT_ID_PATTERN` (operator/moe_operator/api/types.py),
so the apiserver, the operator's parser and the planner refuse the same ids."""

from __future__ import annotations

import re
from dataclasses import dataclass

EXPERT_ID_PATTERN = r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$"
_EXPERT_ID_RE = re.compile(EXPERT_ID_PATTERN)


@dataclass(frozen=True, order=True)
class ExpertId:
    """One expert: layer L, expert E, written `L.E` on every interface."""

    layer: int
    expert: int

    @classmethod
    def parse(cls, text: str) -> "ExpertId":
        """ValueError naming the text unless it is `L.E` in plain decimal ("3.12"; not " 3.12",
        "+3.12", "03.12" or "3.12.0")."""
        if not isinstance(text, str) or not _EXPERT_ID_RE.match(text):
            raise ValueError(f"{text!r} is not an expert id; expected LAYER.EXPERT, e.g. 3.12")
        layer, expert = text.split(".")
        return cls(int(layer), int(expert))

    def __str__(self) -> str:
        return f"{self.layer}.{self.expert}"


def expert_key(eid: str) -> tuple[int, ...]:
    """'3.12' -> (3, 12): sorts 3.2 before 3.12, which the strings do not. (For ids already
    validated; `ExpertId.parse` is the check.)"""
    return tuple(int(p) for p in eid.split("."))


def layer_of(eid: str) -> int:
    return int(eid.split(".")[0])
