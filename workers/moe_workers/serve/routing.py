"""Which shard group serves which expert for one layer's tokens (pure; no Ray here).

Each expert may be hosted by several groups (replicated hot experts). For every dispatch the
router picks, per expert, the copy whose group has the fewest tokens outstanding and, among
those, the fewest tokens of this layer sent to it so far (decode steps run one after another, so
nothing is outstanding at decision time: without the second key every tie would go to the same
copy). Counted per layer because a step waits for each layer's busiest group: counted over all
layers, two layers' hot experts would settle on alternate copies, each layer using half of them);
then the ingress sends one call per group that got any expert.
"""

from __future__ import annotations

from collections import defaultdict

from moe_workers.expert_ids import expert_key


class ExpertRouter:
    def __init__(self, placement: dict[str, list[str]]):
        """placement: group name -> expert ids ('L.E') it hosts."""
        self.placement = {g: list(e) for g, e in placement.items()}
        self.hosts: dict[tuple[int, int], list[str]] = defaultdict(list)
        for group, experts in sorted(placement.items()):
            for eid in experts:
                self.hosts[expert_key(eid)].append(group)
        self.outstanding: dict[str, int] = {g: 0 for g in placement}
        self.sent: dict[str, int] = {g: 0 for g in placement}  # all layers (metrics)
        self.layer_sent: dict[tuple[int, str], int] = defaultdict(int)  # per layer (the choice of copy)

    def missing(self, layers, num_experts: int) -> list[str]:
        """Experts no group hosts: a placement must cover every routed expert of `layers` (the
        sparse layers; an int n means 0..n-1)."""
        layers = range(layers) if isinstance(layers, int) else layers
        return [f"{l}.{e}" for l in layers for e in range(num_experts) if not self.hosts.get((l, e))]

    def assign(self, layer: int, token_counts: dict[int, int]) -> dict[str, list[int]]:
        """group -> experts of this layer it serves in this dispatch (hottest experts placed first)."""
        planned = dict(self.outstanding)
        out: dict[str, list[int]] = defaultdict(list)
        for expert, count in sorted(token_counts.items(), key=lambda kv: (-kv[1], kv[0])):
            hosts = self.hosts.get((layer, expert))
            if not hosts:
                raise KeyError(f"no shard group hosts expert {layer}.{expert}")
            group = min(hosts, key=lambda g: (planned[g], self.layer_sent[(layer, g)], g))
            planned[group] += count
            self.layer_sent[(layer, group)] += count
            out[group].append(expert)
        return dict(out)

    def begin(self, group: str, tokens: int) -> None:
        self.outstanding[group] = self.outstanding.get(group, 0) + tokens
        self.sent[group] = self.sent.get(group, 0) + tokens

    def end(self, group: str, tokens: int) -> None:
        self.outstanding[group] -= tokens
