"""The expert exchange of one layer, as the Ingress' engine calls it: `ExpertDispatcher(layer, x,
indices, weights) -> the routed experts' output`.

Per layer it reads the routing to the host once (`plan`): one small integer tensor holding what
the exchange must address (which rows go to which expert), what the shards' tier policy ranks by
(each token's first choice) and the prefetch hints (the next layers' routers' picks on these
hidden states), packed on the device and copied in one `.tolist()`. On a GPU that is the layer's
one wait for the device; the rows themselves are gathered and combined on the device around it.
Then it picks a copy of each expert by the placement (`ExpertRouter`), sends each shard group its
rows on the expert channel, all groups at once, and combines what comes back in transformers'
order. A decode step (up to `routes.SMALL` routed rows) plans with Python ints (`routes`); a
larger one keeps the rows' order on the device and reads counts only.

The dispatcher times its own parts (`ExchangeTimes`: plan, gather, wait, combine; cumulative, a
few `perf_counter` reads a layer), which `moectl profile` draws under the step's exchange.

Who is on the channel comes from the StatusBoard (`BoardMembership`), polled by the channel's
thread, so Serve's replica changes reach the exchange without a restart.
"""

from __future__ import annotations

import time

import torch

from moe_workers.model import routes
from moe_workers.model.grouped import sort_rows
from moe_workers.model.layers import combine
from moe_workers.serve.routing import ExpertRouter
from moe_workers.transport import Member, Part


class ExchangeTimes:
    """Where the exchange's time goes, summed over layers and steps (seconds): `plan` (the
    routing read to the host, the copies picked), `gather` (each group's rows gathered, on the
    host), `wait` (the channel: rows sent, until every group answered: the slowest group's
    compute and the wire), `combine` (the answers weighted back into the layer's output)."""

    PARTS = ("plan", "gather", "wait", "combine")
    __slots__ = PARTS

    def __init__(self):
        self.plan = self.gather = self.wait = self.combine = 0.0

    def as_dict(self) -> dict[str, float]:
        return {p: getattr(self, p) for p in self.PARTS}


