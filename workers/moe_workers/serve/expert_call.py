"""One channel request computed on a shard replica: its experts pinned in the store and their
rows computed, in waves when the call needs more experts than the hot tier holds; a sampled call
(`expert_health`) an expert at a time, each timed."""

from __future__ import annotations

import time
from typing import Callable

import torch

from moe_workers.model.experts import compute_rows
from moe_workers.store.store import Key, TieredExpertStore


Timer = Callable[[Key, float], None]  # (expert, seconds of its compute)


def compute_call(store: TieredExpertStore, cfg, keys: list[Key], counts: list[int], first, prefetch,
                 x: torch.Tensor, out: torch.Tensor, timer: Timer | None = None) -> None:
    """`counts[i]` rows of x for expert keys[i] -> out. `first`: the keys some token chose first
    (told to the store's policy); `prefetch`: keys hinted for the next layers, promoted while
    this call computes. A call with more experts than the hot tier's slots (a prefill step over a
    hot tier smaller than a layer's share) is computed a wave at a time (`store.call_waves`:
    what is hot first), each expert's rows in place; the policy is told of the call once.
    `timer`: compute each expert's rows on their own and tell it how long each took (the same
    values: a row's do not depend on the others in its call)."""
    waves = store.call_waves(keys)
    if len(waves) == 1 and timer is None:
        with store.use(keys, first) as weights:
            if prefetch:
                store.prefetch(prefetch)  # loads overlap this call's compute
            compute_rows(weights, keys, counts, x, out, cfg)
        return
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    if len(waves) == 1:
        with store.use(keys, first) as weights:
            if prefetch:
                store.prefetch(prefetch)
            for i in waves[0]:
                compute_expert(weights, keys[i], starts[i], counts[i], x, out, cfg, timer)
        return
    store.tell(keys, first)
    for wave in waves:
        with store.use([keys[i] for i in wave], None) as weights:
            for i in wave:
                compute_expert(weights, keys[i], starts[i], counts[i], x, out, cfg, timer)
    if prefetch:
        store.prefetch(prefetch)


def compute_expert(weights: dict, key: Key, start: int, n: int, x: torch.Tensor, out: torch.Tensor, cfg,
                   timer: Timer | None = None) -> None:
    """One expert's `n` rows from `start`, in place; timed when `timer` is given and it has rows
    (on a GPU up to the kernels' end: the timed call waits for the device)."""
    rows = slice(start, start + n)
    if timer is None or n == 0:
        compute_rows(weights, [key], [n], x[rows], out[rows], cfg)
        return
    t0 = time.perf_counter()
    compute_rows(weights, [key], [n], x[rows], out[rows], cfg)
    device = next(iter(weights[key].values())).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timer(key, time.perf_counter() - t0)
