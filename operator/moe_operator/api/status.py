"""Status as the operator writes it: built from, and checked against, the API models (pure).

The apiserver prunes what it stores under `.status` to the CRD's schema, which `api/models.py`
generates. A key the models lack (a misspelt `readyReplica`) would vanish there without a word,
and `moectl get`, the scale subresource or a dashboard would read nothing. So every pass that
produces status (the reconcile pass, the autoscaler, the live observer) hands it out through
`checked()`: a key or a value the models do not allow raises `StatusError` naming its path, in
the unit tests of that pass rather than on a cluster. Entries with a model of their own (a
shard group) are built from it with `dump()`; the pass' whole status is built once, at its exit,
from `MoEDeploymentStatus` (`build()`), and `status_patch()` compares it, read through the same
model, with what is stored: a status is written only when the model reads the two differently.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from moe_operator.api.models import MoEDeploymentStatus
from moe_operator.merge_patch import merge_patch

# keys a status may carry at the top, as the CRD spells them (the model itself ignores unknown
# top-level keys when it reads a stored status, so an old operator's fields do not break a read)
FIELDS = frozenset(f.alias or name for name, f in MoEDeploymentStatus.model_fields.items())


class StatusError(ValueError):
    """A status the operator was about to write does not fit the CRD's schema."""


def dump(model: BaseModel) -> dict:
    """One status entry as the CRD spells it: camelCase, unset optional fields left out."""
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")


def checked(status: dict) -> dict:
    """`status`, unchanged, once every key and value in it (nested too) is one the CRD's
    schema keeps; StatusError naming each one that is not. None at the top is a removal (a merge
    patch writes it so) and always fits."""
    unknown = sorted(k for k in status if k not in FIELDS)
    if unknown:
        raise StatusError(f"status fields the CRD does not have: {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(FIELDS))})")
    try:
        MoEDeploymentStatus.model_validate({k: v for k, v in status.items() if v is not None})
    except ValidationError as err:
        problems = "; ".join(f"status.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise StatusError(f"status does not fit the CRD's schema: {problems}") from None
    return status


def _stored(status: dict) -> dict:
    """`status` read into MoEDeploymentStatus and dumped as the CRD keeps it: the keys it holds
    (a default it does not set stays unset), camelCase, None (a removal) left out, top-level keys
    the CRD lacks dropped (the apiserver prunes them). ValidationError when the model cannot read it."""
    model = MoEDeploymentStatus.model_validate({k: v for k, v in status.items() if v is not None})
    return model.model_dump(by_alias=True, exclude_unset=True, exclude_none=True, mode="json")


def build(status: dict) -> dict:
    """The status a pass hands out, built once from MoEDeploymentStatus: `checked()` (StatusError
    naming what the CRD lacks), then read into the model and dumped as the CRD keeps it."""
    return _stored(checked(status))


def status_patch(before: dict, after: dict) -> dict:
    """The JSON merge patch that takes the stored status `before` to `after`, both read through
    MoEDeploymentStatus: {} when the model reads them alike (a steady pass writes nothing, and a
    key the apiserver would prune is not written pass after pass). A side the model cannot read (a
    status an older version stored) is compared as it is."""
    try:
        before, after = _stored(before), _stored(after)
    except ValidationError:
        pass
    return merge_patch(before, after)
