"""Load-aware placement (pure, deterministic): per layer, replicate the hottest experts and pack
the copies into equal expert slots per shard group so that layer's busiest group carries as
little as possible, moving few copies from where they are.

Why per layer: the ingress waits, layer by layer, for the slowest shard group, so a step costs
the sum over layers of each layer's busiest group, not the busiest group summed over layers.
Load model (see `planner.layer`): an expert with c copies has its load split evenly over them.
Balancedness of a layer is its mean group load / its busiest group's (1.0 is perfect); a plan's
`balancedness` is the mean over layers and `imbalance` the mean of busiest / mean.

Memory: every group has `slots_per_group(E, G, spare)` slots in each layer (E experts and up to
`redundant_slots` spare copies per layer, divided by the G groups), so every group's replicas hold
the same number of experts; a plan never has more copies in a layer than E + redundant_slots.

Per layer:
1. replication: copies per expert by the D'Hondt rule (each spare slot to the highest load per
   copy, as DeepSeek's EPLB);
2. packing: heaviest copy first into the least-loaded group with a free slot (among nearly equally
   loaded groups, the one whose experts are most often selected together with it), the groups
   then renamed to keep the most copies where they were; then local improvement (`layer.improve`:
   moves, swaps, and copies handed from one expert to another where the slots make the
   D'Hondt copies pack badly);
3. stickiness: copies go back where they were (a move, or a swap with a copy of about the same
   load) while the layer's busiest group stays within `TOLERANCE` of what packing reached; and a
   layer already that good keeps its placement.
With a move budget (`max_moves`, the autoscaler's maxMovesPerStep): starting from the current
placement, the steps that lower a layer's busiest group most per copy moved (`layer.improve`'s
steps, over all layers), until the budget is spent; used when packing would move more, or when
the steps end better balanced (they may leave a spare slot empty where D'Hondt fills it).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

from moe_operator.planner.layer import LayerState, feasible, improve, slots_per_group
from moe_workers.expert_ids import expert_key, layer_of

Placement = dict[str, list[str]]
TOLERANCE = 0.003
NEAR_BOUND = 0.001  # packing stops improving a layer this close to its lower bound
FAR_FROM_BOUND = 0.02  # further than this from the bound, fewer spare copies are tried too  # a sticky layer may be this much less balanced than the best candidate


@dataclass(frozen=True)
class Plan:
    placement: Placement
    group_load: dict[str, float]  # summed over layers
    balancedness: float  # mean over layers of mean / max group load (1.0 is perfect)
    moved_copies: int  # copies loaded where they were not
    bytes_moved: int
    copies: dict[str, int]
    layer_balancedness: dict[int, float]
    slots_per_group: int  # per layer (the largest over layers)

    @property
    def imbalance(self) -> float:
        """Mean over layers of busiest / mean group load: what status.imbalance measures."""
        values = [1.0 / b if b else float("inf") for b in self.layer_balancedness.values()]
        return sum(values) / len(values) if values else 1.0

    @property
    def worst_layer(self) -> tuple[int, float]:
        """(layer, balancedness) of the least balanced layer."""
        return min(self.layer_balancedness.items(), key=lambda kv: (kv[1], kv[0]), default=(0, 1.0))


def by_layer(placement: Placement, load: dict[str, float]) -> dict[int, tuple[dict[str, set[str]], dict[str, float]]]:
    """layer -> ({group: experts of that layer}, {expert: load})"""
    out: dict[int, tuple[dict[str, set[str]], dict[str, float]]] = {}
    experts = {e for es in placement.values() for e in es} | set(load)
    for e in experts:
        hosts, loads = out.setdefault(layer_of(e), ({g: set() for g in placement}, {}))
        loads[e] = float(load.get(e, 0.0))
    for g, es in placement.items():
        for e in es:
            out[layer_of(e)][0][g].add(e)
    return out


def layer_balancedness(placement: Placement, load: dict[str, float]) -> dict[int, float]:
    """Per layer: mean / max group load under the even-split model."""
    out = {}
    for layer, (hosts, loads) in by_layer(placement, load).items():
        groups = sorted(hosts)
        state = LayerState(groups, [set(hosts[g]) for g in groups], loads, capacity=10**9, max_copies=10**9)
        out[layer] = state.balancedness()
    return out


def balancedness(placement: Placement, load: dict[str, float]) -> float:
    """Mean over layers of each layer's mean / max group load."""
    per = layer_balancedness(placement, load)
    return sum(per.values()) / len(per) if per else 1.0


