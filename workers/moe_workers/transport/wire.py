"""Frames of the expert exchange between the ingress and the shard replicas (pure: bytes only).

One request carries one layer's rows for one shard replica, grouped by expert; its reply carries
the outputs in the same order. A connection starts with a hello that proves the caller knows the
app's channel token. Fixed little-endian headers, then variable parts, then raw tensor bytes:
nothing is pickled, so a peer can send nothing but numbers and a short UTF-8 message.

    hello      MAGIC  kind=HELLO   token_len link_len         token, link offer (JSON, may be empty)
    hello ack  MAGIC  status       msg_len                    message (empty when OK)
    request    MAGIC  kind=EXPERTS dtype flags seq layer rows hidden n_experts n_prefetch
               int32[n_experts] experts, int32[n_experts] counts, int32[n_experts] top-1 counts (only
               when flags has RANKED), int32[2*n_prefetch] (layer, expert), padding to 16 bytes,
               rows*hidden values (none when flags has LINKED: they go on the link)
    reply      MAGIC  status dtype flags seq rows hidden msg_len    message | rows*hidden values
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

MAGIC = b"MoE1"
HELLO, EXPERTS = 1, 2  # request kinds
OK, ERROR, DRAINING, DENIED = 0, 1, 2, 3  # reply statuses
LINKED = 1  # flag: the tensor of this frame travels on the connection's device link
# flag: the request says, per expert, how many of its rows chose it first (the router's ranking,
# which the store's RankAware policy keeps experts by)
RANKED = 2
STATUS_NAMES = {OK: "ok", ERROR: "error", DRAINING: "draining", DENIED: "denied"}

DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
# numpy holds the bytes (a numpy view costs a fraction of a torch op); bfloat16, which numpy
# lacks, is held as uint16 and viewed as bfloat16 by torch
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}

HELLO_HEADER = struct.Struct("<4sBII")  # magic, kind, token length, link offer length
ACK_HEADER = struct.Struct("<4sBI")  # magic, status, message length
# magic, kind, dtype, flags, seq, layer, rows, hidden, n_experts, n_prefetch
REQUEST_HEADER = struct.Struct("<4sBBBQIIIII")
REPLY_HEADER = struct.Struct("<4sBBBQIII")  # magic, status, dtype, flags, seq, rows, hidden, message length

MAX_TOKEN = 256
MAX_LINK_OFFER = 1024
MAX_MESSAGE = 4096
MAX_EXPERTS = 1 << 16
MAX_ROWS = 1 << 24
MAX_HIDDEN = 1 << 17
MAX_PAYLOAD = 4 << 30  # one layer's rows for one replica; far above any real step

# an exchange of at most this many rows is a small one (a decode step's): the ingress polls for
# its replies, and the threads on its path run real-time (channel.py, realtime.py); at batch 64
# (128 rows, the bench's default shape) the poll cost 5% of decode throughput (240.9 against
# 253.7 tok/s, 3 interleaved rounds): it keeps the GIL from the ingress' event loop, which has 64
# streams to feed; at 16 or fewer rows it was even or ahead
SMALL_ROWS = 32

UNIX_PREFIX = "unix:@"  # an endpoint in Linux's abstract Unix socket namespace (per network namespace)


def parse_endpoint(endpoint: str) -> tuple[int, str | tuple[str, int]]:
    """(socket family, address) of "host:port", "[v6]:port" or "unix:@name"; ValueError names
    what is wrong."""
    if endpoint.startswith(UNIX_PREFIX):
        name = endpoint[len(UNIX_PREFIX):]
        if not name or "\0" in name or len(name) > 107:
            raise ValueError(f"bad Unix socket endpoint {endpoint!r}: the name must be 1-107 characters, no NUL")
        return socket.AF_UNIX, "\0" + name
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad endpoint {endpoint!r}: expected host:port, [v6]:port or {UNIX_PREFIX}name")
    host = host.strip("[]")
    return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))


class ProtocolError(ValueError):
    """A frame that is not ours or breaks a limit: the connection is closed."""


@dataclass(frozen=True)
class Request:
    seq: int
    layer: int
    rows: int
    hidden: int
    dtype: torch.dtype
    experts: list[int]
    counts: list[int]
    prefetch: list[tuple[int, int]]
    flags: int = 0
    top1: list[int] | None = None  # per expert, the rows whose first choice it is (RANKED)


class Reply(NamedTuple):  # a tuple: built once per exchange and replica on the hot path
    seq: int
    status: int
    rows: int
    hidden: int
    dtype: torch.dtype
    message: str = ""
    flags: int = 0


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _check_magic(magic: bytes) -> None:
    if magic != MAGIC:
        raise ProtocolError(f"not an expert-exchange frame (magic {magic!r})")


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot travel on the expert channel "
                            f"(supported: {', '.join(str(d) for d in DTYPES.values())})") from None


def _dtype(code: int) -> torch.dtype:
    try:
        return DTYPES[code]
    except KeyError:
        raise ProtocolError(f"unknown dtype code {code}") from None


def encode_hello(token: str, link: dict | None = None) -> bytes:
    raw = token.encode()
    offer = json.dumps(link).encode() if link else b""
    if len(raw) > MAX_TOKEN:
        raise ProtocolError(f"channel token longer than {MAX_TOKEN} bytes")
    if len(offer) > MAX_LINK_OFFER:
        raise ProtocolError(f"link offer longer than {MAX_LINK_OFFER} bytes")
    return HELLO_HEADER.pack(MAGIC, HELLO, len(raw), len(offer)) + raw + offer


def decode_hello_header(buf: bytes) -> tuple[int, int]:
    """Token length and link offer length of a hello header."""
    magic, kind, n, m = HELLO_HEADER.unpack(buf)
    _check_magic(bytes(magic))
    if kind != HELLO:
        raise ProtocolError(f"expected a hello, got frame kind {kind}")
    if n > MAX_TOKEN or m > MAX_LINK_OFFER:
        raise ProtocolError(f"hello of {n} + {m} bytes exceeds {MAX_TOKEN} + {MAX_LINK_OFFER}")
    return n, m


def decode_link_offer(raw: bytes) -> dict | None:
    if not raw:
        return None
    try:
        offer = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ProtocolError(f"link offer is not JSON: {err}") from None
    if not isinstance(offer, dict):
        raise ProtocolError("link offer is not an object")
    return offer


def encode_ack(status: int, message: str = "") -> bytes:
    raw = message.encode()[:MAX_MESSAGE]
    return ACK_HEADER.pack(MAGIC, status, len(raw)) + raw


def decode_ack_header(buf: bytes) -> tuple[int, int]:
    magic, status, n = ACK_HEADER.unpack(buf)
    _check_magic(bytes(magic))
    if n > MAX_MESSAGE:
        raise ProtocolError(f"message of {n} bytes exceeds {MAX_MESSAGE}")
    return status, n


def encode_request(seq: int, layer: int, rows: int, hidden: int, dtype: torch.dtype, experts: list[int],
                   counts: list[int], prefetch: list[tuple[int, int]] | None = None, flags: int = 0,
                   top1: list[int] | None = None) -> bytes:
    """Header and variable part of a request (the tensor bytes follow separately). `top1`: per
    expert, how many of its rows chose it first (sets RANKED)."""
    if len(experts) != len(counts):
        raise ProtocolError("experts and counts differ in length")
    if sum(counts) != rows:
        raise ProtocolError(f"counts sum to {sum(counts)}, not to the {rows} rows sent")
    if top1 is not None and len(top1) != len(experts):
        raise ProtocolError("experts and top-1 counts differ in length")
    n, m = len(experts), len(prefetch) if prefetch else 0
    ranked = top1 is not None
    return _request_struct(n, m, ranked).pack(
        MAGIC, EXPERTS, dtype_code(dtype), flags | (RANKED if ranked else 0), seq, layer, rows, hidden, n, m,
        *experts, *counts, *(top1 or ()), *(v for pair in prefetch or () for v in pair))


def _ints(n: int, m: int, ranked: bool) -> int:
    """int32 values in a request's variable part."""
    return (3 if ranked else 2) * n + 2 * m


