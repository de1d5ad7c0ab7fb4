"""How the router behaves, measured at the ingress over the tokens of each step (no Ray here):

- routing entropy per layer: entropy of the expert-selection distribution, divided by log(E)
  (1.0 is uniform use of all experts, 0 is one expert taking every token);
- activation rate: experts a step activates over the layer's experts, the share of expert
  parameters a step must touch (averaged over steps and layers);
- switching rate per layer: how often a sequence's top-1 expert differs from its previous token's
  (Mixtral's paper: ~75% in middle layers against 87.5% at random for 8 experts);
- co-selection: how often two experts of a layer are picked for the same token (the planner keeps
  such pairs in one group: one call per token instead of two).

Counts accumulate between `take()` calls, which return the window's figures and start anew.
"""

from __future__ import annotations

import math
import threading

import torch


class RoutingStats:
    def __init__(self, num_layers: int, num_experts: int, max_slots: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.prev_top1 = torch.full((max_slots, num_layers), -1, dtype=torch.long)
        self.lock = threading.Lock()
        self._reset()
        self.co_selection = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.long)  # since start

    def _reset(self) -> None:
        self.selected = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long)
        self.activated_sum = 0.0
        self.activated_steps = 0
        self.switches = torch.zeros(self.num_layers, dtype=torch.long)
        self.transitions = torch.zeros(self.num_layers, dtype=torch.long)

    def observe(self, layer: int, indices: torch.Tensor, slots: list[int], starts: list[int], lengths: list[int]) -> None:
        """`indices` (tokens, top_k) of one layer for a step whose chunks are (slot, start, length)
        in row order."""
        self.observe_step([layer], indices[None], slots, starts, lengths)

    def observe_step(self, layers: list[int], indices: torch.Tensor, slots: list[int], starts: list[int],
                     lengths: list[int]) -> None:
        """`indices` (len(layers), tokens, top_k): a step's router picks for these layers, counted
        at once (a fixed number of tensor ops per step, not per layer: the engine calls this once
        after a step's forward pass)."""
        nl, n, k = indices.shape
        e = self.num_experts
        layer_t = torch.tensor(layers, dtype=torch.long)
        flat = indices.reshape(nl, n * k)
        counts = torch.zeros(nl, e, dtype=torch.long).scatter_add_(1, flat, torch.ones_like(flat))
        top1 = indices[:, :, 0]
        # switching: consecutive rows of one chunk, and a chunk's first row against the slot's last token
        first_rows, row = [], 0
        for length in lengths:
            first_rows.append(row)
            row += length
        same_chunk = torch.ones(n, dtype=torch.bool)
        same_chunk[first_rows] = False
        switches = ((top1[:, 1:] != top1[:, :-1]) & same_chunk[1:]).sum(1)
        transitions = torch.full((nl,), int(same_chunk[1:].sum()), dtype=torch.long)
        slot_t = torch.tensor(slots, dtype=torch.long)
        first_t = torch.tensor(first_rows, dtype=torch.long)
        last_t = torch.tensor([r + ln - 1 for r, ln in zip(first_rows, lengths)], dtype=torch.long)
        continuing = torch.tensor([s > 0 for s in starts], dtype=torch.bool)
        pairs = None
        if k > 1:
            a, b = torch.triu_indices(k, k, offset=1)
            lo = torch.minimum(indices[:, :, a], indices[:, :, b])
            hi = torch.maximum(indices[:, :, a], indices[:, :, b])
            pairs = torch.bincount((layer_t[:, None, None] * e * e + lo * e + hi).reshape(-1),
                                   minlength=self.num_layers * e * e).view(self.num_layers, e, e)
        with self.lock:
            prev = self.prev_top1[slot_t][:, layer_t].T  # (layers, chunks)
            known = continuing & (prev >= 0)
            transitions += known.sum(1)
            switches += (known & (prev != top1[:, first_t])).sum(1)
            self.prev_top1[slot_t[:, None], layer_t[None, :]] = top1[:, last_t].T
            self.selected.index_add_(0, layer_t, counts)
            self.activated_sum += int((counts > 0).sum()) / e
            self.activated_steps += nl
            self.switches.index_add_(0, layer_t, switches)
            self.transitions.index_add_(0, layer_t, transitions)
            if pairs is not None:
                self.co_selection += pairs

    def take(self) -> dict:
        """The window's figures (None where nothing was routed), and a new window."""
        with self.lock:
            selected, switches, transitions = self.selected, self.switches, self.transitions
            activation = self.activated_sum / self.activated_steps if self.activated_steps else None
            self._reset()
        entropy = []
        for layer in range(self.num_layers):
            total = int(selected[layer].sum())
            if total == 0 or self.num_experts < 2:
                entropy.append(None)
                continue
            p = selected[layer].double() / total
            h = float(-(p[p > 0] * p[p > 0].log()).sum())
            entropy.append(h / math.log(self.num_experts))
        switching = [int(s) / int(t) if int(t) else None for s, t in zip(switches, transitions)]
        return {"entropy": entropy, "activation_rate": activation, "switching_rate": switching,
                "tokens": [int(selected[layer].sum()) for layer in range(self.num_layers)]}

    def co_selected_pairs(self, limit: int = 256) -> list[tuple[str, str, int]]:
        """The most frequent pairs since start: (L.a, L.b, tokens), most first."""
        with self.lock:
            flat = self.co_selection.reshape(-1)
            nz = int((flat > 0).sum())
            if nz == 0:
                return []
            values, idx = torch.topk(flat, min(limit, nz))
        e = self.num_experts
        out = []
        for v, i in zip(values.tolist(), idx.tolist()):
            layer, rest = divmod(i, e * e)
            a, b = divmod(rest, e)
            out.append((f"{layer}.{a}", f"{layer}.{b}", int(v)))
        return out
