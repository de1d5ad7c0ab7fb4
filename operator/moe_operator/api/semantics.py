"""Checks beyond the schema, each returning (reason, message, failed) like cert-manager's policy chain.

They read the checkpoint's config.json (JSON only: the operator does not load weights) and the
operator's allowed roots, so a spec that the schema accepts but that cannot serve is reported
with what to fix instead of failing later inside Ray.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moe_workers.paths import within_roots

from .models import MoEDeploymentSpec
from .types import ExpertId, quantity_bytes

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelFacts:
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: str

    def expert_bytes(self, dtype: str = "auto") -> int:
        d = self.dtype if dtype == "auto" else dtype
        return 3 * self.hidden_size * self.intermediate_size * _DTYPE_BYTES.get(d, 4)


def under_roots(path: str, roots: list[str]) -> bool:
    return within_roots(path, roots) is not None


def read_model_facts(model_dir: str) -> ModelFacts:
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return ModelFacts(
        num_layers=int(raw["num_hidden_layers"]), num_experts=int(raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]), hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch."),
    )


Check = Callable[[MoEDeploymentSpec, list[str], "ModelFacts | None"], tuple[str, str, bool]]
OK = ("", "", False)


def check_model_root(spec, roots, facts):
    if not under_roots(spec.model.path, roots):
        return ("InvalidSpec", f"spec.model.path {spec.model.path} is outside the allowed model roots "
                f"({', '.join(roots) or 'none configured'})", True)
    return OK


def check_model_dir(spec, roots, facts):
    if facts is None:
        hint = (" here; with ray.mode KubeRay the model lives on the Ray Pods: set spec.model.shape"
                if spec.ray.mode == "KubeRay" else " (expected a Hugging Face layout directory)")
        return ("InvalidSpec", f"spec.model.path {spec.model.path} has no readable config.json{hint}", True)
    return OK


def check_shape_agrees(spec, roots, facts):
    given = spec.model.shape
    if facts is None or given is None or facts == facts_from_shape(given):
        return OK
    diff = [f"{k} {getattr(given, k)} (config.json: {getattr(facts, k)})"
            for k in ("num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size", "dtype")
            if getattr(given, k) != getattr(facts, k)]
    return ("InvalidSpec", f"spec.model.shape disagrees with {spec.model.path}/config.json: {', '.join(diff)}", True)


def facts_from_shape(shape) -> ModelFacts:
    return ModelFacts(num_layers=shape.num_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                      hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size, dtype=shape.dtype)


def check_topk(spec, roots, facts):
    if facts and not 1 <= facts.top_k <= facts.num_experts:
        return ("InvalidSpec", f"the checkpoint's num_experts_per_tok ({facts.top_k}) is larger than its "
                f"num_local_experts ({facts.num_experts})", True)
    return OK


def check_overrides(spec, roots, facts):
    for i, o in enumerate(spec.experts.overrides):
        eid = ExpertId.parse(o.expert)
        if facts and not (eid.layer < facts.num_layers and eid.expert < facts.num_experts):
            return ("InvalidSpec", f"spec.experts.overrides[{i}].expert {o.expert} does not exist: the model has "
                    f"{facts.num_layers} layers x {facts.num_experts} experts", True)
        if not under_roots(o.weights.path, roots):
            return ("InvalidSpec", f"spec.experts.overrides[{i}].weights.path {o.weights.path} is outside the "
                    "allowed weight roots", True)
    return OK


def check_hot_budget(spec, roots, facts):
    if not facts:
        return OK
    per_layer = math.ceil(facts.num_experts / spec.experts.groups)
    need = per_layer * facts.expert_bytes(spec.model.dtype)
    have = quantity_bytes(spec.experts.tiers.hot.budget)
    if have < need:
        return ("InvalidSpec", f"spec.experts.tiers.hot.budget ({have} bytes) is smaller than one batch's working "
                f"set in a shard group: {per_layer} experts of a layer x {facts.expert_bytes(spec.model.dtype)} "
                f"bytes = {need} bytes; raise the budget or add groups", True)
    return OK


CHECKS: list[Check] = [check_model_root, check_model_dir, check_shape_agrees, check_topk, check_overrides,
                       check_hot_budget]


def validate_semantics(spec: MoEDeploymentSpec, roots: list[str]) -> tuple[ModelFacts | None, list[str]]:
    """The model's facts (None when unreadable) and every failed check's message, in order."""
    facts = None
    if under_roots(spec.model.path, roots):
        try:
            facts = read_model_facts(spec.model.path)
        except (OSError, ValueError, KeyError):
            facts = None
    problems = []
    for check in CHECKS:
        if check is check_model_dir and facts is None and spec.model.shape is not None:
            facts = facts_from_shape(spec.model.shape)  # config.json not readable here: the spec says
            continue
        _, message, failed = check(spec, roots, facts)
        if failed:
            problems.append(message)
            if check in (check_model_root, check_model_dir):
                break  # nothing else can be judged without the model
    return facts, problems