def group_loads(placement: Placement, load: dict[str, float]) -> dict[str, float]:
    """Group load under the even-split model, summed over layers."""
    copies: dict[str, int] = defaultdict(int)
    for experts in placement.values():
        for eid in experts:
            copies[eid] += 1
    return {g: sum(load.get(e, 0.0) / copies[e] for e in experts) for g, experts in placement.items()}


def replicate(load: dict[str, float], num_groups: int, redundant_slots: int) -> dict[str, int]:
    """Copies per expert of one layer: one each, plus spare slots to the highest load per copy
    (at most one copy per group)."""
    copies = {e: 1 for e in load}
    heap = [(-load[e], tuple(expert_key(e)), e) for e in load if load[e] > 0 and num_groups > 1]
    heapq.heapify(heap)
    for _ in range(redundant_slots):
        if not heap:
            break
        _, k, e = heapq.heappop(heap)
        copies[e] += 1
        if copies[e] < num_groups:
            heapq.heappush(heap, (-load[e] / copies[e], k, e))
    return copies


def lower_bound_balancedness(load: dict[str, float], num_groups: int, redundant_slots: int = 0) -> dict[int, float]:
    """Per layer, the best any placement can do: perfect balance, unless the heaviest copy alone
    (after the spare slots went to the highest loads per copy, which minimises it) exceeds a
    group's share."""
    out = {}
    for layer, (_, loads) in by_layer({}, load).items():
        total = sum(loads.values())
        if total <= 0:
            out[layer] = 1.0
            continue
        copies = replicate(loads, num_groups, _spare(len(loads), num_groups, redundant_slots))
        heaviest = max(loads[e] / copies[e] for e in loads)
        out[layer] = (total / num_groups) / max(total / num_groups, heaviest)
    return out


def _spare(num_experts: int, num_groups: int, redundant_slots: int) -> int:
    """Spare copies that fit a layer's slots (all of them unless the slots run out)."""
    return min(redundant_slots, num_groups * slots_per_group(num_experts, num_groups, redundant_slots) - num_experts)


def _least_loaded(e: str, free: list[int], gload: list[float], hosts: list[set[str]], near: float,
                  affinity: dict[str, dict[str, float]] | None) -> int:
    """The least-loaded of `free`; among those within `near` of it, the one whose experts are most
    often selected together with `e`."""
    least = min(gload[g] for g in free)
    if not affinity or not affinity.get(e):
        return min(free, key=lambda g: (gload[g], g))
    close = [g for g in free if gload[g] <= least + near]
    return min(close, key=lambda g: (-sum(affinity[e].get(o, 0.0) for o in hosts[g]), gload[g], g))


def _pack(state: LayerState, copies: dict[str, int], affinity: dict[str, dict[str, float]] | None) -> None:
    """Place `copies` into the (empty) state: heaviest copy first, into the least-loaded group
    with a free slot; among groups within 1% of a fair share of the least loaded, the one whose
    experts are most often selected together with it."""
    G = len(state.hosts)
    state.copies = dict(copies)
    units = sorted(copies, key=lambda e: (-state.load[e] / copies[e], expert_key(e)))
    near = 0.01 * sum(state.load.values()) / G
    gload = [0.0] * G
    rooms = [state.capacity] * G
    remaining = {e: copies[e] for e in units}
    for e in units:
        w = state.load[e] / copies[e]
        remaining.pop(e)
        chosen: list[int] = []
        for _ in range(copies[e]):
            free = [g for g in range(G) if rooms[g] > 0 and g not in chosen]
            chosen.append(_least_loaded(e, free, gload, state.hosts, near, affinity))
        after = [r - (1 if g in chosen else 0) for g, r in enumerate(rooms)]
        if any(c > 1 for c in remaining.values()) and not feasible(list(remaining.values()), after):
            # the groups with the most free slots keep the rest placeable (Ryser)
            chosen = sorted(range(G), key=lambda g: (-rooms[g], gload[g], g))[: copies[e]]
        for g in chosen:
            state.hosts[g].add(e)
            gload[g] += w
            rooms[g] -= 1
    state._recompute()


