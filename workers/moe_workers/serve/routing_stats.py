"""How the router behaves, measured at the ingress over the tokens of each step (no Ray here):

- routing entropy per layer: entropy of the expert-selection distribution, divided by log(E)
  (1.0 is uniform use of all experts, 0 is one expert taking every token);
- activation rate: experts a step activates over the layer's experts, the share of expert
  parameters a step must touch (averaged over steps and layers);
- switching rate per layer: how often a sequence's top-1 expert differs from its previous token's
  (Mixtral's paper: ~75% in middle layers against 87.5% at random for 8 experts);
- co-selection: how often two experts of a layer are picked for the same token (the planner keeps
  such pairs in one group: one call per token instead of two);
- expert-tokens per (layer, expert), and per API key (its short id, `auth.key_id`; "-" without
  one) for up to MAX_KEYS keys a window (the rest counted as OTHER_KEYS): what the anomaly detector
  (`serve/anomaly.py`) compares with its baseline and attributes a surge with.

Counts accumulate between `take()` calls, which return the window's figures and start anew.
"""

from __future__ import annotations

import math
import threading

import torch

FLUSH_STEPS = 64  # steps kept before they are counted (at once)
MAX_KEYS, OTHER_KEYS = 32, "other"  # API keys counted apart in a window; the rest together


