"""Parse a MoEDeployment spec and turn pydantic errors into messages that name the field."""

from __future__ import annotations

from typing import Any

import pydantic

from .models import MoEDeploymentSpec


class SpecError(ValueError):
    """An invalid spec; `problems` holds one `path: message` line per field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def field_path(loc: tuple[Any, ...], prefix: str = "spec") -> str:
    """('experts', 'overrides', 0, 'expert') -> 'spec.experts.overrides[0].expert'."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not str(part).startswith("function-"):  # pydantic's validator frames
            path += f".{part}" if path else str(part)
    return path


def describe_errors(err: pydantic.ValidationError, prefix: str = "spec") -> list[str]:
    lines = []
    for e in err.errors(include_url=False):
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"{field_path(e['loc'], prefix)}: {msg}")
    return lines


def parse_spec(spec: dict[str, Any] | None) -> MoEDeploymentSpec:
    """The spec as a model; SpecError with every problem when it is invalid."""
    if spec is None:
        raise SpecError(["spec: required field is missing"])
    try:
        return MoEDeploymentSpec.model_validate(spec)
    except pydantic.ValidationError as err:
        raise SpecError(describe_errors(err)) from None
