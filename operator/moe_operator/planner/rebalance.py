"""Load-aware placement (pure, deterministic): replicate hot experts, pack copies into shard
groups so group load is balanced, keep experts often selected together in one group, and move
as few bytes as possible from the current placement.

Load model: an expert with c copies has its load split evenly over them (the ingress routes each
dispatch to the least-loaded copy). A group's load is the sum over its copies; imbalance is
max / mean group load and balancedness its inverse (1.0 is perfect).

Steps:
1. replication: each redundant slot goes to the expert with the highest load per copy (the
   D'Hondt rule, as in DeepSeek's EPLB), never two copies of one expert in one group;
2. packing: copies, heaviest first, go to a group under the capacity (the perfect share, or the
   heaviest copy when that is larger, plus a small slack): the group that already had this expert
   when it still fits (no move), else the one whose experts of the same layer are most often
   selected together with it, else the least loaded;
3. a move budget: when more copies would move than allowed, the heaviest moves are kept and the
   other copies stay where they were (new replicas beyond the budget are not added).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

Placement = dict[str, list[str]]


@dataclass(frozen=True)
class Plan:
    placement: Placement
    group_load: dict[str, float]
    balancedness: float  # mean / max group load (1.0 is perfect)
    moved_copies: int  # copies loaded where they were not
    bytes_moved: int
    copies: dict[str, int]

    @property
    def imbalance(self) -> float:
        return 1.0 / self.balancedness if self.balancedness else float("inf")


def _key(eid: str) -> tuple[int, ...]:
    return tuple(int(p) for p in eid.split("."))


def group_loads(placement: Placement, load: dict[str, float]) -> dict[str, float]:
    """Group load under the even-split model."""
    copies: dict[str, int] = defaultdict(int)
    for experts in placement.values():
        for eid in experts:
            copies[eid] += 1
    return {g: sum(load.get(e, 0.0) / copies[e] for e in experts) for g, experts in placement.items()}


def balancedness(placement: Placement, load: dict[str, float]) -> float:
    loads = list(group_loads(placement, load).values())
    top = max(loads, default=0.0)
    return (sum(loads) / len(loads)) / top if top > 0 else 1.0


def lower_bound_balancedness(load: dict[str, float], num_groups: int, copies: dict[str, int] | None = None) -> float:
    """Best possible: perfect balance, unless the heaviest copy alone exceeds a group's share."""
    total = sum(load.values())
    if total <= 0:
        return 1.0
    heaviest = max(load[e] / (copies or {}).get(e, 1) for e in load)
    return (total / num_groups) / max(total / num_groups, heaviest)


def replicate(load: dict[str, float], num_groups: int, redundant_slots: int) -> dict[str, int]:
    """Copies per expert: one each, plus redundant slots to the highest load per copy."""
    copies = {e: 1 for e in load}
    for _ in range(redundant_slots):
        candidates = [e for e in load if copies[e] < num_groups and load[e] > 0]
        if not candidates:
            break
        best = max(candidates, key=lambda e: (load[e] / copies[e], tuple(-x for x in _key(e))))
        copies[best] += 1
    return copies


