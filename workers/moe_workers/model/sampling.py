"""Next-token choice: greedy at temperature 0, else temperature + nucleus (top-p) sampling.

Computed in float64 so that every temperature and top_p the API accepts gives a proper
distribution (a float32 top_p of 5e-324 is 0 and kept nothing; logits / 1e-5 overflowed float32);
a row the model itself made non-finite falls back to argmax over its finite entries.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    """One token id from a (vocab,) row of logits."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits.double() / temperature
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return int(torch.argmax(torch.nan_to_num(logits.double(), nan=float("-inf"))))
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        keep[0] = True  # the most likely token always stays
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