class ExpertDispatcher:
    """One layer's expert exchange over `channel` (an `ExpertChannel`); `pick(layer, x)` is the
    dense model's router (the prefetch hints run the next layers' routers)."""

    def __init__(self, channel, pick, sparse_layers: list[int], num_experts: int):
        self.channel, self.pick = channel, pick
        self.sparse_layers, self.num_experts = list(sparse_layers), num_experts
        self.router: ExpertRouter | None = None  # set by configure() (the Ingress' reconfigure)
        self.prefetch_lookahead = 0
        self.times = ExchangeTimes()

    def configure(self, router: ExpertRouter, prefetch_lookahead: int = 0) -> None:
        self.router, self.prefetch_lookahead = router, prefetch_lookahead

    def __call__(self, layer: int, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        router = self.router
        if router is None:
            raise RuntimeError("no expert placement configured (user_config.placement)")
        times, t0 = self.times, time.perf_counter()
        plan = self.plan(layer, x, indices, weights)
        assignment = router.assign(layer, plan.counts)
        t1 = time.perf_counter()
        parts: dict[str, Part] = {}
        for group, experts in assignment.items():
            payload = plan.rows(x, experts)
            if not payload.is_cpu:  # the socket carries host rows (a device link would not)
                payload = payload.cpu()
            part_counts = [plan.counts[e] for e in experts]
            parts[group] = Part(experts, part_counts, payload, plan.hints.get(group, []),
                                [plan.first.get(e, 0) for e in experts])
            router.begin(group, sum(part_counts))
        t2 = time.perf_counter()
        try:
            results = self.channel.exchange(layer, parts)
        finally:
            for group, part in parts.items():
                router.end(group, sum(part.counts))
        t3 = time.perf_counter()
        out = plan.combine(parts, results, x, weights)
        times.plan += t1 - t0
        times.gather += t2 - t1
        times.wait += t3 - t2
        times.combine += time.perf_counter() - t3
        return out

    def plan(self, layer: int, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> "Plan":
        """The layer's routing on the host, from one read of the device."""
        ahead = [a for a in self.sparse_layers if a > layer][:self.prefetch_lookahead]
        predicted = [self.pick(a, x)[0] for a in ahead]  # (N, k) each, on the device
        if indices.numel() <= routes.SMALL:
            return _SmallPlan(self, indices, weights, predicted, ahead)
        return _LargePlan(self, indices, weights, predicted, ahead)

    def _hints(self, ahead: list[int], experts_ahead: list[list[int]]) -> dict[str, list[tuple[int, int]]]:
        """Prefetch hints per group: the experts the next layers' routers would pick."""
        hints: dict[str, list[tuple[int, int]]] = {}
        for a, experts in zip(ahead, experts_ahead):
            for e in experts:
                for group in self.router.hosts.get((a, e), []):
                    hints.setdefault(group, []).append((a, e))
        return hints


class Plan:
    counts: dict[int, int]  # expert -> its routed rows
    first: dict[int, int]  # expert -> tokens that chose it first
    hints: dict[str, list[tuple[int, int]]]


class _SmallPlan(Plan):
    """A decode step's routing in Python ints: the picks, each token's first slot and the
    predicted experts, read in one `.tolist()`."""

    def __init__(self, d: ExpertDispatcher, indices, weights, predicted, ahead):
        n, k = indices.shape
        packed = torch.cat([indices.reshape(-1), weights.argmax(1), *(p.reshape(-1) for p in predicted)])
        values = packed.tolist()  # the layer's one read of the device
        picks = [values[t * k:(t + 1) * k] for t in range(n)]
        self.route = routes.Route.of(picks)
        firsts = values[n * k:n * k + n]
        self.counts = self.route.counts()
        self.first = {}
        for row, slot in zip(picks, firsts):
            self.first[row[slot]] = self.first.get(row[slot], 0) + 1
        at, experts_ahead = n * k + n, []
        for p in predicted:
            experts_ahead.append(sorted(set(values[at:at + p.numel()])))
            at += p.numel()
        self.hints = d._hints(ahead, experts_ahead) if ahead else {}

    def rows(self, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
        return routes.gather(x, self.route, experts)

    def combine(self, parts, results, x, weights) -> torch.Tensor:
        outputs = [results[group] for group in parts]
        joined = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        order = [pair for part in parts.values() for pair in self.route.order(part.experts)]
        return routes.combine(self.route, order, joined if joined.device == x.device else joined.to(x.device),
                              weights, x.dtype)


class _LargePlan(Plan):
    """A larger step: the rows' order by expert stays on the device (`grouped.sort_rows`); the
    host reads each expert's count, first-choice count and whether a next layer picks it."""

    def __init__(self, d: ExpertDispatcher, indices, weights, predicted, ahead):
        e_count = d.num_experts
        self.k = indices.shape[1]
        self.order, _, ends = sort_rows(indices, e_count)
        first = indices.gather(1, weights.argmax(1, keepdim=True)).reshape(-1)
        counted = [ends, _count(first, e_count), *(_count(p.reshape(-1), e_count) for p in predicted)]
        values = torch.cat([c.to(torch.int64) for c in counted]).tolist()  # the layer's one read
        ends_host = values[:e_count]
        starts = [0] + ends_host[:-1]
        self.spans = {e: (s, t) for e, (s, t) in enumerate(zip(starts, ends_host)) if t > s}
        self.counts = {e: t - s for e, (s, t) in self.spans.items()}
        self.first = {e: c for e, c in enumerate(values[e_count:2 * e_count]) if c}
        experts_ahead = [[e for e, c in enumerate(values[(2 + i) * e_count:(3 + i) * e_count]) if c]
                         for i in range(len(predicted))]
        self.hints = d._hints(ahead, experts_ahead) if ahead else {}

    def _positions(self, e: int) -> torch.Tensor:
        s, t = self.spans[e]
        return self.order[s:t]  # flat (token, slot) positions of expert e's rows

    def rows(self, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
        positions = [self._positions(e) for e in experts]
        return x[(torch.cat(positions) if len(positions) > 1 else positions[0]) // self.k]

    def combine(self, parts, results, x, weights) -> torch.Tensor:
        groups, by_expert = {}, {}
        for group, part in parts.items():
            for e, out in zip(part.experts, torch.split(results[group].to(x.device), part.counts)):
                pos = self._positions(e)
                groups[e], by_expert[e] = (pos // self.k, pos % self.k), out
        return combine(x.shape[0], x.shape[1], x.dtype, groups, by_expert, weights)


def _count(values: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `values`, on their device (no read)."""
    out = torch.zeros(n, dtype=torch.int64, device=values.device)
    return out.index_add_(0, values, torch.ones_like(values, dtype=torch.int64))


class BoardMembership:
    """The expert channel's members, from the StatusBoard: the channel's membership thread calls
    it every second, and `forget`s a shard replica whose port refused (it is dead: off the board
    at once). The same poll counts this Ingress replica as live and brings what the Ingress acts
    on besides: the digest of the expert versions served now and how many Ingress replicas are
    live, handed to `on_poll(weights, live_ingress_replicas)`."""

    def __init__(self, board, replica: str, on_poll):
        self.board, self.replica, self.on_poll = board, replica, on_poll

    def __call__(self) -> tuple[list[Member], str]:
        got = self.board.members.remote(ingress=self.replica).result(timeout_s=10)
        self.on_poll(got.get("weights"), max(1, int(got.get("ingress_replicas") or 1)))
        return [Member.from_report(m) for m in got["members"]], got["token"]

    def forget(self, member: Member) -> None:
        self.board.forget.remote(member.replica, member.endpoint).result(timeout_s=10)
