"""Device link: the tensor bytes of an exchange on a torch.distributed pair instead of the socket.

On GPU machines the rows should go from the ingress' device memory to the shard's without a stop
in host memory: each channel connection can carry a two-rank process group (the ingress rank 0,
the replica rank 1) made when the connection opens, NCCL for CUDA tensors. The socket still
carries the frames (layer, experts, counts, errors); a frame flagged LINKED says its tensor
travels on the link, which sends and receives in the frames' order, so no tags are needed.

The same code runs with gloo on CPU tensors, which is how it is tested here (no GPU on these
machines: the NCCL backend itself has never run in this project).

Rendezvous: the ingress opens a TCPStore on a free port of its own address and names it in the
connection's hello; the replica joins it. The store is private to the pair (world size 2).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class LinkError(RuntimeError):
    """The link could not be made (backend missing, rendezvous timed out)."""


@dataclass(frozen=True)
class LinkOffer:
    """What the hello says about the link the ingress wants: backend and its store."""

    backend: str
    host: str
    port: int

    def as_dict(self) -> dict:
        return {"backend": self.backend, "host": self.host, "port": self.port}

    @staticmethod
    def from_dict(raw: dict) -> "LinkOffer":
        backend = raw.get("backend")
        if backend not in BACKENDS:
            raise LinkError(f"unknown link backend {backend!r} (known: {', '.join(BACKENDS)})")
        return LinkOffer(backend, str(raw["host"]), int(raw["port"]))


def link_device(backend: str) -> torch.device:
    """Where a link's tensors live on this side: the current CUDA device for NCCL."""
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise LinkError("an NCCL link needs a CUDA device on both ends")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PairLink:
    """A two-rank process group; rank 0 hosts the store."""

    def __init__(self, backend: str, rank: int, store: dist.Store, timeout_s: float):
        if backend == "nccl" and not dist.is_nccl_available():
            raise LinkError("this torch build has no NCCL")
        if backend == "gloo" and not dist.is_gloo_available():
            raise LinkError("this torch build has no gloo")
        self.backend, self.rank, self.peer = backend, rank, 1 - rank
        self.device = link_device(backend)
        self._store = store
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if backend == "nccl":  # pragma: no cover - needs CUDA
                self.pg = dist.ProcessGroupNCCL(store, rank, 2)
            else:
                self.pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
        except RuntimeError as err:
            raise LinkError(f"{backend} link rendezvous failed: {err}") from err

    @staticmethod
    def host_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
        """Rank 0's store on a free port of `host` (the replica joins it when the hello arrives)."""
        store = dist.TCPStore(host, 0, 2, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        return store, store.port

    @staticmethod
    def join_store(offer: LinkOffer, timeout_s: float) -> dist.TCPStore:
        return dist.TCPStore(offer.host, offer.port, 2, False, datetime.timedelta(seconds=timeout_s))

    def send(self, t: torch.Tensor) -> None:
        self.pg.send([t.contiguous()], self.peer, 0).wait()

    def recv_into(self, t: torch.Tensor) -> None:
        self.pg.recv([t], self.peer, 0).wait()