def plan(load: dict[str, float], current: Placement, expert_bytes: int, redundant_slots: int = 0,
         co_selection: dict[tuple[str, str], float] | None = None, max_moves: int | None = None,
         slack: float = 0.02) -> Plan:
    """A placement for these loads over the groups of `current` (which must host every expert)."""
    groups = sorted(current, key=lambda g: (len(g), g))
    if not groups:
        raise ValueError("no shard groups")
    experts = sorted({e for es in current.values() for e in es} | set(load), key=_key)
    load = {e: float(load.get(e, 0.0)) for e in experts}
    copies = replicate(load, len(groups), redundant_slots)
    had: dict[str, list[str]] = defaultdict(list)
    for g in groups:
        for e in current.get(g, []):
            had[e].append(g)
    affinity: dict[str, dict[str, float]] = defaultdict(dict)
    for (a, b), w in (co_selection or {}).items():
        affinity[a][b] = affinity[a].get(b, 0.0) + w
        affinity[b][a] = affinity[b].get(a, 0.0) + w

    items = [(load[e] / copies[e], e, i) for e in experts for i in range(copies[e])]
    items.sort(key=lambda t: (-t[0], _key(t[1]), t[2]))
    total = sum(load.values())
    heaviest = items[0][0] if items else 0.0
    cap = max(total / len(groups), heaviest) * (1 + slack)
    placed: dict[str, list[str]] = {g: [] for g in groups}
    gload = {g: 0.0 for g in groups}
    where: dict[str, set[str]] = defaultdict(set)
    placed_set: set[str] = set()

    def next_item() -> tuple[float, str, int]:
        # heaviest first; among copies of (nearly) equal weight, the one most often selected
        # together with experts already placed goes next, so it can join them
        top = items[0][0]
        best, best_i = None, 0
        for i, it in enumerate(items):
            if it[0] < top * 0.99 - 1e-12:
                break
            pull = sum(affinity[it[1]].get(o, 0.0) for o in placed_set) if affinity else 0.0
            if best is None or pull > best:
                best, best_i = pull, i
            if not affinity:
                break
        return items.pop(best_i)

    while items:
        w, e, _ = next_item()
        free = [g for g in groups if g not in where[e]]
        fits = [g for g in free if gload[g] + w <= cap + 1e-12]
        layer = e.split(".")[0]

        def pull(g: str) -> float:
            return sum(affinity[e].get(o, 0.0) for o in placed[g] if o.split(".")[0] == layer) if affinity else 0.0

        sticky = [g for g in had[e] if g in fits]
        best_pull = max((pull(g) for g in fits), default=0.0)
        if sticky and max(pull(g) for g in sticky) >= best_pull:
            target = min(sticky, key=lambda g: (-pull(g), gload[g], groups.index(g)))  # no move
        elif fits:
            target = min(fits, key=lambda g: (-pull(g), gload[g], groups.index(g)))
        else:
            target = min(free, key=lambda g: (gload[g], groups.index(g)))
        placed[target].append(e)
        gload[target] += w
        where[e].add(target)
        placed_set.add(e)

    if max_moves is not None:
        placed = _within_move_budget(placed, current, load, max_moves)
    final = {g: sorted(v, key=_key) for g, v in placed.items()}
    final_copies: dict[str, int] = defaultdict(int)
    for es in final.values():
        for e in es:
            final_copies[e] += 1
    moved = _moved(current, final)
    return Plan(final, group_loads(final, load), balancedness(final, load), moved, moved * expert_bytes,
                dict(final_copies))


def _moved(before: Placement, after: Placement) -> int:
    had = {(g, e) for g, es in before.items() for e in es}
    return sum(1 for g, es in after.items() for e in es if (g, e) not in had)


def _within_move_budget(target: Placement, current: Placement, load: dict[str, float], max_moves: int) -> Placement:
    """Keep the `max_moves` heaviest new (group, expert) copies of the target; every other
    expert keeps its current copies (and so stays served)."""
    had = {(g, e) for g, es in current.items() for e in es}
    new = [(g, e) for g, es in target.items() for e in es if (g, e) not in had]
    if len(new) <= max_moves:
        return target
    copies_target: dict[str, int] = defaultdict(int)
    for es in target.values():
        for e in es:
            copies_target[e] += 1
    new.sort(key=lambda ge: (-load.get(ge[1], 0.0) / copies_target[ge[1]], _key(ge[1]), ge[0]))
    accepted = set(new[:max_moves])
    moved_experts = {e for _, e in accepted}
    out: dict[str, list[str]] = {g: [] for g in target}
    for g, es in target.items():
        for e in es:
            # an expert whose moves are accepted takes its target copies that already existed or
            # were accepted; the others stay exactly as they are now
            if e in moved_experts and ((g, e) in had or (g, e) in accepted):
                out[g].append(e)
    for g, es in current.items():
        for e in es:
            if e not in moved_experts:
                out.setdefault(g, []).append(e)
    return out
