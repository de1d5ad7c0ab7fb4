"""When to rebalance and how many replicas (pure): hysteresis, cooldown, bounds, and respect for
replica counts set through the scale subresource (kubectl scale, an HPA).

`decide` is called with the observed signals and the policy's own memory (`PolicyState`, kept in
status) and returns a Decision; the caller applies it (mode Auto), only records it (Recommend),
or nothing happens (Off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from moe_operator.api.models import AutoscalingSpec

NONE, REBALANCE, SCALE_UP, SCALE_DOWN = "None", "Rebalance", "ScaleUp", "ScaleDown"


@dataclass(frozen=True)
class Signals:
    """Observed over the window."""

    imbalance: float  # max / mean shard-group load
    busiest_group_tokens_per_second: float  # expert-tokens per second of the busiest shard group
    replicas_per_group: int  # as running now
    spec_replicas_per_group: int  # spec.experts.replicasPerGroup now (the scale subresource writes it)
    expected_imbalance_after: float | None = None  # the planner's, for the rebalance it would do


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between passes."""

    above_since: float | None = None  # imbalance above threshold continuously since
    last_applied: float | None = None
    last_set_replicas: int | None = None  # replicas the policy itself last wrote


@dataclass(frozen=True)
class Decision:
    kind: str
    reason: str
    apply: bool  # False in Recommend mode, or when nothing is to be done
    replicas_per_group: int | None = None
    imbalance_before: float | None = None
    imbalance_after: float | None = None


def decide(spec: AutoscalingSpec, signals: Signals, state: PolicyState, now: float) -> tuple[Decision, PolicyState]:
    if spec.mode == "Off":
        return Decision(NONE, "autoscaling is off", False), PolicyState()
    auto = spec.mode == "Auto"
    above = signals.imbalance > spec.imbalance_threshold
    state = replace(state, above_since=(state.above_since if state.above_since is not None else now) if above else None)
    cooling = state.last_applied is not None and now - state.last_applied < spec.cooldown_seconds

    # replicas: on total load, within bounds, unless someone else set the count
    external = state.last_set_replicas is not None and signals.spec_replicas_per_group != state.last_set_replicas
    if spec.target_tokens_per_second_per_replica and not external:
        # every replica of a group serves the group's experts: size the busiest group
        want = math.ceil(signals.busiest_group_tokens_per_second / spec.target_tokens_per_second_per_replica)
        want = min(spec.max_replicas_per_group, max(spec.min_replicas_per_group, want))
        if want != signals.spec_replicas_per_group and not cooling:
            kind = SCALE_UP if want > signals.spec_replicas_per_group else SCALE_DOWN
            d = Decision(kind, f"busiest group serves {signals.busiest_group_tokens_per_second:.0f} expert-tokens/s; "
                         f"target {spec.target_tokens_per_second_per_replica:g} per replica -> {want} replica(s)", auto, want,
                         signals.imbalance, signals.imbalance)
            if auto:
                state = replace(state, last_applied=now, last_set_replicas=want)
            return d, state
    if not above:
        return Decision(NONE, f"imbalance {signals.imbalance:.2f} is within the threshold "
                        f"{spec.imbalance_threshold:.2f}", False, imbalance_before=signals.imbalance), state
    lasted = now - state.above_since
    if lasted < spec.stabilization_window_seconds:
        return Decision(NONE, f"imbalance {signals.imbalance:.2f} above {spec.imbalance_threshold:.2f} for "
                        f"{lasted:.0f} s of the {spec.stabilization_window_seconds} s stabilization window", False,
                        imbalance_before=signals.imbalance), state
    if cooling:
        return Decision(NONE, f"cooling down: last change {now - state.last_applied:.0f} s ago "
                        f"(cooldown {spec.cooldown_seconds} s)", False, imbalance_before=signals.imbalance), state
    after = signals.expected_imbalance_after
    if after is not None and after >= signals.imbalance * 0.98:
        return Decision(NONE, f"no placement does better than imbalance {signals.imbalance:.2f} "
                        f"(planner: {after:.2f})", False, imbalance_before=signals.imbalance,
                        imbalance_after=after), state
    d = Decision(REBALANCE, f"imbalance {signals.imbalance:.2f} above {spec.imbalance_threshold:.2f} for {lasted:.0f} s",
                 auto, imbalance_before=signals.imbalance, imbalance_after=after)
    if auto:
        state = replace(state, last_applied=now, above_since=None)
    return d, state

