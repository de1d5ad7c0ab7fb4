"""One channel request computed on a shard replica: its experts pinned in the store and their
rows computed, in waves when the call needs more experts than the hot tier holds."""

from __future__ import annotations

import torch

from moe_workers.model.experts import compute_rows
from moe_workers.store.store import Key, TieredExpertStore


def compute_call(store: TieredExpertStore, cfg, keys: list[Key], counts: list[int], first, prefetch,
                 x: torch.Tensor, out: torch.Tensor) -> None:
    """`counts[i]` rows of x for expert keys[i] -> out. `first`: the keys some token chose first
    (told to the store's policy); `prefetch`: keys hinted for the next layers, promoted while
    this call computes. A call with more experts than the hot tier's slots (a prefill step over a
    hot tier smaller than a layer's share) is computed a wave at a time (`store.call_waves`:
    what is hot first), each expert's rows in place; the policy is told of the call once."""
    waves = store.call_waves(keys)
    if len(waves) == 1:
        with store.use(keys, first) as weights:
            if prefetch:
                store.prefetch(prefetch)  # loads overlap this call's compute
            compute_rows(weights, keys, counts, x, out, cfg)
        return
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    store.tell(keys, first)
    for wave in waves:
        with store.use([keys[i] for i in wave], None) as weights:
            for i in wave:
                rows = slice(starts[i], starts[i + 1])
                compute_rows(weights, [keys[i]], [counts[i]], x[rows], out[rows], cfg)
    if prefetch:
        store.prefetch(prefetch)
