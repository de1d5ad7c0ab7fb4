"""Each expert's load against its own moving baseline (pure bookkeeping, no torch, no Ray): its
share of its layer's tokens in the last routing window, beside an exponentially weighted moving
average of its shares in the windows before. An expert whose share falls well under its baseline
lost its traffic (a router drift, a quarantine beside it); one well over it took others'.

The Ingress updates it once a routing window (`RoutingStats.take`, every export), with the
window's tokens per (layer, expert); /moe/v1/status "routing"."load" carries it, and `moectl
experts` shows the ratio.
"""

from __future__ import annotations

ALPHA = 0.2  # the newest window's weight in the baseline (about the last 5 windows: 25 s at 5 s a window)


class LoadBaseline:
    def __init__(self, alpha: float = ALPHA):
        self.alpha = alpha
        self.share: dict[int, list[float]] = {}  # layer -> each expert's share in the last window with tokens
        self.baseline: dict[int, list[float]] = {}  # layer -> the moving average of the windows before it
        self._average: dict[int, list[float]] = {}  # the moving average, the last window included

    def update(self, selected: list[list[int]]) -> None:
        """One window's tokens per layer and expert (a layer with none keeps its figures)."""
        for layer, row in enumerate(selected):
            total = sum(row)
            if not total:
                continue
            share = [n / total for n in row]
            average = self._average.get(layer)
            self.baseline[layer] = share if average is None else average
            self.share[layer] = share
            self._average[layer] = share if average is None else [
                self.alpha * s + (1 - self.alpha) * a for s, a in zip(share, average)]

    def report(self) -> dict[str, dict[str, list[float]]]:
        """{layer: {"share": [...], "baseline": [...]}} (rounded; layers as strings, for JSON)."""
        return {str(layer): {"share": [round(v, 6) for v in self.share[layer]],
                             "baseline": [round(v, 6) for v in self.baseline[layer]]}
                for layer in sorted(self.share)}