@lru_cache(maxsize=1024)
def _request_struct(n: int, m: int, ranked: bool) -> struct.Struct:
    """Header and variable part of a request with n experts and m prefetch hints, as one
    compiled format (a request is one pack)."""
    ints = _ints(n, m, ranked)
    pad = _variable_size(n, m, ranked) - 4 * ints
    return struct.Struct(f"{REQUEST_HEADER.format}{ints}i{pad}x")


def decode_request_header(buf) -> tuple[int, int, int, int, torch.dtype, int, int, int, int]:
    """(seq, layer, rows, hidden, dtype, n_experts, n_prefetch, byte length of the variable part,
    flags)."""
    magic, kind, code, flags, seq, layer, rows, hidden, n_experts, n_prefetch = REQUEST_HEADER.unpack_from(buf)
    _check_magic(bytes(magic))
    if kind != EXPERTS:
        raise ProtocolError(f"expected an experts request, got frame kind {kind}")
    dtype = _dtype(code)
    if n_experts > MAX_EXPERTS or n_prefetch > MAX_EXPERTS:
        raise ProtocolError(f"{n_experts} experts / {n_prefetch} prefetch hints exceed {MAX_EXPERTS}")
    if rows > MAX_ROWS or hidden > MAX_HIDDEN or rows * hidden * _itemsize(dtype) > MAX_PAYLOAD:
        raise ProtocolError(f"{rows} x {hidden} rows exceed the frame limits")
    size = _variable_size(n_experts, n_prefetch, bool(flags & RANKED))
    return seq, layer, rows, hidden, dtype, n_experts, n_prefetch, size, flags