class RoutingStats:
    def __init__(self, num_layers: int, num_experts: int, max_slots: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.prev_top1 = torch.full((max_slots, num_layers), -1, dtype=torch.long)
        self.lock = threading.Lock()
        self._pending: list[tuple] = []  # steps observed, not yet counted
        self._reset()
        self.co_selection = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.long)  # since start

    def _reset(self) -> None:
        self.selected = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long)
        self.activated = 0  # (step, layer, expert) triples with a token, summed
        self.activated_steps = 0
        self.switches = torch.zeros(self.num_layers, dtype=torch.long)
        self.transitions = torch.zeros(self.num_layers, dtype=torch.long)
        self.key_selected: dict[str, torch.Tensor] = {}  # key id -> (layers, experts) expert-tokens

    def observe(self, layer: int, indices: torch.Tensor, slots: list[int], starts: list[int], lengths: list[int]) -> None:
        """`indices` (tokens, top_k) of one layer for a step whose chunks are (slot, start, length)
        in row order."""
        self.observe_step([layer], indices[None], slots, starts, lengths)

    def observe_step(self, layers: list[int], indices: torch.Tensor, slots: list[int], starts: list[int],
                     lengths: list[int], keys: list[str] | None = None) -> None:
        """`indices` (len(layers), tokens, top_k): a step's router picks for these layers; `keys`:
        each chunk's API key id (None: all anonymous). Kept
        as they are and counted `FLUSH_STEPS` steps at a time, in one set of tensor ops (about 40
        ops, 0.4-0.5 ms a call on this project's CPUs: counted every step, they cost a 4-layer
        model's batch-1 decode as much as a layer's expert exchange); `take()` and
        `co_selected_pairs()` count what is pending first."""
        with self.lock:
            self._pending.append((tuple(layers), indices, list(slots), list(starts), list(lengths),
                                  list(keys) if keys is not None else None))
            if len(self._pending) >= FLUSH_STEPS:
                self._flush()

    def _flush(self) -> None:
        """Count the pending steps (under the lock): runs of steps over the same layers at once.
        Outside inference mode whoever calls (the step thread is in it): a tensor made here in it
        (a key's first counts) could not be added to later by `take()` on the metrics thread."""
        pending, self._pending = self._pending, []
        i = 0
        with torch.inference_mode(False):
            while i < len(pending):
                j = i + 1
                while j < len(pending) and pending[j][0] == pending[i][0]:
                    j += 1
                self._count(pending[i:j])
                i = j

    def _count(self, steps: list[tuple]) -> None:
        """Steps over the same layers, in order: their tokens side by side, as one batch whose
        chunks are every step's chunks in order (a chunk that continues a sequence compares with
        the slot's latest chunk before it, in this batch or before)."""
        layers = list(steps[0][0])
        nl, e, k = len(layers), self.num_experts, steps[0][1].shape[2]
        indices = torch.cat([s[1] for s in steps], dim=1) if len(steps) > 1 else steps[0][1]
        n = indices.shape[1]
        layer_t = torch.tensor(layers, dtype=torch.long)
        step_of = torch.tensor([i for i, s in enumerate(steps) for _ in range(s[1].shape[1])], dtype=torch.long)
        per_step = torch.bincount(((step_of[None, :, None] * nl + torch.arange(nl)[:, None, None]) * e
                                   + indices).reshape(-1), minlength=len(steps) * nl * e)
        counts = per_step.view(len(steps), nl, e).sum(0)
        top1 = indices[:, :, 0]
        # chunks in row order: slot, continuing, first row, and the last row of the slot's latest
        # chunk before it in this batch (-1: none, the slot's state from earlier batches)
        slots, continuing, first_rows, before = [], [], [], []
        latest: dict[int, int] = {}
        row = 0
        row_keys: list[str] = []
        for _, _, step_slots, starts, lengths, keys in steps:
            for i, length in enumerate(lengths):
                row_keys += [keys[i] if keys is not None else "-"] * length
            for slot, start, length in zip(step_slots, starts, lengths):
                slots.append(slot)
                continuing.append(start > 0)
                first_rows.append(row)
                before.append(latest.get(slot, -1))
                latest[slot] = row + length - 1
                row += length
        # switching: consecutive rows of one chunk, and a chunk's first row against the slot's last token
        same_chunk = torch.ones(n, dtype=torch.bool)
        same_chunk[first_rows] = False
        switches = ((top1[:, 1:] != top1[:, :-1]) & same_chunk[1:]).sum(1)
        transitions = torch.full((nl,), int(same_chunk[1:].sum()), dtype=torch.long)
        slot_t = torch.tensor(slots, dtype=torch.long)
        first_t = torch.tensor(first_rows, dtype=torch.long)
        before_t = torch.tensor(before, dtype=torch.long)
        in_batch = before_t >= 0
        pairs = None
        if k > 1:
            a, b = torch.triu_indices(k, k, offset=1)
            lo = torch.minimum(indices[:, :, a], indices[:, :, b])
            hi = torch.maximum(indices[:, :, a], indices[:, :, b])
            pairs = torch.bincount((layer_t[:, None, None] * e * e + lo * e + hi).reshape(-1),
                                   minlength=self.num_layers * e * e).view(self.num_layers, e, e)
        prev = torch.where(in_batch[None, :], top1[:, before_t.clamp(min=0)], self.prev_top1[slot_t][:, layer_t].T)
        known = torch.tensor(continuing, dtype=torch.bool) & (prev >= 0)  # (layers, chunks)
        transitions += known.sum(1)
        switches += (known & (prev != top1[:, first_t])).sum(1)
        final = sorted(latest)  # each slot's latest chunk sets its state
        final_t = torch.tensor(final, dtype=torch.long)
        self.prev_top1[final_t[:, None], layer_t[None, :]] = top1[:, [latest[s] for s in final]].T
        self.selected.index_add_(0, layer_t, counts)
        self.activated += int((per_step > 0).sum())
        self.activated_steps += nl * len(steps)
        self.switches.index_add_(0, layer_t, switches)
        self.transitions.index_add_(0, layer_t, transitions)
        if pairs is not None:
            self.co_selection += pairs
        self._count_keys(layer_t, indices, row_keys)

    def _count_keys(self, layer_t: torch.Tensor, indices: torch.Tensor, row_keys: list[str]) -> None:
        """Expert-tokens per key id of these rows (one bincount over (key, layer, expert))."""
        room, kept = MAX_KEYS - len(self.key_selected), set(self.key_selected)
        for name in dict.fromkeys(row_keys):
            if name not in kept and room > 0:
                kept.add(name)
                room -= 1
        row_keys = [r if r in kept else OTHER_KEYS for r in row_keys]
        names = list(dict.fromkeys(row_keys))
        nl, e = indices.shape[0], self.num_experts
        of = {n: i for i, n in enumerate(names)}
        key_t = torch.tensor([of[r] for r in row_keys], dtype=torch.long)
        counts = torch.bincount(((key_t[None, :, None] * nl + torch.arange(nl)[:, None, None]) * e + indices).reshape(-1),
                                minlength=len(names) * nl * e).view(len(names), nl, e)
        for i, name in enumerate(names):
            if name not in self.key_selected:
                self.key_selected[name] = torch.zeros(self.num_layers, e, dtype=torch.long)
            self.key_selected[name].index_add_(0, layer_t, counts[i])

    def take(self) -> dict:
        """The window's figures (None where nothing was routed), and a new window. "selected" and
        "keys": the window's expert-tokens per layer and expert, overall and per key id (what the
        anomaly detector and the load report read, `serve.anomaly.Detector`)."""
        with self.lock:
            self._flush()
            selected, switches, transitions = self.selected, self.switches, self.transitions
            key_selected = self.key_selected
            activation = self.activated / self.num_experts / self.activated_steps if self.activated_steps else None
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
        used = [layer for layer in range(self.num_layers) if int(selected[layer].sum())]
        return {"entropy": entropy, "activation_rate": activation, "switching_rate": switching,
                "tokens": [int(selected[layer].sum()) for layer in range(self.num_layers)],
                # layers with tokens only: layer -> each expert's expert-tokens, overall and per key id
                "selected": {layer: selected[layer].tolist() for layer in used},
                "keys": {name: {layer: c[layer].tolist() for layer in used if int(c[layer].sum())}
                         for name, c in key_selected.items()}}

    def co_selected_pairs(self, limit: int = 256) -> list[tuple[str, str, int]]:
        """The most frequent pairs since start: (L.a, L.b, tokens), most first."""
        with self.lock:
            self._flush()
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
