"""Reconcile passes run as a runner runs them: a pass never waits for Ray, so a test that wants an
outcome runs passes, each from the last one's status, until one is not under way (Ray still
deploying what was applied: `reconcile.deploying`)."""

from __future__ import annotations

from moe_operator.reconcile import deploying, reconcile
from waiting import wait_for


def converge(obj, spec: dict, status: dict, client, settings, timeout_s: float = 300, **kw):
    """The first Result of `reconcile` passes that is not under way; the passes in between are
    counted on the returned Result as `passes`."""
    state = {"status": status, "passes": 0}

    def one():
        res = reconcile(obj, spec, state["status"], client, settings, **kw)
        state["status"], state["passes"] = res.status, state["passes"] + 1
        return None if deploying(res.status) else res

    res = wait_for(one, timeout_s=timeout_s, what=f"a pass of {obj.name} that is not under way", interval_s=0.5)
    res.passes = state["passes"]
    return res