def _pack_sticky(state: LayerState, copies: dict[str, int], limit: float,
                 affinity: dict[str, dict[str, float]] | None) -> None:
    """Keep what can stay, place the rest: each expert keeps up to its new number of copies where
    it was (in its least-loaded old groups); a group above `limit` or its slots gives up copies
    (the lightest that brings it under, else its heaviest); then the copies without a group go,
    heaviest first, to the least-loaded group with a free slot (co-selection breaking near-ties, as
    in `_pack`)."""
    G = len(state.hosts)
    near = 0.01 * sum(state.load.values()) / G
    state.copies = dict(copies)
    had: dict[str, list[int]] = defaultdict(list)
    for g, e in sorted(state.original, key=lambda t: (t[0], expert_key(t[1]))):
        had[e].append(g)
    weight = {e: state.load[e] / copies[e] for e in copies}
    gload = [0.0] * G
    for e in sorted(copies, key=lambda e: (-weight[e], expert_key(e))):
        for g in sorted(had[e], key=lambda g: (gload[g], g))[: copies[e]]:
            state.hosts[g].add(e)
            gload[g] += weight[e]
    kept = sum(gload)
    target = limit - max(0.0, sum(state.load.values()) - kept) / G  # leave room for what is not placed yet
    for g in range(G):
        while len(state.hosts[g]) > state.capacity or gload[g] > target + 1e-12:
            excess = gload[g] - target
            mine = sorted(state.hosts[g], key=lambda e: (weight[e], expert_key(e)))
            if len(state.hosts[g]) > state.capacity:
                out = mine[0] if excess <= 0 else next((e for e in mine if weight[e] >= excess), mine[-1])
            else:
                out = next((e for e in mine if weight[e] >= excess), mine[-1])
            state.hosts[g].discard(out)
            gload[g] -= weight[out]
    placed: dict[str, int] = defaultdict(int)
    for h in state.hosts:
        for e in h:
            placed[e] += 1
    remaining = {e: copies[e] - placed[e] for e in copies if copies[e] > placed[e]}
    rooms = [state.capacity - len(h) for h in state.hosts]
    for e in sorted(remaining, key=lambda e: (-weight[e], expert_key(e))):
        need = remaining.pop(e)
        free = [g for g in range(G) if rooms[g] > 0 and e not in state.hosts[g]]
        chosen = sorted(free, key=lambda g: (gload[g], g))[:need]
        if need == 1 and free:
            chosen = [_least_loaded(e, free, gload, state.hosts, near, affinity)]
        after = [r - (1 if g in chosen else 0) for g, r in enumerate(rooms)]
        if len(chosen) < need or not feasible(list(remaining.values()), after):
            chosen = sorted(free, key=lambda g: (-rooms[g], gload[g], g))[:need]
        for g in chosen:
            state.hosts[g].add(e)
            gload[g] += weight[e]
            rooms[g] -= 1
    state._recompute()


def _restick(state: LayerState, limit: float) -> None:
    """Send copies back to where they were while no group goes above `limit`: a move when the old
    group has a free slot, else a swap with a copy there of about the same load; each change
    lowers the copies moved."""
    G = len(state.hosts)
    home: dict[str, list[int]] = defaultdict(list)
    for g, e in sorted(state.original, key=lambda t: (t[0], expert_key(t[1]))):
        home[e].append(g)

    def new(g: int, e: str) -> int:
        return 0 if (g, e) in state.original else 1

    for _ in range(4):
        changed = False
        for g in range(G):
            for e in sorted(state.hosts[g], key=lambda x: (-state.weight(x), expert_key(x))):
                if (g, e) in state.original or e not in state.hosts[g]:
                    continue
                w = state.weight(e)
                for h in home[e]:
                    if e in state.hosts[h]:
                        continue
                    if len(state.hosts[h]) < state.capacity and state.gload[h] + w <= limit:
                        state.apply(("move", e, g, h))
                        changed = True
                        break
                    best = None
                    for f in state.hosts[h]:
                        if f in state.hosts[g]:
                            continue
                        wf = state.weight(f)
                        if state.gload[h] - wf + w > limit or state.gload[g] - w + wf > limit:
                            continue
                        saved = 1 - new(h, e) + new(h, f) - new(g, f)
                        if saved > 0:
                            k = (-saved, abs(wf - w), expert_key(f))
                            if best is None or k < best[0]:
                                best = (k, f)
                    if best is not None:
                        state.apply(("swap", e, g, best[1], h))
                        changed = True
                        break
        if not changed:
            return


