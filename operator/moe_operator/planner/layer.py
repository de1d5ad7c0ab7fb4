"""One MoE layer of a placement, and the steps that balance it (pure, deterministic).

A step of a decode waits, layer by layer, for the busiest shard group of that layer; so a layer
is balanced on its own. Load model: an expert with c copies has its load split evenly over them
(the ingress routes each dispatch to the least-loaded copy). Every group has `capacity` expert
slots in the layer (its memory budget), and the layer has at most `max_copies` copies in all
(its experts plus the spare copies).

`LayerState` holds which group hosts which expert; `improve` applies, one at a time, the step
that lowers the layer's busiest group the most per copy loaded somewhere new: move a copy, swap
two copies, and where copies may change, add a replica, drop one, or replace one expert's spare
copy by another's. Each accepted step strictly lowers (busiest load, groups at that load), so the
search ends.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from moe_workers.expert_ids import expert_key

EPS = 1e-9
SWAP_GROUPS = 8  # swaps are tried with this many of the least-loaded groups


def slots_per_group(num_experts: int, num_groups: int, spare: int) -> int:
    """Slots every group has in a layer: (experts + spare) / groups, and never fewer than it
    takes to host every expert once."""
    return max(-(-num_experts // num_groups), (num_experts + spare) // num_groups)


def feasible(demands: list[int], rooms: list[int]) -> bool:
    """Whether experts needing `demands` copies, each copy in a different group, fit into groups
    with `rooms` free slots (Gale-Ryser: for every a, the a largest demands fit into
    sum_g min(room_g, a))."""
    d = sorted((x for x in demands if x > 0), reverse=True)
    if not d:
        return True
    if d[0] == 1:
        return len(d) <= sum(rooms)
    if d[0] > sum(1 for r in rooms if r > 0) or sum(d) > sum(rooms):
        return False
    top = 0
    for a, x in enumerate(d[: max(rooms)], start=1):
        top += x
        if top > sum(min(r, a) for r in rooms):
            return False
    return True


@dataclass
class LayerState:
    groups: list[str]
    hosts: list[set[str]]  # per group (same order as groups): expert ids of this layer
    load: dict[str, float]  # every expert of the layer
    capacity: int
    max_copies: int
    original: set[tuple[int, str]] = field(default_factory=set)  # (group index, expert) before planning
    copies: dict[str, int] = field(init=False)
    _order: dict[str, int] = field(init=False, repr=False)
    gload: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self._order = {e: i for i, e in enumerate(sorted(self.load, key=expert_key))}
        self.copies = {e: 0 for e in self.load}
        for h in self.hosts:
            for e in h:
                self.copies[e] = self.copies.get(e, 0) + 1
        self._recompute()

    def _recompute(self) -> None:
        self.gload = [sum(self.weight(e) for e in h) for h in self.hosts]

    def weight(self, e: str) -> float:
        return self.load.get(e, 0.0) / self.copies[e] if self.copies.get(e) else 0.0

    def total_copies(self) -> int:
        return sum(len(h) for h in self.hosts)

    def busiest(self) -> float:
        return max(self.gload, default=0.0)

    def balancedness(self) -> float:
        top = self.busiest()
        return (sum(self.gload) / len(self.gload)) / top if top > EPS else 1.0

    def moved(self) -> int:
        return sum(1 for g, h in enumerate(self.hosts) for e in h if (g, e) not in self.original)

    def placement(self) -> dict[str, list[str]]:
        return {name: sorted(h, key=expert_key) for name, h in zip(self.groups, self.hosts)}

    # --- steps -------------------------------------------------------------------------------
    def _cost(self, adds: list[tuple[int, str]]) -> int:
        return sum(1 for a in adds if a not in self.original)

    def _score(self, deltas: dict[int, float], order: list[int], top: float, at_top: int
               ) -> tuple[float, int] | None:
        """(busiest load, groups at it) after adding `deltas`, or None when that is no better."""
        gload = self.gload
        best = 0.0
        for g in order:
            if g not in deltas:
                best = gload[g]
                break
        for g, d in deltas.items():
            if gload[g] + d > best:
                best = gload[g] + d
        tol = EPS * max(1.0, top)
        if best < top - tol:
            return best, 0  # strictly lower: how many groups share it no longer matters
        if best > top + tol:
            return None
        n = sum(1 for g, d in deltas.items() if gload[g] + d >= best - tol)
        for g in order:
            if gload[g] < best - tol:
                break
            if g not in deltas:
                n += 1
        return (best, n) if n < at_top else None

    def candidates(self, change_copies: bool):
        """Improving steps as ((busiest load, groups at it) after, before, groups at it before,
        cost, step)."""
        G = len(self.hosts)
        order = sorted(range(G), key=lambda g: -self.gload[g])
        if not order:
            return
        top = self.gload[order[0]]
        if top <= EPS:
            return
        tol = EPS * max(1.0, top)
        tops = [g for g in order if self.gload[g] >= top - tol]
        n_top = len(tops)
        ascending = order[::-1]
        lightest = [g for g in ascending[:SWAP_GROUPS] if self.gload[g] < top - tol]
        spare_left = self.max_copies - self.total_copies()
        key = self._order
        listed = {g: sorted(self.hosts[g], key=key.__getitem__) for g in set(tops) | set(lightest)}
        wt = {x: self.weight(x) for g in listed for x in listed[g]}
        by_weight = {g: sorted((wt[x], key[x], x) for x in listed[g]) for g in lightest}
        in_order: dict[int, list[str]] = {}  # a group's experts in id order, sorted once a call

        def ordered(g: int) -> list[str]:
            if g not in in_order:
                in_order[g] = listed[g] if g in listed else sorted(self.hosts[g], key=key.__getitem__)
            return in_order[g]

        def weight(x: str) -> float:
            if x not in wt:
                wt[x] = self.weight(x)
            return wt[x]

        for gm in tops:
            for e in listed[gm]:
                w = wt[e]
                for g in ascending:  # move
                    if self.gload[g] + w >= top - tol:
                        break
                    if g != gm and e not in self.hosts[g] and len(self.hosts[g]) < self.capacity:
                        s = self._score({gm: -w, g: w}, order, top, n_top)
                        if s:
                            yield s, top, n_top, self._cost([(g, e)]), ("move", e, gm, g)
                for g in lightest:  # swap with a lighter copy, the one that evens the two best
                    if g == gm or e in self.hosts[g]:
                        continue
                    gap = top - self.gload[g]
                    ws = by_weight[g]
                    i = bisect.bisect_left(ws, (w - gap / 2, -1))
                    for wf, _, f in ws[max(0, i - 2): i + 2]:
                        if f in self.hosts[gm] or wf >= w or w - wf >= gap:
                            continue
                        s = self._score({gm: wf - w, g: w - wf}, order, top, n_top)
                        if s:
                            yield s, top, n_top, self._cost([(g, e), (gm, f)]), ("swap", e, gm, f, g)
                if not change_copies:
                    continue
                if self.copies[e] >= 2:  # drop this copy
                    w2 = self.load[e] / (self.copies[e] - 1)
                    d = {h: w2 - w for h in range(G) if e in self.hosts[h] and h != gm}
                    d[gm] = -w
                    s = self._score(d, order, top, n_top)
                    if s:
                        yield s, top, n_top, 0, ("drop", e, gm)
                if self.copies[e] >= G:
                    continue
                w2 = self.load[e] / (self.copies[e] + 1)
                mine = {h: w2 - w for h in range(G) if e in self.hosts[h]}
                for g in ascending:
                    if self.gload[g] + w2 >= top - tol:
                        break
                    if e in self.hosts[g]:
                        continue
                    if spare_left > 0 and len(self.hosts[g]) < self.capacity:  # replicate
                        d = dict(mine)
                        d[g] = w2
                        s = self._score(d, order, top, n_top)
                        if s:
                            yield s, top, n_top, self._cost([(g, e)]), ("replicate", e, g)
                    for f in ordered(g):  # replace a spare copy in g
                        if self.copies[f] < 2:
                            continue
                        wf, wf2 = weight(f), self.load[f] / (self.copies[f] - 1)
                        d = dict(mine)
                        for h in range(G):
                            if h != g and f in self.hosts[h]:
                                d[h] = d.get(h, 0.0) + wf2 - wf
                        d[g] = w2 - wf
                        s = self._score(d, order, top, n_top)
                        if s:
                            yield s, top, n_top, self._cost([(g, e)]), ("replace", e, f, g)

    def best_step(self, change_copies: bool, budget: int | None):
        """The step with the most gain per cost within `budget`: (gain, cost, step) or None."""
        best = None
        for (new_top, new_n), top, n, cost, step in self.candidates(change_copies):
            if budget is not None and cost > budget:
                continue
            gain = top - new_top
            key = (gain / max(cost, 0.5), (n - new_n) / max(cost, 0.5), -cost)
            if best is None or key > best[0]:
                best = (key, gain, cost, step)
        return None if best is None else (best[0], best[2], best[3])

    def apply(self, step: tuple) -> None:
        kind, e = step[0], step[1]
        touched = {g for g, h in enumerate(self.hosts) if e in h}
        if kind == "move":
            _, e, a, b = step
            self.hosts[a].discard(e)
            self.hosts[b].add(e)
            touched |= {a, b}
        elif kind == "swap":
            _, e, a, f, b = step
            self.hosts[a].discard(e)
            self.hosts[b].discard(f)
            self.hosts[a].add(f)
            self.hosts[b].add(e)
            touched |= {a, b}
        elif kind == "replicate":
            _, e, g = step
            self.hosts[g].add(e)
            self.copies[e] += 1
            touched.add(g)
        elif kind == "drop":
            _, e, g = step
            self.hosts[g].discard(e)
            self.copies[e] -= 1
        elif kind == "replace":
            _, e, f, g = step
            touched |= {h for h, hs in enumerate(self.hosts) if f in hs}
            self.hosts[g].discard(f)
            self.copies[f] -= 1
            self.hosts[g].add(e)
            self.copies[e] += 1
            touched.add(g)
        for g in touched:
            self.gload[g] = sum(self.weight(x) for x in self.hosts[g])


def improve(layer: LayerState, change_copies: bool = False, budget: int | None = None, max_steps: int = 10_000,
            until: float = 0.0) -> int:
    """Apply improving steps until none is left (or the budget of new copies is spent); returns
    the copies loaded somewhere new. Stops early once the busiest group carries at most `until`."""
    spent = 0
    for _ in range(max_steps):
        if layer.busiest() <= until:
            break
        found = layer.best_step(change_copies, None if budget is None else budget - spent)
        if found is None:
            break
        _, cost, step = found
        layer.apply(step)
        spent += cost
    return spent