ALIGN = 16  # the tensor bytes start at a multiple of this, so the receiver can view them in place


def _variable_size(n_experts: int, n_prefetch: int, ranked: bool = False) -> int:
    """Bytes of a request's variable part, padded so that header + it is a multiple of ALIGN."""
    end = REQUEST_HEADER.size + 4 * _ints(n_experts, n_prefetch, ranked)
    return -(-end // ALIGN) * ALIGN - REQUEST_HEADER.size


@lru_cache(maxsize=1024)
def _body_struct(n_experts: int, n_prefetch: int, ranked: bool) -> struct.Struct:
    return struct.Struct(f"<{_ints(n_experts, n_prefetch, ranked)}i")


def decode_request_body(buf, offset: int, n_experts: int, n_prefetch: int, rows: int, flags: int = 0
                        ) -> tuple[list[int], list[int], list[tuple[int, int]], list[int] | None]:
    """(experts, counts, prefetch, top-1 counts or None) from the variable part at `offset` of `buf`."""
    ranked = bool(flags & RANKED)
    flat = _body_struct(n_experts, n_prefetch, ranked).unpack_from(buf, offset)
    experts, counts = list(flat[:n_experts]), list(flat[n_experts:2 * n_experts])
    top1 = list(flat[2 * n_experts:3 * n_experts]) if ranked else None
    pairs = flat[(3 if ranked else 2) * n_experts:]
    if any(c < 0 for c in counts) or sum(counts) != rows:
        raise ProtocolError(f"counts {counts} do not add up to the {rows} rows sent")
    if top1 is not None and any(t < 0 or t > c for t, c in zip(top1, counts)):
        raise ProtocolError(f"top-1 counts {top1} are not within the counts {counts}")
    return experts, counts, [(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2)], top1


def decode_request(header, variable) -> Request:
    seq, layer, rows, hidden, dtype, n_experts, n_prefetch, size, flags = decode_request_header(header)
    if len(variable) != size:
        raise ProtocolError(f"request body of {len(variable)} bytes, expected {size}")
    experts, counts, prefetch, top1 = decode_request_body(variable, 0, n_experts, n_prefetch, rows, flags)
    return Request(seq, layer, rows, hidden, dtype, experts, counts, prefetch, flags, top1)


def encode_reply(seq: int, status: int, rows: int = 0, hidden: int = 0, dtype: torch.dtype = torch.float32,
                 message: str = "", flags: int = 0) -> bytes:
    raw = message.encode()[:MAX_MESSAGE]
    return REPLY_HEADER.pack(MAGIC, status, dtype_code(dtype), flags, seq, rows, hidden, len(raw)) + raw


def decode_reply_header(buf) -> tuple[Reply, int]:
    """The reply (message not yet read) and the length of its message."""
    magic, status, code, flags, seq, rows, hidden, n = REPLY_HEADER.unpack_from(buf)
    _check_magic(bytes(magic))
    if status not in STATUS_NAMES:
        raise ProtocolError(f"unknown reply status {status}")
    if n > MAX_MESSAGE or rows > MAX_ROWS or hidden > MAX_HIDDEN:
        raise ProtocolError("reply exceeds the frame limits")
    return Reply(seq, status, rows, hidden, _dtype(code), flags=flags), n


def as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if t.dtype is not torch.bfloat16 and t.is_contiguous():
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _as_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype is torch.bfloat16 else t


def tensor_view(buf: np.ndarray, start: int, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """A (rows, hidden) tensor over bytes `start:` of a uint8 numpy buffer, without a copy
    (`start` a multiple of the dtype's size)."""
    return _as_torch(buf[start:start + rows * hidden * dtype.itemsize].view(_NUMPY[dtype]).reshape(rows, hidden),
                     dtype)


def empty_rows(rows: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, memoryview]:
    """A fresh (rows, hidden) tensor and a writable view of its bytes to receive into."""
    a = np.empty((rows, hidden), _NUMPY[dtype])
    return _as_torch(a, dtype), memoryview(a).cast("B")