def _rename_to_current(state: LayerState) -> None:
    """Groups are interchangeable within a layer: give each packed group the name of the current
    group it shares the most experts with (greedy on the overlap)."""
    G = len(state.hosts)
    before = [{e for (g, e) in state.original if g == k} for k in range(G)]
    pairs = sorted(((len(state.hosts[a] & before[b]), a, b) for a in range(G) for b in range(G)),
                   key=lambda t: (-t[0], t[1], t[2]))
    to: dict[int, int] = {}
    used: set[int] = set()
    for _, a, b in pairs:
        if a not in to and b not in used:
            to[a] = b
            used.add(b)
    hosts = [set() for _ in range(G)]
    for a, b in to.items():
        hosts[b] = state.hosts[a]
    state.hosts = hosts
    state._recompute()


def _layer_states(placement: Placement, load: dict[str, float], redundant_slots: int
                  ) -> tuple[list[str], dict[int, LayerState]]:
    groups = sorted(placement, key=lambda g: (len(g), g))
    states = {}
    for layer, (hosts, loads) in sorted(by_layer(placement, load).items()):
        cap = slots_per_group(len(loads), len(groups), redundant_slots)
        original = {(k, e) for k, g in enumerate(groups) for e in hosts[g]}
        states[layer] = LayerState(groups, [set(hosts[g]) for g in groups], loads, cap,
                                   len(loads) + _spare(len(loads), len(groups), redundant_slots), original)
    return groups, states


def _fresh(base: LayerState) -> LayerState:
    return LayerState(base.groups, [set() for _ in base.hosts], base.load, base.capacity, base.max_copies, base.original)


