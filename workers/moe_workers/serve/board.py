"""StatusBoard: the app's directory of shard replicas (a Serve deployment with one replica).

A DeploymentHandle call reaches one replica of a deployment, not each, so every shard replica
reports itself here (every 2 s and after each reconfigure): its status for GET /moe/v1/status,
and its expert-channel endpoint, from which each ingress replica learns the channel's members.
The board also holds the channel token: a random secret made when the board starts, handed to
each shard with the answer to its report and to each ingress with the members, so only the app's
own ingress replicas can open the shards' channel ports.
"""

from __future__ import annotations

import secrets
import time

from ray import serve

REPORT_MAX_AGE_S = 10.0  # a replica that stopped reporting (killed) leaves the board after this


@serve.deployment(ray_actor_options={"num_cpus": 0.01})
class StatusBoard:
    def __init__(self):
        self.reports: dict[str, tuple[float, dict]] = {}
        self.token = secrets.token_hex(16)

    def report(self, status: dict) -> str:
        """Record a replica's status; the channel token in return."""
        self.reports[status["replica"]] = (time.monotonic(), status)
        return self.token

    def leave(self, replica: str) -> None:
        """A replica that is stopping leaves at once (it answers DRAINING meanwhile)."""
        self.reports.pop(replica, None)

    def forget(self, replica: str, endpoint: str) -> None:
        """An ingress found the replica's channel port closed (its process died): it leaves now
        rather than when its report ages out. A live replica reports again within 2 s."""
        got = self.reports.get(replica)
        if got is not None and got[1].get("endpoint") == endpoint:
            del self.reports[replica]

    def _fresh(self, max_age_s: float) -> list[tuple[float, dict]]:
        now = time.monotonic()
        self.reports = {r: v for r, v in self.reports.items() if now - v[0] <= max_age_s}  # gone replicas age out
        return sorted(self.reports.values(), key=lambda v: (v[1]["group"], v[1]["replica"]))

    def snapshot(self, max_age_s: float = REPORT_MAX_AGE_S) -> list[dict]:
        now = time.monotonic()
        return [{**st, "age_s": round(now - t, 2)} for t, st in self._fresh(max_age_s)]

    def members(self, max_age_s: float = REPORT_MAX_AGE_S) -> dict:
        """The expert channel's members (replicas with an endpoint) and its token."""
        return {"token": self.token,
                "members": [{k: st[k] for k in ("group", "replica", "endpoint", "experts")}
                            for _, st in self._fresh(max_age_s) if st.get("endpoint")]}
