"""Checks beyond the schema, each returning (reason, message, failed) like cert-manager's policy chain.

They read the checkpoint's config.json and its safetensors headers (JSON only: the operator does
not load weights) and the operator's allowed roots, so a spec that the schema accepts but that
cannot serve is reported with what to fix instead of failing later inside Ray: a model_type we
do not compute is UnsupportedModel, tensors that contradict config.json are InvalidSpec naming
the file and the tensor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from moe_workers.model.dtypes import BYTES as _DTYPE_BYTES
from moe_workers.model.family import Arch, CheckpointError, UnsupportedModel, parse
from moe_workers.model.index import read_index
from moe_workers.model.quantization import QuantizationError, check_scale_values
from moe_workers.model.kv_blocks import budget_problem
from moe_workers.paths import within_roots

from . import conditions as cond

from .models import MoEDeploymentSpec
from .types import ExpertId, quantity_bytes



SHAPE_FIELDS = ("num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size", "dtype")


@dataclass(frozen=True)
class ModelFacts:
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: str
    family: str = "mixtral"
    sparse_layers: tuple[int, ...] | None = None  # None: every layer has routed experts
    expert_numel: int | None = None  # None: a SwiGLU expert's 3 x hidden x intermediate
    arch: Arch | None = None  # the whole config when config.json was read (None: from spec.model.shape)

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers with routed experts: where placement puts experts."""
        return tuple(range(self.num_layers)) if self.sparse_layers is None else self.sparse_layers

    def expert_bytes(self, dtype: str = "auto") -> int:
        d = self.dtype if dtype == "auto" else dtype
        numel = self.expert_numel or 3 * self.hidden_size * self.intermediate_size
        return numel * _DTYPE_BYTES.get(d, 4)

    def expert_problem(self, layer: int, expert: int) -> str | None:
        if layer >= self.num_layers or expert >= self.num_experts:
            return f"the model has {self.num_layers} layers x {self.num_experts} routed experts"
        if layer not in self.layers:
            return (f"layer {layer} of this {self.family} model is a dense MLP layer without routed experts "
                    f"(shared experts and dense layers cannot be swapped)")
        return None


def under_roots(path: str, roots: list[str]) -> bool:
    return within_roots(path, roots) is not None


def read_model_facts(model_dir: str, family: str | None = None) -> ModelFacts:
    """The facts of a checkpoint directory: its config.json as `family` (default: its
    model_type) reads it, checked against every safetensors header. Raises UnsupportedModel or
    CheckpointError (the file and the tensor named), OSError when unreadable."""
    config_file = Path(model_dir) / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file}: not valid JSON ({err})") from None
    arch = parse(raw, str(config_file), family)
    index = read_index(model_dir)
    arch.check_tensors({n: (str(t.file), t.dtype, t.shape) for n, t in index.items()}, model_dir)
    if arch.quant is not None:
        try:
            check_scale_values(index)
        except QuantizationError as err:
            raise CheckpointError(str(err)) from None
    return ModelFacts(num_layers=arch.num_layers, num_experts=arch.num_experts, top_k=arch.top_k,
                      hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size, dtype=arch.dtype_name,
                      family=arch.family, sparse_layers=arch.sparse_layers, expert_numel=arch.expert_numel(),
                      arch=arch)


Check = Callable[[MoEDeploymentSpec, list[str], "ModelFacts | None"], tuple[str, str, bool]]
OK = ("", "", False)


def check_model_root(spec, roots, facts):
    if not under_roots(spec.model.path, roots):
        return (cond.INVALID_SPEC, f"spec.model.path {spec.model.path} is outside the allowed model roots "
                f"({', '.join(roots) or 'none configured'})", True)
    return OK


