"""What a shard's user_config["tiers"] says: budgets in bytes, the policy, prefetch and idle
demotion (TierConfig), and the error for budgets that cannot work."""

from __future__ import annotations

from dataclasses import dataclass

from .policy import DEFAULT_POLICY, make_policy


class TierConfigError(ValueError):
    """Budgets that cannot work (for example, a hot tier smaller than one token's experts)."""


@dataclass(frozen=True)
class TierConfig:
    """Budgets in bytes (None: unbounded) and policy; from the shard's user_config["tiers"]."""

    hot_budget: int | None = None
    warm_budget: int | None = None
    cold_dir: str | None = None
    cold_budget: int | None = None
    policy: str = DEFAULT_POLICY
    idle_demotion_s: float = 0.0
    prefetch: bool = True
    pinned: bool = True

    @classmethod
    def from_dict(cls, raw: dict | None) -> "TierConfig":
        raw = raw or {}
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise TierConfigError(f"tiers: unknown field(s) {', '.join(unknown)}")
        cfg = cls(**raw)
        for name in ("hot_budget", "warm_budget", "cold_budget"):
            v = getattr(cfg, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise TierConfigError(f"tiers.{name}: must be a byte count >= 0, got {v!r}")
        make_policy(cfg.policy)  # raises on an unknown name
        return cfg
