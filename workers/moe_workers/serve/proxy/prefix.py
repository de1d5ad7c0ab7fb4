"""Prefix-aware routing among Ingress replicas: a request's prefix chain and which replica took it (pure).

Each Ingress replica keeps a prefix cache of its own (computed KV blocks, reused by a request whose
prompt starts the same way). Serve's default router picks the less loaded of two random replicas,
so the requests of one chat (or one tenant's system prompt) spread over all replicas and each
replica computes the same prefix again. Here:

- The admission gate in Serve's proxy (moe_workers.serve.proxy.gate) reads a generation request's
  body before Serve routes it, and adds `x-moe-prefix`: the chain of hashes of its prompt in
  PREFIX_BLOCK_BYTES blocks (each hash covers every block before it, as the KV cache's block
  hashes do), from the request's tools and messages (chat) or prompt (completions), at most
  PREFIX_MAX_BLOCKS blocks.
- `PrefixAffinityRouter` (the Ingress deployment's `request_router_config`, run by Serve in each
  handle that calls the Ingress: the proxy's) sends the request to the live replica that took the
  longest run of the same hashes before, unless that one has `imbalance_threshold` more requests
  ongoing than the least loaded candidate: then, and for requests without the header (status,
  models), Serve's power of two choices. A prefix seen nowhere goes to the replica holding the
  fewest prefixes, so the tenants spread over the replicas.

What each router learnt is its own (one per proxy): with a proxy on each of several nodes, each
learns where it sent a prefix, and a prefix sent through two proxies may be cached twice.
This module is the pure part (no Ray: the operator imports the gate's module);
moe_workers.serve.proxy.router is the Serve router around it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

PREFIX_HEADER = b"x-moe-prefix"
PREFIX_BLOCK_BYTES = 128  # about 32 tokens of English text: a couple of KV blocks
PREFIX_MAX_BLOCKS = 64  # 8 KiB of prompt; a longer prompt routes by its first 8 KiB
DIGEST_BYTES = 6
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
IMBALANCE_THRESHOLD = 16  # requests ongoing beyond the least loaded replica's before affinity yields
MAX_PREFIXES = 200_000  # block hashes remembered (least recently routed forgotten first)
MAX_PENDING = 10_000  # chains of requests being routed kept at most


def prompt_text(path: str, body: bytes) -> str | None:
    """The text a request's prompt starts with, as far as routing cares (None: not a generation
    request, or not JSON): a chat request's tools and then each message in order, a completion's
    prompt (the first, when a list of prompts). Two requests of one conversation share a prefix of
    this text exactly as long as they share their first messages."""
    if not path.endswith(GENERATION_PATHS):
        return None
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser (the Ingress says which)
        return None
    if not isinstance(req, dict):
        return None
    dump = lambda v: json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)  # noqa: E731
    if path.endswith("/chat/completions"):
        messages = req.get("messages")
        if not isinstance(messages, list):
            return None
        return "".join([dump(req.get("tools")) + "\n", *(dump(m) + "\n" for m in messages)])
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt)) + ","
    return None


def prefix_chain(text: str) -> list[str]:
    """Hashes of the text's whole PREFIX_BLOCK_BYTES blocks (UTF-8), each over all blocks up to its
    own, at most PREFIX_MAX_BLOCKS; a text shorter than one block has none."""
    data = text.encode(errors="surrogatepass")  # a lone surrogate is the Ingress' to refuse
    out: list[str] = []
    h = b""
    for start in range(0, min(len(data) // PREFIX_BLOCK_BYTES, PREFIX_MAX_BLOCKS) * PREFIX_BLOCK_BYTES,
                       PREFIX_BLOCK_BYTES):
        h = hashlib.blake2b(h + data[start:start + PREFIX_BLOCK_BYTES], digest_size=DIGEST_BYTES).digest()
        out.append(h.hex())
    return out


def prefix_header(path: str, body: bytes) -> tuple[bytes, bytes] | None:
    """The header the gate adds to a generation request (None: nothing to route by). It never
    raises: a body it cannot read is routed by load, and the Ingress answers what is wrong."""
    try:
        text = prompt_text(path, body)
        chain = prefix_chain(text) if text is not None else []
    except Exception:  # noqa: BLE001 - routing is an optimisation; the request goes on
        return None
    return (PREFIX_HEADER, ",".join(chain).encode()) if chain else None


def parse_chain(value: bytes) -> list[str]:
    """The header's hashes (a malformed entry dropped), at most PREFIX_MAX_BLOCKS."""
    hashes = value.decode("ascii", "replace").split(",")
    return [h for h in hashes if len(h) == 2 * DIGEST_BYTES][:PREFIX_MAX_BLOCKS]


class PrefixAffinity:
    """Which replica took which prefix block (pure; the router's memory). Keys are replica names."""

    def __init__(self, max_prefixes: int = MAX_PREFIXES, imbalance_threshold: int = IMBALANCE_THRESHOLD):
        self.owner: OrderedDict[str, str] = OrderedDict()  # block hash -> the replica that took it last
        self.held: dict[str, int] = {}  # replica -> block hashes it owns
        self.max_prefixes = max_prefixes
        self.imbalance_threshold = imbalance_threshold

    def choose(self, chain: list[str], replicas: list[str], load: dict[str, int | None]) -> str | None:
        """The replica for a request with this chain among `replicas` (None: no preference, route
        by load). `load`: requests ongoing on each, where known."""
        if not chain or not replicas:
            return None
        live = set(replicas)
        best = None
        for h in chain:  # the longest run of blocks one live replica took
            r = self.owner.get(h)
            if r in live:
                best = r
            elif r is None:
                break
        if best is None:  # a prefix seen nowhere: the replica holding the fewest (then by the hash)
            best = min(replicas, key=lambda r: (self.held.get(r, 0),
                                                hashlib.blake2b((chain[0] + r).encode(), digest_size=8).digest()))
        known = [n for n in (load.get(r) for r in replicas) if n is not None]
        mine = load.get(best)
        if mine is not None and known and mine - min(known) > self.imbalance_threshold:
            return None
        return best

    def record(self, chain: list[str], replica: str) -> None:
        """The request with this chain went to `replica`: its blocks are cached there now."""
        for h in chain:
            before = self.owner.pop(h, None)
            if before is not None:
                self.held[before] -= 1
            self.owner[h] = replica
            self.held[replica] = self.held.get(replica, 0) + 1
        while len(self.owner) > self.max_prefixes:
            _, r = self.owner.popitem(last=False)
            self.held[r] -= 1

    def forget(self, replica: str) -> None:
        """A replica that is gone: what it held is held nowhere."""
        for h in [h for h, r in self.owner.items() if r == replica]:
            del self.owner[h]
        self.held.pop(replica, None)