def check_model_dir(spec, roots, facts):
    if isinstance(facts, UnsupportedModel):
        return (cond.UNSUPPORTED_MODEL, f"spec.model.path {spec.model.path}: {facts}", True)
    if isinstance(facts, CheckpointError):
        return (cond.INVALID_SPEC, f"spec.model.path {spec.model.path}: {facts}", True)
    if facts is None:
        hint = (" here; with ray.mode KubeRay the model lives on the Ray Pods: set spec.model.shape"
                if spec.ray.mode == "KubeRay" else " (expected a Hugging Face layout directory)")
        return (cond.INVALID_SPEC, f"spec.model.path {spec.model.path} has no readable config.json{hint}", True)
    return OK


def check_shape_agrees(spec, roots, facts):
    given = spec.model.shape
    if facts is None or given is None:
        return OK
    diff = [f"{k} {getattr(given, k)} (config.json: {getattr(facts, k)})"
            for k in SHAPE_FIELDS if getattr(given, k) != getattr(facts, k)]
    if given.sparse_layers is not None and tuple(given.sparse_layers) != facts.layers:
        diff.append(f"sparse_layers {given.sparse_layers} (config.json: {list(facts.layers)})")
    if not diff:
        return OK
    return (cond.INVALID_SPEC, f"spec.model.shape disagrees with {spec.model.path}/config.json: {', '.join(diff)}", True)


def facts_from_shape(shape) -> ModelFacts:
    return ModelFacts(num_layers=shape.num_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                      hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size, dtype=shape.dtype,
                      sparse_layers=tuple(sorted(set(shape.sparse_layers))) if shape.sparse_layers is not None else None)


def check_topk(spec, roots, facts):
    if facts and not 1 <= facts.top_k <= facts.num_experts:
        return (cond.INVALID_SPEC, f"the checkpoint's num_experts_per_tok ({facts.top_k}) is larger than its "
                f"num_local_experts ({facts.num_experts})", True)
    return OK


def check_overrides(spec, roots, facts):
    for i, o in enumerate(spec.experts.overrides):
        eid = ExpertId.parse(o.expert)
        problem = facts.expert_problem(eid.layer, eid.expert) if facts else None
        if problem:
            return (cond.INVALID_SPEC, f"spec.experts.overrides[{i}].expert {o.expert} does not exist: {problem}", True)
        if not under_roots(o.weights.path, roots):
            return (cond.INVALID_SPEC, f"spec.experts.overrides[{i}].weights.path {o.weights.path} is outside the "
                    "allowed weight roots", True)
    return OK


def check_quarantine(spec, roots, facts):
    """Each quarantined expert is a routed expert of the model, and a layer keeps enough
    candidates: no more than maxQuarantinedShare of its experts out, and never fewer than top-k
    left (for group-limited routers, enough in the groups it may choose)."""
    routing = spec.routing
    if not routing.quarantine or not facts:
        return OK
    per_layer: dict[int, list[int]] = {}
    for i, eid in enumerate(routing.quarantine):
        e = ExpertId.parse(eid)
        problem = facts.expert_problem(e.layer, e.expert)
        if problem:
            return (cond.INVALID_SPEC, f"spec.routing.quarantine[{i}] {eid} does not exist: {problem}", True)
        per_layer.setdefault(e.layer, []).append(e.expert)
    allowed = math.floor(routing.max_quarantined_share * facts.num_experts)
    for layer, experts in sorted(per_layer.items()):
        if len(experts) > allowed:
            return (cond.INVALID_SPEC, f"spec.routing.quarantine takes {len(experts)} of layer {layer}'s "
                    f"{facts.num_experts} experts out; spec.routing.maxQuarantinedShare "
                    f"({routing.max_quarantined_share}) allows {allowed}", True)
        problem = _too_few_left(facts, experts)
        if problem:
            return (cond.INVALID_SPEC, f"spec.routing.quarantine leaves layer {layer} {problem}", True)
    return OK


