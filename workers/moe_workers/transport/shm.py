"""The expert exchange through shared memory, for an ingress and a shard replica on one node.

Over a Unix socket a small exchange costs each side a send and a receive syscall and the kernel's
copies; both ends are on one host, so the frames can instead be written where the peer reads
them. Each connection to a replica on this node can carry a `Segment`: a memfd the ingress
creates, sizes and seals (it can neither shrink nor grow, so neither side can make the other's
mapping fault), handed to the replica with the hello over the Unix socket (SCM_RIGHTS), after
which both map it. It holds two mailboxes (native_mailbox.c: a sequence word and a sleeping flag
each) and two frame areas:

    0      request mailbox        the ingress posts, the replica waits
    64     reply mailbox          the replica posts, the ingress waits
    4096   request area           a request frame exactly as wire.py lays it out (tensor at 16n)
    4096+C reply area             a reply frame as wire.py lays it out, placed so its tensor
                                  starts at REPLY_TENSOR_AT (aligned): the replica computes into it

The wake-up costs no syscall while the peer is awake: the waiter polls its mailbox for a while
(the ingress for a small exchange's reply, as the socket path polls; the replica briefly), then
sleeps on a futex, and a post wakes it only then. A frame larger than an area goes on the socket
as before, its mailbox post saying so (`ON_SOCKET`); the reply comes back the way the request
went.

Access: the segment has no name in any filesystem (no /dev/shm entry to permission, to fill, or
to leave behind: a Pod's /dev/shm is 64 MiB unless the user mounts more), and reaches only the
process at the other end of a Unix socket that proved the app's channel token in the same hello:
the replica maps it only after the token check (and after checking its seals and size), and
closes it unmapped otherwise. The memory goes back to the kernel with the last mapping: a dead
peer's segment is freed when the survivor closes the connection (`close()`), and nothing is left
when both are gone.

Faults: a wait sleeps in slices and between them asks the socket whether the peer closed it (a
process that dies closes it): the ingress every `SLICE_S`, so a replica killed mid-exchange is
noticed within one and the step fails over as on the socket path; an idle replica every
`IDLE_SLICE_S`, only to free a gone ingress' segment. Where the segment cannot be made (no
memfd, no compiler for the mailboxes or MOE_NATIVE=0, the replica refuses it or does not know the
offer) the connection stays on the socket path; the channel counts it and logs the reason once.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import select
import socket
import threading
import time
from pathlib import Path

import numpy as np

from moe_workers.model import native

from . import wire

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_mailbox.c")
FLAGS = ("-O2", "-fPIC", "-shared", "-std=gnu11")
HEAD = 4096  # mailboxes, then the areas from here (page-aligned)
REQUEST_BOX, REPLY_BOX = 0, 64
AREA_BYTES = 8 << 20  # per direction; a frame beyond this goes on the socket
MAX_SEGMENT = 1 << 30  # a replica maps no larger segment
MIN_AREA = 1 << 16  # nor one whose areas could not hold an error reply
REPLY_TENSOR_AT = 64  # in the reply area: the reply header ends here, the rows follow
REPLY_AT = REPLY_TENSOR_AT - wire.REPLY_HEADER.size
OFFER, ACCEPTED = "shm", "shm"  # the hello's key (the segment's size) and the ack's message taking it
IN_AREA, ON_SOCKET = 0, 1  # where a posted frame is (the word after the mailbox's two)
SLICE_S = 0.02  # a sleeping ingress checks on its replica this often (a dead one fails over)
IDLE_SLICE_S = 0.25  # an idle replica connection checks whether its ingress is gone (cleanup only)
SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)
F_ADD_SEALS, F_GET_SEALS, F_SEAL_SEAL = (getattr(fcntl, n, v) for n, v in (
    ("F_ADD_SEALS", 1033), ("F_GET_SEALS", 1034), ("F_SEAL_SEAL", 1)))

_lock = threading.Lock()
_state: dict[str, object] = {}


class ShmUnavailable(RuntimeError):
    """A segment cannot be made or mapped here; the message says why (the socket path is used)."""


def library() -> ctypes.CDLL | None:
    """The mailboxes' C functions, built on first use; None where they cannot be (`why()`)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, why = native.build_library((SOURCE,), FLAGS, "moe_mailbox")
                if lib is not None:
                    p, u, n, i = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_long, ctypes.c_int
                    # a post is a store (and at most a wake-up): called holding the GIL, which a
                    # release and re-take would cost more than (up to a switch interval when
                    # another thread is runnable); a wait releases it
                    post = ctypes.PyDLL(lib._name).moe_box_post
                    post.argtypes, post.restype = [p, u], i
                    lib.moe_box_wait.argtypes, lib.moe_box_wait.restype = [p, u, n, n, i], u
                    _state["post"] = post
                _state.update(lib=lib, why=why)
    return _state["lib"]  # type: ignore[return-value]


def why() -> str:
    library()
    return str(_state.get("why") or "")


