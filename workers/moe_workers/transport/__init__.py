"""The expert channel: the per-layer token exchange between the ingress and the shard replicas,
on its own connections (Serve manages the replicas, HTTP and reconfigure(), not this traffic)."""

from .channel import ExchangeFailed, ExpertChannel, ExpertsUnavailable, Member, Part
from .server import ExchangeServer

__all__ = ["ExchangeFailed", "ExchangeServer", "ExpertChannel", "ExpertsUnavailable", "Member", "Part"]
