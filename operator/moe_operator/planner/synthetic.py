"""Synthetic expert loads with a known shape, for the planner's benchmark and tests."""

from __future__ import annotations

import random


def zipf_load(layers: int, experts: int, s: float, seed: int) -> dict[str, float]:
    """Tokens per expert `L.E`: in each layer a random ranking of the experts, the r-th most
    popular getting 1000 / r**s (s = 0: uniform; Mixtral-like routing is around 1)."""
    rng = random.Random(seed)
    out = {}
    for layer in range(layers):
        ranks = rng.sample(range(experts), experts)
        for r, e in enumerate(ranks):
            out[f"{layer}.{e}"] = 1000.0 / (r + 1) ** s
    return out


def lognormal_load(layers: int, experts: int, sigma: float, seed: int) -> dict[str, float]:
    """Tokens per expert `L.E` drawn from a lognormal (median 100): many mid-sized experts and a
    few heavy ones, without Zipf's strict ranking."""
    rng = random.Random(seed)
    return {f"{layer}.{e}": 100.0 * rng.lognormvariate(0.0, sigma) for layer in range(layers) for e in range(experts)}