def _plan_layer(current: LayerState, affinity: dict[str, dict[str, float]] | None) -> LayerState:
    copies = replicate(current.load, len(current.hosts), current.max_copies - len(current.load))
    packed = _fresh(current)
    _pack(packed, copies, affinity)
    _rename_to_current(packed)
    G = len(current.hosts)
    bound = max(sum(current.load.values()) / G, max((current.load[e] / copies[e] for e in copies), default=0.0))
    improve(packed, change_copies=True, until=bound * (1 + NEAR_BOUND))
    spare = current.max_copies - len(current.load)
    if packed.busiest() > bound * (1 + FAR_FROM_BOUND) and spare > 1:
        # the slots, not the copies, limit this layer (few slots per group): fewer spare copies can
        # pack better, as a copy of a hot expert leaves its group little room for anything else
        for fewer in sorted({spare * k // 8 for k in (7, 6, 5, 4)}, reverse=True):
            other = _fresh(current)
            _pack(other, replicate(current.load, G, fewer), affinity)
            _rename_to_current(other)
            improve(other, change_copies=True, until=bound * (1 + NEAR_BOUND))
            if other.busiest() < packed.busiest() * (1 - 1e-9):
                packed = other
    limit = packed.busiest() * (1 + TOLERANCE) + 1e-12
    kept = LayerState(current.groups, [set(h) for h in current.hosts], current.load, current.capacity,
                      current.max_copies, current.original)
    _repair(kept)
    _restick(packed, limit)
    options = [packed]
    if all(len(h) <= kept.capacity for h in kept.hosts) and kept.busiest() <= limit:
        options.append(kept)
    copies = {e: c for e, c in packed.copies.items() if c > 0}  # as packing and improving left them
    sticky = _fresh(current)
    _pack_sticky(sticky, copies, limit, affinity)
    if sticky.total_copies() == sum(copies.values()):  # else a copy found no group: not an option
        improve(sticky, until=limit)
        _restick(sticky, limit)
        if sticky.busiest() <= limit:
            options.append(sticky)
    return min(options, key=lambda s: (s.moved(), s.busiest()))


def _repair(state: LayerState, budget: int | None = None) -> int:
    """A placement made under other limits (fewer slots or spare copies now): surplus copies are
    dropped, the lightest first, from the fullest groups (nothing is loaded for this); a group
    still above its slots then moves its lightest experts to the least-loaded groups with a free
    slot, within `budget` moves. Returns the copies moved."""
    spent = 0
    while True:
        over = [g for g, h in enumerate(state.hosts) if len(h) > state.capacity]
        surplus = state.total_copies() > state.max_copies
        if not over and not surplus:
            return spent
        options = [(state.weight(e), -len(state.hosts[g]), g, e) for g in over for e in state.hosts[g]
                   if state.copies[e] >= 2]
        if not options and surplus:
            options = [(state.weight(e), -len(h), g, e) for g, h in enumerate(state.hosts) for e in h
                       if state.copies[e] >= 2]
        if options:
            _, _, g, e = min(options, key=lambda t: (t[0], t[1], t[2], expert_key(t[3])))
            state.apply(("drop", e, g))
            continue
        if not over or (budget is not None and spent >= budget):
            return spent
        g = over[0]
        e = min(state.hosts[g], key=lambda x: (state.weight(x), expert_key(x)))
        free = [h for h, hs in enumerate(state.hosts) if len(hs) < state.capacity and e not in hs]
        if not free:
            return spent
        state.apply(("move", e, g, min(free, key=lambda h: (state.gload[h], h))))
        spent += 1


def _within_budget(states: dict[int, LayerState], max_moves: int) -> None:
    """From the current placement: over all layers, the step that lowers a layer's busiest group
    most per copy moved, until `max_moves` copies moved or no step helps."""
    spent = 0
    for s in states.values():
        spent += _repair(s, max_moves - spent)
    cache: dict[int, tuple | None] = {}
    while True:
        left = max_moves - spent
        for layer, s in states.items():
            if layer not in cache or (cache[layer] is not None and cache[layer][1] > left):
                cache[layer] = s.best_step(change_copies=True, budget=left)
        options = [(v[0], -layer, layer) for layer, v in cache.items() if v is not None]
        if not options:
            return
        _, _, layer = max(options)
        _, cost, step = cache.pop(layer)
        states[layer].apply(step)
        spent += cost


def plan(load: dict[str, float], current: Placement, expert_bytes: int, redundant_slots: int = 0,
         co_selection: dict[tuple[str, str], float] | None = None, max_moves: int | None = None) -> Plan:
    """A placement for these loads over the groups of `current` (which must host every expert);
    `redundant_slots` spare copies per layer; at most `max_moves` copies loaded somewhere new."""
    if not current:
        raise ValueError("no shard groups")
    affinity: dict[str, dict[str, float]] = defaultdict(dict)
    for (a, b), w in (co_selection or {}).items():
        affinity[a][b] = affinity[a].get(b, 0.0) + w
        affinity[b][a] = affinity[b].get(a, 0.0) + w
    groups, states = _layer_states(current, load, redundant_slots)
    # each layer packed afresh; with a budget, packing stops once its layers so far move more
    # copies than the budget allows (it can no longer be taken: at DeepSeek-V3's 58 x 256 experts
    # this spares seconds a pass)
    planned: dict[int, LayerState] | None = {}
    packed_moves = 0
    for layer, s in states.items():
        planned[layer] = _plan_layer(s, affinity or None)
        packed_moves += planned[layer].moved()
        if max_moves is not None and packed_moves > max_moves:
            planned = None
            break
    if max_moves is not None:
        # step by step from where it is, within the budget; also kept when it reaches a better
        # placement than packing (steps can leave spare copies unused where packing cannot)
        _within_budget(states, max_moves)
        stepped_busiest = sum(s.busiest() for s in states.values())
        if planned is None or stepped_busiest < sum(s.busiest() for s in planned.values()) * (1 - 1e-9):
            planned = states
    placement: Placement = {g: [] for g in groups}
    for layer in sorted(planned):
        for g, es in planned[layer].placement().items():
            placement[g].extend(es)
    copies: dict[str, int] = defaultdict(int)
    for es in placement.values():
        for e in es:
            copies[e] += 1
    moved = sum(s.moved() for s in planned.values())
    per_layer = {layer: s.balancedness() for layer, s in planned.items()}
    return Plan(placement, group_loads(placement, load), sum(per_layer.values()) / len(per_layer) if per_layer else 1.0,
                moved, moved * expert_bytes, dict(copies), per_layer,
                max((s.capacity for s in planned.values()), default=0))

