"""Next-token choice: greedy at temperature 0, else temperature + nucleus (top-p) sampling."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    """One token id from a (vocab,) row of logits."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p  # always keeps the first
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