class Mailbox:
    """One direction's mailbox at byte `offset` of a mapping (one poster, one waiter)."""

    def __init__(self, lib: ctypes.CDLL, words: np.ndarray, offset: int):
        self._post, self._wait = _state["post"], lib.moe_box_wait
        self.addr = words.ctypes.data + offset
        self._words = words[offset // 4:offset // 4 + 16]  # uint32: seq, sleeping, where
        self.seen = int(self._words[0])  # the last seq this side posted or took
        self.wakes = 0  # posts that had to wake the waiter (a syscall)

    def post(self, where: int = IN_AREA) -> None:
        """The frame is in place (or on the socket): publish it, waking the waiter if it sleeps."""
        self._words[2] = where  # ordered before the seq by the post's store
        self.seen = (self.seen + 1) & 0xFFFFFFFF
        self.wakes += self._post(self.addr, self.seen)

    def wait(self, spin_s: float, wait_s: float, yield_cpu: bool = True) -> int | None:
        """Where the next frame is (IN_AREA / ON_SOCKET), or None when `wait_s` passed first.
        Polls for `spin_s`, then sleeps (the GIL released throughout)."""
        seq = self._wait(self.addr, self.seen, int(spin_s * 1e9), int(wait_s * 1e9), yield_cpu)
        if seq == self.seen:
            return None
        self.seen = seq
        return int(self._words[2])


class Segment:
    """A connection's shared memory, mapped (see the module's docstring for its layout)."""

    def __init__(self, fd: int, size: int):
        lib = library()
        if lib is None:
            raise ShmUnavailable(f"no mailboxes: {why()}")
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as err:
            raise ShmUnavailable(f"mmap of {size} bytes: {err}") from None
        self.size = size
        self.area = (size - HEAD) // 2
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        words = self.bytes[:HEAD].view(np.uint32)
        self.request_box = Mailbox(lib, words, REQUEST_BOX)
        self.reply_box = Mailbox(lib, words, REPLY_BOX)
        self.request = self.bytes[HEAD:HEAD + self.area]
        self.reply = self.bytes[HEAD + self.area:HEAD + 2 * self.area]
        self.request_view = memoryview(self.request)
        self.reply_view = memoryview(self.reply)

    @staticmethod
    def create(area_bytes: int = AREA_BYTES) -> tuple["Segment", int]:
        """A new sealed segment with areas of `area_bytes` and its fd (to hand to the peer, then
        close)."""
        if not hasattr(os, "memfd_create"):
            raise ShmUnavailable("no memfd_create on this platform")
        area = -(-max(area_bytes, MIN_AREA) // mmap.PAGESIZE) * mmap.PAGESIZE
        size = HEAD + 2 * area
        try:
            fd = os.memfd_create("moe-exchange", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as err:
            raise ShmUnavailable(f"memfd_create: {err.strerror or err}") from None
        try:
            os.ftruncate(fd, size)  # pages are taken only where frames are written
            fcntl.fcntl(fd, F_ADD_SEALS, SEALS | F_SEAL_SEAL)
            return Segment(fd, size), fd
        except BaseException as err:
            os.close(fd)
            if isinstance(err, OSError):
                raise ShmUnavailable(f"sizing the segment ({size} bytes): {err.strerror or err}") from None
            raise

    @staticmethod
    def attach(fd: int) -> "Segment":
        """The peer's segment from its fd (the replica's side): refused unless sealed against
        shrinking and growing and of a sane size. The fd is the caller's to close."""
        try:
            seals = fcntl.fcntl(fd, F_GET_SEALS)
            size = os.fstat(fd).st_size
        except OSError as err:
            raise ShmUnavailable(f"not a sealed memfd: {err.strerror or err}") from None
        if seals & SEALS != SEALS:
            raise ShmUnavailable("segment not sealed against shrinking and growing")
        if not HEAD + 2 * MIN_AREA <= size <= MAX_SEGMENT or (size - HEAD) % (2 * mmap.PAGESIZE):
            raise ShmUnavailable(f"segment of {size} bytes (want {HEAD + 2 * MIN_AREA} to {MAX_SEGMENT}, "
                                 f"two areas of whole pages after {HEAD})")
        return Segment(fd, size)

    def close(self) -> None:
        for name in ("request_view", "reply_view", "request", "reply", "bytes", "request_box", "reply_box"):
            self.__dict__.pop(name, None)
        try:
            self._map.close()
        except BufferError:  # a view still held somewhere: the mapping goes with it
            pass


def wait_for(box: Mailbox, sock: socket.socket, until_s: float, spin_s: float = 0.0,
             slice_s: float = SLICE_S) -> int | None:
    """Where the next frame posted to `box` is, waiting until `until_s` (monotonic) at most:
    None when the time passed, ConnectionError when the peer closed `sock` meanwhile. Polls for
    `spin_s` first, then sleeps in slices of `slice_s`, asking the socket between them. The
    socket turns readable on the peer's close, and also when the ingress sends a frame too large
    for the area: it posts ON_SOCKET before it sends, so the mailbox is asked once more before a
    readable socket counts as a close."""
    where = box.wait(spin_s, min(spin_s + slice_s, max(0.0, until_s - time.monotonic())))
    poller = None
    while where is None:
        if poller is None:
            poller = select.poll()
            poller.register(sock, select.POLLIN)
        if poller.poll(0):
            where = box.wait(0.0, 0.0)
            if where is None:
                raise ConnectionError("peer closed the connection")
            return where
        left = until_s - time.monotonic()
        if left <= 0:
            return None
        where = box.wait(0.0, min(slice_s, left))
    return where


def send_hello(sock: socket.socket, hello: bytes, fd: int) -> None:
    """The hello with the segment's fd alongside (SCM_RIGHTS)."""
    socket.send_fds(sock, [hello], [fd])


def receive_hello_header(sock: socket.socket) -> tuple[bytes, list[int]]:
    """A hello header and the fds that came with it (none over TCP)."""
    if sock.family != socket.AF_UNIX:
        return b"", []
    data, fds, _flags, _addr = socket.recv_fds(sock, wire.HELLO_HEADER.size, 2, socket.MSG_WAITALL)
    return data, list(fds)
