"""A step's profile: the phases the engine times (cumulative seconds, `runner.StepTimings`) and
their means a step between two reads (pure, no torch). The Ingress' metrics thread observes the means
each second (`moe_step_phase_seconds`); `moectl profile` diffs two reads of /moe/v1/status.

A profile (`StepTimings.profile()`, with the dispatcher's parts added by the Ingress):
{"steps", "tokens", "forward_s", "step_s", "phases": {name: seconds}}, where a name with a dot
is a part of the phase before the dot ("exchange.wait" of "exchange").
"""

from __future__ import annotations

# the phases of a step in the order it runs them (`runner.StepTimings`)
PHASES = ("embed", "attention", "router", "local", "exchange", "logits", "sampling")


def per_step(before: dict | None, after: dict) -> tuple[int, dict[str, float]]:
    """(steps between the two profiles, each phase's mean seconds a step over them); no steps:
    (0, {}). `before` None: since start. A counter that went back (the replica restarted)
    counts from zero."""
    b = before or {}
    steps = after.get("steps", 0) - b.get("steps", 0)
    if steps < 0:
        b, steps = {}, after.get("steps", 0)
    if steps <= 0:
        return 0, {}
    was = b.get("phases") or {}
    return steps, {name: max(0.0, s - was.get(name, 0.0)) / steps for name, s in (after.get("phases") or {}).items()}