def _too_few_left(facts: ModelFacts, experts: list[int]) -> str | None:
    """Whether a layer with `experts` out still has top-k candidates wherever its router looks: a
    group-limited router chooses among its topk_group best groups, each needing (DeepSeek-V3's
    group score is its two best) two candidates, so the worst such groups must hold top-k."""
    left = facts.num_experts - len(experts)
    if left < facts.top_k:
        return f"{left} candidates, fewer than top-k ({facts.top_k})"
    arch = facts.arch
    n_group = getattr(arch, "n_group", 1) or 1
    if n_group <= 1:
        return None
    size = facts.num_experts // n_group
    in_group = [size - sum(1 for e in experts if e // size == g) for g in range(n_group)]
    need_each = 2 if getattr(arch, "router", "") == "sigmoid_group" and size > 1 else 1
    if min(in_group) < need_each:
        return f"a group of experts with {min(in_group)} candidates (its router scores a group by its best {need_each})"
    worst = sum(sorted(in_group)[:arch.topk_group])
    if worst < facts.top_k:
        return (f"{worst} candidates in its {arch.topk_group} emptiest groups, fewer than top-k ({facts.top_k}): "
                "its router may choose exactly those groups")
    return None


def check_hot_budget(spec, roots, facts):
    """The hot tier must hold one token's experts at once (those of a layer in a shard group,
    top-k at most); a call needing more is computed in waves of what it holds."""
    if not facts:
        return OK
    at_once = min(math.ceil(facts.num_experts / spec.experts.groups), facts.top_k)
    need = at_once * facts.expert_bytes(spec.model.dtype)
    have = quantity_bytes(spec.experts.tiers.hot.budget)
    if have < need:
        return (cond.INVALID_SPEC, f"spec.experts.tiers.hot.budget ({have} bytes) is smaller than one token's experts "
                f"in a shard group: {at_once} experts of a layer x {facts.expert_bytes(spec.model.dtype)} "
                f"bytes = {need} bytes; raise the budget or add groups", True)
    return OK


def check_kv_budget(spec, roots, facts):
    """The KV cache must hold one sequence of maxModelLen tokens (else the Ingress cannot start)."""
    arch = facts.arch if facts else None
    if arch is None:
        return OK
    dtype = arch.dtype_name if spec.model.dtype == "auto" else spec.model.dtype
    max_len = min(spec.model.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    problem = budget_problem(arch, quantity_bytes(spec.ingress.kv_cache_budget), spec.ingress.kv_block_size,
                             _DTYPE_BYTES.get(dtype, 4), max_len)
    if problem:
        return (cond.INVALID_SPEC, f"spec.ingress.kvCacheBudget: {problem} (spec.model.maxModelLen: {max_len})", True)
    return OK


CHECKS: list[Check] = [check_model_root, check_model_dir, check_shape_agrees, check_topk, check_overrides,
                       check_quarantine, check_hot_budget, check_kv_budget]


def validate_semantics(spec: MoEDeploymentSpec, roots: list[str]) -> tuple[ModelFacts | None, list[str], str]:
    """The model's facts (None when unreadable or refused), every failed check's message in
    order, and the first failure's reason (InvalidSpec or UnsupportedModel; "" when none)."""
    facts: ModelFacts | CheckpointError | None = None
    if under_roots(spec.model.path, roots):
        try:
            facts = read_model_facts(spec.model.path, spec.model.family)
        except CheckpointError as err:  # read, and refused: the message names the file and tensor
            facts = err
        except (OSError, ValueError, KeyError):
            facts = None
    problems, reason = [], ""
    for check in CHECKS:
        if check is check_model_dir and facts is None and spec.model.shape is not None:
            facts = facts_from_shape(spec.model.shape)  # config.json not readable here: the spec says
            if spec.model.family == "gpt_oss":
                facts = replace(facts, family="gpt_oss", expert_numel=3 * facts.hidden_size * facts.intermediate_size
                                + 2 * facts.intermediate_size + facts.hidden_size)
            elif spec.model.family:
                facts = replace(facts, family=spec.model.family)
            continue
        check_reason, message, failed = check(spec, roots, facts)
        if failed:
            problems.append(message)
            reason = reason or check_reason
            if check in (check_model_root, check_model_dir):
                break  # nothing else can be judged without the model
    return (facts if isinstance(facts, ModelFacts) else None), problems, reason
