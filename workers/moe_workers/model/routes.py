"""Decode-size expert routing in Python ints, and its combine in a handful of tensor ops.

A decode step routes a few tokens per layer, and then torch's cost per op (3-16 us on the CPUs
this project is measured on, whatever the tensor's size) is what a layer pays: `group_by_expert`
and `combine` in `layers` spend about 30 ops on one token. Here one `tolist()` of the router's
picks plans the routing with Python ints (which rows go to which expert, in which order), and
the combine multiplies every routed row by its weight in one op and adds each token's
contributions in ascending expert order with k - 1 adds over all tokens at once.

The values are bit-identical to `layers.combine` (transformers' order): the same products
`output * weight`, cast to the hidden dtype, then per token the same additions in the same
order (`combine` starts from zeros, and 0 + c is c).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

SMALL = 32  # routed (token, slot) pairs up to which a layer takes this path. bench/dispatch.py: it
# costs 0.3-0.4 of the tensor-op forms for one token and 0.6-0.9 for 4-16; one run at 32 tokens
# of hidden 4096 measured it slower than them, so from there on the tensor-op forms are used


@dataclass(frozen=True)
class Route:
    """One layer's routing of n tokens to k experts each."""

    n: int
    k: int
    picks: list[list[int]]  # token -> its experts, by slot
    by_expert: dict[int, list[tuple[int, int]]]  # expert -> its (token, slot) pairs, tokens ascending

    @classmethod
    def of(cls, picks: list[list[int]]) -> "Route":
        """The plan for each token's k experts, by slot (Python ints)."""
        buckets: dict[int, list[tuple[int, int]]] = {}
        for t, row in enumerate(picks):
            for s, e in enumerate(row):
                buckets.setdefault(e, []).append((t, s))
        return cls(len(picks), len(picks[0]) if picks else 0, picks, {e: buckets[e] for e in sorted(buckets)})

    def counts(self) -> dict[int, int]:
        return {e: len(pairs) for e, pairs in self.by_expert.items()}

    def order(self, experts: list[int]) -> list[tuple[int, int]]:
        """The (token, slot) pairs of `experts`' rows, concatenated in that order."""
        return [pair for e in experts for pair in self.by_expert[e]]


def route(indices: torch.Tensor) -> Route:
    """The plan for (n, k) router indices, experts ascending."""
    n, k = indices.shape
    r = Route.of(indices.tolist())
    return r if n else Route(0, k, [], {})


def _index(positions: tuple[int, ...], device: str) -> torch.Tensor:
    """An index tensor; made once for one token's few permutations (k! at most, and the router
    orders a token's picks by weight, so in practice a handful)."""
    if len(positions) <= 8:
        return _small_index(positions, device)
    return torch.tensor(positions, dtype=torch.long, device=device)


@lru_cache(maxsize=4096)
def _small_index(positions: tuple[int, ...], device: str) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.tensor(positions, dtype=torch.long, device=device)


def gather(x: torch.Tensor, r: Route, experts: list[int]) -> torch.Tensor:
    """The rows of x that `experts` take, concatenated in that order (the rows for `Route.order`)."""
    tokens = [t for e in experts for t, _ in r.by_expert[e]]
    if r.n == 1:  # one token: it, once per expert
        return x if len(tokens) == 1 else x.expand(len(tokens), x.shape[1])
    return x[torch.tensor(tokens, device=x.device)]


def combine(r: Route, order: list[tuple[int, int]], outputs: torch.Tensor, weights: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """(n, hidden) sum of weighted expert outputs per token. `outputs` row i is the output for
    the (token, slot) pair `order[i]` (every pair once); `weights` the router's (n, k) weights."""
    n, k = r.n, r.k
    at = {pair: i for i, pair in enumerate(order)}
    pairs = [(t, s) for t in range(n) for s in sorted(range(k), key=r.picks[t].__getitem__)]  # experts ascending
    rows = tuple(at[p] for p in pairs)
    slots = tuple(t * k + s for t, s in pairs)
    identity = tuple(range(n * k))
    ordered = outputs if rows == identity else outputs[_index(rows, str(outputs.device))]
    w = weights.reshape(-1, 1)
    if slots != identity:
        w = w[_index(slots, str(w.device))]
    contributions = ordered * w
    if contributions.dtype != dtype:
        contributions = contributions.to(dtype)
    first, *rest = contributions.view(n, k, -1).unbind(1)
    for c in rest:
        first = first + c
    return first
