"""The tiered store's byte accounting (Ledger) and the form each tier holds an expert in
(TierForms). Pure: no tensors, no locks of its own (the store calls it under its lock).

A tier's bytes are `used` (held by resident experts) plus `reserved` (room held by moves and
hot-swaps under way: a `Hold`, committed into `used` when the copy lands or abandoned when it
fails). `staged` is the part of `reserved` held by hot-swaps' staged versions: a batch may go
over a budget by it (see TieredExpertStore.make_room)."""

from __future__ import annotations

from dataclasses import dataclass

from .entry import HOT, WARM

COMPUTE, STORED = "compute", "stored"


@dataclass(frozen=True)
class TierForms:
    """How each tier holds an expert and what one costs there. The hot tier holds the compute
    layout the kernels read; the warm tier (host RAM) holds a quantized checkpoint's experts as
    they are stored (fp8 + scales, mxfp4 blocks + scales: 2x / 3.8x fewer bytes) and decodes
    them on promotion; the cold tier's files are always the stored form."""

    compute_bytes: int  # one expert in the compute dtype
    stored_bytes: int  # one expert as the checkpoint stores it (== compute_bytes when unquantized)
    quantized: bool

    def form(self, tier: str) -> str:
        return STORED if tier != HOT and self.quantized else COMPUTE

    def nbytes(self, tier: str) -> int:
        return self.stored_bytes if self.form(tier) == STORED else self.compute_bytes

    def same_layout(self) -> bool:
        """Hot and warm hold the same bytes (a move between them on one memory is bookkeeping)."""
        return self.form(HOT) == self.form(WARM)

    def report(self) -> dict:
        """Bytes of one expert per tier and its ratio to the compute dtype (status)."""
        out = {}
        for tier in (HOT, WARM, "cold"):
            n = self.nbytes(tier)
            out[tier] = {"form": self.form(tier), "bytes": n, "vs_compute": round(n / self.compute_bytes, 4)}
        return out


class Hold:
    """Room reserved in one tier for one move or staged version: `commit()` when it lands (the
    bytes become used), `abandon()` when it fails. Either once; later calls do nothing, so a
    roll-back path may abandon what a success path already committed."""

    __slots__ = ("ledger", "tier", "nbytes", "staged", "open")

    def __init__(self, ledger: "Ledger", tier: str, nbytes: int, staged: bool):
        self.ledger, self.tier, self.nbytes, self.staged, self.open = ledger, tier, nbytes, staged, True

    def _close(self) -> bool:
        if not self.open:
            return False
        self.open = False
        self.ledger.reserved[self.tier] -= self.nbytes
        if self.staged:
            self.ledger.staged[self.tier] -= self.nbytes
        return True

    def commit(self) -> None:
        if self._close():
            self.ledger.used[self.tier] += self.nbytes

    def abandon(self) -> None:
        self._close()


class Ledger:
    """Bytes used and reserved per tier (hot, warm) against their budgets."""

    def __init__(self, budgets: dict[str, int | None] | None = None):
        self.budgets: dict[str, int | None] = dict(budgets or {HOT: None, WARM: None})
        self.used = {HOT: 0, WARM: 0}
        self.reserved = {HOT: 0, WARM: 0}
        self.staged = {HOT: 0, WARM: 0}

    def fits(self, tier: str, nbytes: int) -> bool:
        budget = self.budgets[tier]
        return budget is None or self.used[tier] + self.reserved[tier] + nbytes <= budget

    def over(self, tier: str) -> bool:
        return not self.fits(tier, 0)

    def reserve(self, tier: str, nbytes: int, staged: bool = False) -> Hold:
        self.reserved[tier] += nbytes
        if staged:
            self.staged[tier] += nbytes
        return Hold(self, tier, nbytes, staged)

    def add(self, tier: str, nbytes: int) -> None:
        self.used[tier] += nbytes

    def remove(self, tier: str, nbytes: int) -> None:
        self.used[tier] -= nbytes
