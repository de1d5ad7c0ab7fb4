"""Initial expert placement: which shard group hosts which experts (pure, deterministic).

Every expert of every layer gets one copy. Per layer, groups get floor(E/G) or ceil(E/G)
experts; the groups that get the extra one rotate with the layer, so each group's total bytes
differ by at most one expert. When a previous placement is given (the group count changed),
experts stay where they are while their group exists and has room: only the surplus moves,
which is the fewest moves any balanced placement allows.
"""

from __future__ import annotations

from collections.abc import Iterable

from moe_workers.expert_ids import ExpertId, expert_key
from moe_workers.serve.config import group_name  # the deployment names the app builder uses

Placement = dict[str, list[str]]


def _layers(layers: int | Iterable[int]) -> list[int]:
    """The layers with routed experts: an int n means 0..n-1 (every layer sparse)."""
    return list(range(layers)) if isinstance(layers, int) else sorted(layers)


def _layer_capacity(layer: int, num_experts: int, num_groups: int) -> list[int]:
    base, extra = divmod(num_experts, num_groups)
    caps = [base] * num_groups
    for i in range(extra):
        caps[(layer * extra + i) % num_groups] += 1
    return caps


def initial_placement(layers: int | Iterable[int], num_experts: int, num_groups: int,
                      previous: Placement | None = None) -> Placement:
    """`layers`: the model's sparse layers (or their count when every layer has experts)."""
    if num_groups < 1:
        raise ValueError("need at least one shard group")
    names = [group_name(k) for k in range(num_groups)]
    where_before: dict[str, str] = {}
    for group, experts in (previous or {}).items():
        for eid in experts:
            where_before.setdefault(eid, group)  # first copy wins; replicas are the autoscaler's business
    index = {g: k for k, g in enumerate(names)}
    result: dict[str, list[str]] = {g: [] for g in names}
    for layer in _layers(layers):
        caps = _layer_capacity(layer, num_experts, num_groups)
        homeless = []
        for e in range(num_experts):
            eid = f"{layer}.{e}"
            k = index.get(where_before.get(eid, ""))
            if k is not None and caps[k] > 0:
                result[names[k]].append(eid)
                caps[k] -= 1
            else:
                homeless.append(eid)
        for eid in homeless:  # to the group with the most room left, lowest index on ties
            k = max(range(num_groups), key=lambda i: (caps[i], -i))
            result[names[k]].append(eid)
            caps[k] -= 1
    return {g: sorted(v, key=expert_key) for g, v in result.items()}


def moved_experts(before: Placement, after: Placement) -> int:
    """Expert copies that must be loaded somewhere they were not."""
    had = {(g, e) for g, es in before.items() for e in es}
    return sum(1 for g, es in after.items() for e in es if (g, e) not in had)


def placement_problem(placement: Placement | None, layers: int | Iterable[int], num_experts: int,
                      num_groups: int) -> str | None:
    """Why `placement` cannot serve this model over these groups, or None when it can: exactly
    the groups ExpertShard-0..G-1, known expert ids, no expert twice in one group, every expert
    hosted at least once."""
    if not placement:
        return "no placement"
    names = {group_name(k) for k in range(num_groups)}
    if set(placement) != names:
        return f"groups {sorted(placement)} are not the spec's {num_groups}"
    sparse = set(_layers(layers))
    seen = set()
    for g, experts in placement.items():
        if len(set(experts)) != len(experts):
            return f"{g} hosts an expert twice"
        for eid in experts:
            try:
                parsed = ExpertId.parse(eid)
            except ValueError as err:
                return f"{g}: {err}"
            if parsed.layer not in sparse or not 0 <= parsed.expert < num_experts:
                return f"{g}: expert {eid} is outside the model"
            seen.add(eid)
    missing = len(sparse) * num_experts - len(seen)
    return f"{missing} experts have no copy" if missing else None


def current_placement(layers: int | Iterable[int], num_experts: int, num_groups: int,
                      deployed: Placement | None) -> Placement:
    """The deployed placement while it still fits the model and the group count (a rebalanced
    placement, replicas included, survives later spec changes); otherwise an initial one that
    keeps what it can."""
    if placement_problem(deployed, layers, num_experts, num_groups) is None:
        return {g: list(v) for g, v in deployed.items()}
    return initial_placement(layers, num_experts, num_groups, deployed)
