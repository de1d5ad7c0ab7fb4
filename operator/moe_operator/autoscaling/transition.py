"""Applying a new placement make-before-break (pure): which experts the shards host and which
placement the ingress routes by, for the next pass, from what is deployed now.

    Loading    shards host old + new copies, ingress routes by the old placement;
    Switching  every replica of every group reports the new copies loaded: ingress routes by the new
               placement, shards still host both (calls sent by the old routing finish);
    Draining   a grace period after the switch, shards drop the copies the new placement no longer has.

Each pass looks only at observed state (the deployed ingress placement and shard expert sets,
the replicas' own reports) and the target kept in status, so a restarted operator resumes where
the last one stopped, and a pass that runs twice does no harm.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_workers.expert_ids import expert_key

Placement = dict[str, list[str]]

STEADY, LOADING, SWITCHING, DRAINING = "Steady", "Loading", "Switching", "Draining"


@dataclass(frozen=True)
class Step:
    ingress: Placement  # what the ingress routes by after this pass
    shards: Placement  # what each group hosts after this pass
    phase: str
    message: str
    done: bool  # the target (if any) is fully applied: clear it
    retry_after_s: float | None = None


def union(a: Placement, b: Placement) -> Placement:
    return {g: sorted(set(a.get(g, [])) | set(b.get(g, [])), key=expert_key) for g in sorted(set(a) | set(b))}


def same_placement(a: Placement, b: Placement) -> bool:
    groups = set(a) | set(b)
    return all(set(a.get(g, [])) == set(b.get(g, [])) for g in groups)


def _covers(have: Placement, want: Placement) -> bool:
    return all(set(want.get(g, [])) <= set(have.get(g, [])) for g in want)


def loaded_everywhere(target: Placement, reports: list[dict], replicas_per_group: int) -> tuple[bool, str]:
    """Every replica of each group reports the target's experts as hosted (registered, and as
    high in the tiers as budgets allow: the store preloads before reconfigure returns)."""
    by_group: dict[str, list[dict]] = {}
    for r in reports:
        by_group.setdefault(r.get("group", ""), []).append(r)
    waiting = []
    for g, experts in sorted(target.items()):
        reps = by_group.get(g, [])
        ready = [r for r in reps if set(experts) <= set(r.get("experts") or [])]
        if len(ready) < max(replicas_per_group, 1 if experts else 0):
            waiting.append(f"{g} {len(ready)}/{replicas_per_group}")
    if waiting:
        return False, "waiting for replicas to load the new copies: " + ", ".join(waiting[:8])
    return True, "every replica hosts its new copies"


def next_step(deployed_ingress: Placement, deployed_shards: Placement | None, target: Placement | None,
              reports: list[dict] | None, replicas_per_group: int, switched_at: float | None, now: float,
              grace_s: float = 5.0) -> Step:
    shards = deployed_shards if deployed_shards is not None else deployed_ingress
    if target is None or same_placement(target, deployed_ingress):
        if _covers(deployed_ingress, shards):
            return Step(deployed_ingress, deployed_ingress, STEADY, "placement applied", True)
        left = grace_s - (now - switched_at) if switched_at is not None else 0.0
        if left > 0:  # calls the old routing sent may still be on their way to the old copies
            return Step(deployed_ingress, shards, SWITCHING, f"routing switched; old copies dropped in {left:.0f} s",
                        False, retry_after_s=left)
        return Step(deployed_ingress, deployed_ingress, DRAINING, "old copies dropped", True)
    both = union(deployed_ingress, target)
    if _covers(shards, both) and reports is not None:
        ok, why = loaded_everywhere(target, reports, replicas_per_group)
        if ok:
            return Step(target, both, SWITCHING, "new copies loaded on every replica; routing switched", False,
                        retry_after_s=grace_s)
        return Step(deployed_ingress, both, LOADING, why, False, retry_after_s=2.0)
    return Step(deployed_ingress, both, LOADING, "loading the new copies beside the old ones", False,
                retry_after_s=2.0)
